"""The bytes both sides of the wire agree on: engine errors, weight versions, manifests, buckets,
digests, the weight-update group, and the token check. Imported by the engine side (strop.serving) and
the trainer side (strop.engines, strop.sync) alike; it imports neither."""
