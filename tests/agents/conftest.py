from tests.serving.conftest import start_server  # noqa: F401  (strop serve processes on the tiny model)
