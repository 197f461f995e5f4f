"""The arrows between strop's modules, read from the source (issue 26: the layout shows the design).

An arrow ``a -> b`` is an ``import strop...`` of ``b`` anywhere in ``a``: at the top or inside a
function (a deferred import only moves the cost; ``a`` still needs ``b``). ``from p import n`` is an
arrow to ``p`` and, where ``p.n`` is a module, to ``p.n``. One import is no arrow:
``from strop.cli import main``, by which a launcher starts the whole program in a process of its own
(a server child's ``__main__``, a Ray actor); importing anything else from strop.cli is an arrow.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import strop

ROOT = Path(strop.__file__).parent

# importer (a module or a package, with everything under it) -> what it must never import, and why
NEVER = {
    "strop.config": (("strop.train", "strop.engines", "strop.parallel", "strop.rollout", "strop.cluster",
                      "strop.setup", "strop.loop", "strop.controller"),
                     "the config is checked before anything loads: it names things, it does not build them"),
    "strop.engines": (("strop.train", "strop.parallel", "strop.rollout", "strop.setup", "strop.loop",
                       "strop.controller"),
                      "engines serve the trainer; both take what they share from below (strop.models, "
                      "strop.cluster.process, strop.types)"),
    "strop.agents": (("strop.train", "strop.parallel", "strop.setup", "strop.loop", "strop.controller",
                      "strop.cluster.local", "strop.cluster.placement", "strop.cluster.ray_cluster"),
                     "the agent proxy stands between agent programs and the engines: it records tokens, it "
                     "neither trains nor places processes"),
    "strop.rollout": (("strop.agents",),
                      "the rollout knows an agent only as the generate function setup installs"),
    "strop.loop": (("strop.cli", "strop.cluster.local", "strop.cluster.ray", "strop.cluster.torchrun"),
                   "the driver does not know which launcher started it"),
    "strop.controller": (("strop.cli", "strop.cluster.local", "strop.cluster.ray", "strop.cluster.torchrun"),
                         "the driver does not know which launcher started it"),
}
# the bottom: what several layers share; each imports no other strop module
BOTTOM = ("strop.types", "strop.models", "strop.callables", "strop.cluster.process")


def module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def arrows(root: Path) -> dict[tuple[str, str], list[str]]:
    """``(importer, imported) -> ["path:line", ...]`` over every strop module under ``root``."""
    names = module_names(root)

    def owner(name: str) -> str | None:  # the module that ``import name`` loads last
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    found: dict[tuple[str, str], list[str]] = {}
    for importer, path in names.items():
        where = path.relative_to(root.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{where}:{node.lineno}: a relative import; strop imports by full name")
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names if a.name.startswith("strop.")]
            elif isinstance(node, ast.ImportFrom) and (node.module + ".").startswith("strop."):
                imported = [a.name for a in node.names]
                if (node.module, imported) == ("strop.cli", ["main"]):
                    continue  # a program start, not a use of the cli
                submodules = [f"{node.module}.{n}" for n in imported if f"{node.module}.{n}" in names]
                targets = [owner(node.module), *submodules]
            else:
                continue
            for target in targets:
                if target not in (None, "strop", importer):  # strop/__init__.py is empty
                    found.setdefault((importer, target), []).append(f"{where}:{node.lineno}")
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def cycle(edges) -> list[str] | None:
    """One import cycle of ``edges`` (``[a, b, ..., a]``), or None."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_no_import_cycles():
    """Arrows point one way: no module needs, even lazily, a module that needs it."""
    edges = arrows(ROOT)
    found = cycle(edges)
    assert found is None, "import cycle " + " -> ".join(found) + "; " + "; ".join(
        f"{a} -> {b} at {', '.join(edges[a, b])}" for a, b in zip(found, found[1:]))


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == ["a", "b", "c", "a"]
    assert cycle({("a", "b"), ("b", "c"), ("a", "c")}) is None


def test_no_arrow_points_up():
    wrong = []
    for (importer, imported), lines in sorted(arrows(ROOT).items()):
        for owner, (never, why) in NEVER.items():
            if _under(importer, owner) and any(_under(imported, p) for p in never):
                wrong.append(f"{importer} -> {imported} ({', '.join(lines)}): {why}")
        if any(_under(importer, b) for b in BOTTOM):
            wrong.append(f"{importer} -> {imported} ({', '.join(lines)}): the bottom imports no strop module")
    assert not wrong, "\n".join(wrong)


@pytest.mark.timeout(60)
def test_the_config_loads_without_torch():
    """``strop train --help`` and a config check need no torch (seconds of import)."""
    out = subprocess.run([sys.executable, "-c", "import strop.config, sys; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True, cwd=ROOT.parent)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_driver_fits_on_a_screen():
    """loop.py reads as the run's story: what rank 0 does in detail lives in strop.controller."""
    lines = len((ROOT / "loop.py").read_text().splitlines())
    assert lines <= 250, f"strop/loop.py has {lines} lines"
