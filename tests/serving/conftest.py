import pytest

from strop.engines.launch import LocalServer
from strop.parallel.launch import free_port


@pytest.fixture
def start_server(tiny_model_dir):
    """Start ``strop serve`` processes on the tiny model (one thread each); all are stopped after the test."""
    started = []

    def start(port=None, *extra):
        server = LocalServer(str(tiny_model_dir), port or free_port(), ["--threads=1", *extra]).start()
        started.append(server)
        return server.wait_healthy(120)

    yield start
    for s in started:
        s.stop()
