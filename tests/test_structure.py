"""The seams the trainer issue asked for, checked on the source itself."""

import ast
from pathlib import Path

import strop

ROOT = Path(strop.__file__).parent


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_parallel_never_imports_train():
    offenders = {
        p.name: m for p in (ROOT / "parallel").glob("*.py") for m in _imports(p) if m.startswith("strop.train")
    }
    assert not offenders, offenders


def test_trainer_is_short_and_free_of_torch_distributed():
    path = ROOT / "train" / "trainer.py"
    assert len(path.read_text().splitlines()) <= 250
    assert not any(m.startswith("torch.distributed") for m in _imports(path))


def test_algo_is_pure():
    for p in (ROOT / "algo").glob("*.py"):
        assert not any(m.startswith(("torch.distributed", "strop.train", "strop.parallel")) for m in _imports(p)), p
