import os

# Before anything loads torch (and its OpenMP runtime, which reads this once): the suite runs two pytest workers
# on two cores, and their processes' OpenMP threads, spinning while they wait, took the cores from each other.
# Measured with a quickstart test and a strop serve judge test side by side: 110 s and 85 s spinning, 49 s and 22 s
# passive. Workers and every process a test starts inherit it; a policy set outside is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging

import pytest

from tests.tiny import make_tiny_model

logging.getLogger("math_verify").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def tokenizer_dir():
    """The embedded model's folder (converted once from the packaged GGUF); we use its tokenizer."""
    from strop.models import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from strop.models import load_tokenizer

    return load_tokenizer(str(tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def device():
    """The one place tests get their device: CUDA where a GPU is present (STROP_TEST_DEVICE overrides)."""
    import os

    import torch

    return os.environ.get("STROP_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def tiny_model():
    return make_tiny_model()


# The suite runs on two pytest-xdist workers (pyproject's addopts: -n 2). Each file stays on one worker, so
# its module fixtures (a vLLM server, a Ray cluster) start once. The files that start engines, clusters or
# several training processes are one unit: they run one after another on one worker, never beside each
# other, while the other worker takes the in-process files. (A scheduler of our own: xdist's loadgroup
# marks do not reach its scheduler under pytest 9.2.)
SERIAL = ("tests/cluster/", "tests/distributed/", "tests/serving/test_vllm")


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return "serial" if path.startswith(SERIAL) else path

    return ByFile(config, log)
