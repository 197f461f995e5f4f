import pytest

from strop.engines.launch import LocalServer
from strop.process import free_port


@pytest.fixture
def start_server(tiny_model_dir, tmp_path):
    """Start ``strop serve`` processes on the tiny model (one thread each, weights loaded from the
    test's tmp_path); all are stopped after the test."""
    started = []

    def start(port=None, *extra):
        args = ["--threads=1", f"--weights-dir={tmp_path}", *extra]
        token = next((a.removeprefix("--token=") for a in extra if a.startswith("--token=")), None)
        server = LocalServer(str(tiny_model_dir), port or free_port(), args, token=token, port_retries=0 if port else 2)
        server.start()
        started.append(server)
        return server.wait_healthy(120)

    yield start
    for s in started:
        s.stop()
