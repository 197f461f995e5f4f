import getpass
import os
import shutil
import tempfile

# Before anything loads torch (and its OpenMP runtime, which reads this once): the suite runs two pytest workers
# on two cores, and their processes' OpenMP threads, spinning while they wait, took the cores from each other.
# Measured with a quickstart test and a strop serve judge test side by side: 110 s and 85 s spinning, 49 s and 22 s
# passive. Workers and every process a test starts inherit it; a policy set outside is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging

import pytest

from tests.tiny import make_tiny_model

logging.getLogger("math_verify").setLevel(logging.ERROR)


def _one_tmpdir() -> bool:
    """Every temporary file of the run, the processes' the tests start included (servers' logs, the folders of
    sandboxes whose trainer a test kills, vLLM's sockets, Ray's sessions), in one folder, removed when the run ends:
    a full run left about 200 entries in /tmp. The first process makes it (True: it is that process); xdist's
    workers inherit its TMPDIR. Inductor's compile cache stays where torch keeps it by default, across runs."""
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    )
    own = "STROP_TEST_TMPDIR" not in os.environ
    if own:
        os.environ["STROP_TEST_TMPDIR"] = tempfile.mkdtemp(prefix="st-")  # (short: Unix sockets go under it)
        os.chmod(os.environ["STROP_TEST_TMPDIR"], 0o711)  # (a sandbox's user, not the tests', enters its folder)
    os.environ["TMPDIR"] = os.environ["STROP_TEST_TMPDIR"]
    tempfile.tempdir = None  # (read TMPDIR again)
    return own


_OWN_TMPDIR = _one_tmpdir()


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
# ... except these, each test two tiny-model ranks in this process's children on gloo (no engine, cluster or
# launcher): they run beside the in-process files. The serial unit was the run's critical path (about 2500 s of a
# 2589 s run on a 2-core AMD EPYC, the other worker idle at the end); these three took about 300 s of it.
BESIDE = ("tests/distributed/test_cp.py", "tests/distributed/test_dp.py", "tests/distributed/test_ep.py")


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return "serial" if path.startswith(SERIAL) and not path.startswith(BESIDE) else path

    return ByFile(config, log)


def pytest_unconfigure(config):
    if _OWN_TMPDIR:  # at the interpreter's exit, after multiprocessing removed its own folder in it (priority -100)
        from multiprocessing import util

        util.Finalize(
            None, shutil.rmtree, (os.environ["STROP_TEST_TMPDIR"],), {"ignore_errors": True}, exitpriority=-101
        )
