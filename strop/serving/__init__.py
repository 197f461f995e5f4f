"""What runs inside an engine process: the batching engine, its decoder, weight receipt and strop serve's routes.

Nothing here imports the trainer's side (strop.engines, strop.sync); both take what they share from strop.wire."""
