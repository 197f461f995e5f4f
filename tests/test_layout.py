"""The arrows between strop's modules, read from the source: the layout shows the design.

An arrow ``a -> b`` is an ``import strop...`` of ``b`` anywhere in ``a``: at the top or inside a
function (a deferred import only moves the cost; ``a`` still needs ``b``). ``from p import n`` is an
arrow to ``p`` and, where ``p.n`` is a module, to ``p.n``. There are no exemptions: a launcher is
handed the program it starts and never imports the front door.

The floors below are the map ``docs/architecture.md`` draws; a module may import its own floor or any
floor below, never one above, and no import, even a deferred one, closes a circle.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import strop

ROOT = Path(strop.__file__).parent

# the floors, top first: each names the modules (a module or a package, with everything under it) on it
FLOORS = (
    ("the Python API", ("strop",)),  # strop/__init__.py alone (``strop.train``, ``strop.Config``)
    ("front door", ("strop.cli",)),
    ("the run", ("strop.loop", "strop.roles")),
    ("assembly", ("strop.setup", "strop.setup_remote", "strop.contracts")),
    ("agents and environments", ("strop.agents", "strop.envs")),
    ("rollout", ("strop.rollout",)),
    ("sides of the wire", ("strop.train", "strop.engines", "strop.sync", "strop.serving", "strop.cluster")),
    ("parts", ("strop.parallel", "strop.checkpoint", "strop.plugins", "strop.observe", "strop.data", "strop.tools")),
    (
        "the wire and the config",
        (
            "strop.wire",
            "strop.algo",
            "strop.models",
            "strop.config",
            "strop.rules",
            "strop.rule_reasons",
            "strop.presets",
            "strop.plugins_config",
            "strop.configbase",
        ),
    ),
    ("ground", ("strop.types", "strop.callables", "strop.process", "strop.openmp")),
)
# a config section lives beside the code it configures but sits with the config: it names, it builds nothing
CONFIG_SECTION = "config"
# the two sides of the wire: neither imports the other; both take what they share from strop.wire
ENGINE_SIDE = ("strop.serving",)
TRAINER_SIDE = ("strop.engines", "strop.sync")
# the one module that may ask an engine what it can do
PROTOCOLS = "strop/engines/base.py"


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
                targets = [owner(a.name) for a in node.names if _under(a.name, "strop")]
            elif isinstance(node, ast.ImportFrom) and (node.module + ".").startswith("strop."):
                submodules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in names]
                # ``from strop import checkpoint`` names a module only: no arrow to the package's API
                whole = node.module != "strop" or len(submodules) < len(node.names)
                targets = [owner(node.module)] * whole + submodules
            else:
                continue
            for target in targets:
                if target not in (None, importer):
                    found.setdefault((importer, target), []).append(f"{where}:{node.lineno}")
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def floor(name: str) -> int | None:
    """The floor of module ``name`` (0: the top), by its longest matching entry; None: on no floor."""
    if name.rpartition(".")[2] == CONFIG_SECTION:
        return next(i for i, (what, _) in enumerate(FLOORS) if what == "the wire and the config")
    best = None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            # the package itself (its API) is a floor of its own: the entry "strop" holds no module under it
            if (_under(name, p) if p != "strop" else name == p) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


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
                return path[path.index(nxt) :] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def upward(edges: dict) -> list[str]:
    """Every arrow from a lower floor to a higher one, and every module on no floor."""
    wrong = []
    for (importer, imported), lines in sorted(edges.items()):
        a, b = floor(importer), floor(imported)
        for name, f in ((importer, a), (imported, b)):
            if f is None:
                wrong.append(f"{name} is on no floor of tests/test_layout.py FLOORS (add it where it belongs)")
        if a is not None and b is not None and b < a:
            wrong.append(f"{importer} ({FLOORS[a][0]}) -> {imported} ({FLOORS[b][0]}) at {', '.join(lines)}")
    return sorted(set(wrong))


def across_the_wire(edges: dict) -> list[str]:
    """Every arrow between the engine's side and the trainer's side."""
    wrong = []
    for (importer, imported), lines in sorted(edges.items()):
        for here, there in ((ENGINE_SIDE, TRAINER_SIDE), (TRAINER_SIDE, ENGINE_SIDE)):
            if any(_under(importer, p) for p in here) and any(_under(imported, p) for p in there):
                wrong.append(f"{importer} -> {imported} at {', '.join(lines)}")
    return wrong


def _names_an_engine(node: ast.AST) -> bool:
    """``engine``, ``self.engine``, ``self.c.engine``, ``self._engine``, ``server``: a reference to an engine."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "engine" in name.lower()


def probes(root: Path) -> list[str]:
    """Every ``getattr(<an engine>, ...)`` / ``hasattr(<an engine>, ...)`` outside the protocol module."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()
        if where == PROTOCOLS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and _names_an_engine(node.args[0])
            ):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_import_cycles():
    """Arrows point one way: no module needs, even lazily, a module that needs it."""
    edges = arrows(ROOT)
    found = cycle(edges)
    assert found is None, (
        "import cycle "
        + " -> ".join(found)
        + "; "
        + "; ".join(f"{a} -> {b} at {', '.join(edges[a, b])}" for a, b in zip(found, found[1:]))
    )


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == ["a", "b", "c", "a"]
    assert cycle({("a", "b"), ("b", "c"), ("a", "c")}) is None


def test_no_arrow_points_up():
    """Every module is on a floor, and imports only its own floor or those below."""
    wrong = upward(arrows(ROOT))
    assert not wrong, "\n".join(wrong)


def test_the_floor_check_finds_an_upward_arrow():
    edges = {
        ("strop.types", "strop.cli"): ["strop/types.py:1"],
        ("strop.cli", "strop.types"): ["strop/cli.py:1"],
        ("strop.algo.config", "strop.configbase"): ["strop/algo/config.py:1"],
    }
    assert upward(edges) == ["strop.types (ground) -> strop.cli (front door) at strop/types.py:1"]
    assert upward({("strop.nowhere", "strop.types"): ["x"]}) == [
        "strop.nowhere is on no floor of tests/test_layout.py FLOORS (add it where it belongs)"
    ]


def test_the_two_sides_of_the_wire_never_import_each_other():
    """strop.serving runs inside an engine process; strop.engines and strop.sync are the trainer's view of it."""
    wrong = across_the_wire(arrows(ROOT))
    assert not wrong, "\n".join(wrong)
    assert across_the_wire({("strop.engines.router", "strop.serving.probe"): ["r:1"]}) == [
        "strop.engines.router -> strop.serving.probe at r:1"
    ]


def test_nothing_imports_the_front_door():
    """A launcher is handed the program it starts: no module but the cli imports strop.cli."""
    wrong = [f"{a} at {', '.join(lines)}" for (a, b), lines in sorted(arrows(ROOT).items()) if b == "strop.cli"]
    assert not wrong, "\n".join(wrong)


def test_engines_are_asked_what_they_can_do_only_through_the_protocols():
    """A capability is an isinstance check on a protocol of strop.engines.base, never a getattr probe."""
    found = probes(ROOT)
    assert not found, "\n".join(found)


def test_the_probe_finder_finds_a_probe(tmp_path):
    (tmp_path / "x.py").write_text("v = getattr(self.c.engine, 'weight_version', None)\nw = getattr(cfg, 'a')\n")
    assert probes(tmp_path) == [f"{tmp_path.name}/x.py:1: getattr(self.c.engine, 'weight_version', None)"]


@pytest.mark.timeout(60)
def test_the_config_loads_without_torch():
    """``strop train --help`` and a config check need no torch (seconds of import)."""
    out = subprocess.run(
        [sys.executable, "-c", "import strop.config, sys; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT.parent,
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_driver_fits_on_a_screen():
    """loop.py reads as the run's story: the roles it calls hold the detail."""
    lines = len((ROOT / "loop.py").read_text().splitlines())
    assert lines <= 250, f"strop/loop.py has {lines} lines"


LIMITS = {"file": 450, "class": 300, "function": 80}


def oversized(root: Path) -> list[str]:
    """Every file, class and function of ``root`` longer than LIMITS (lines, docstrings included)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where, text = path.relative_to(root.parent).as_posix(), path.read_text()
        if (n := len(text.splitlines())) > LIMITS["file"]:
            found.append(f"{where}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            kind = (
                "class"
                if isinstance(node, ast.ClassDef)
                else "function"
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else None
            )
            if kind and (n := node.end_lineno - node.lineno + 1) > LIMITS[kind]:
                found.append(f"{where}:{node.lineno}: {kind} {node.name} has {n} lines")
    return found


def test_every_file_class_and_function_fits_its_limit():
    found = oversized(ROOT)
    assert not found, f"over the limits {LIMITS}:\n" + "\n".join(found)


def test_the_size_check_finds_a_long_function(tmp_path):
    (tmp_path / "long.py").write_text("def f():\n" + "    x = 1\n" * 80)
    assert oversized(tmp_path) == [f"{tmp_path.name}/long.py:1: function f has 81 lines"]


def floors_in_the_map(text: str) -> dict[str, set[str]]:
    """The floor table of docs/architecture.md: floor name -> the modules its row names."""
    import re

    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2 and cells[0] not in ("floor", "---"):
            rows[cells[0]] = {m for m in re.findall(r"`(strop[\w.]*)`", cells[1])}
    return rows


def test_the_map_in_the_docs_shows_these_floors():
    """docs/architecture.md's floor table names exactly the floors and modules of FLOORS, in order."""
    rows = floors_in_the_map((ROOT.parent / "docs" / "architecture.md").read_text())
    assert list(rows) == [name for name, _ in FLOORS]
    for name, prefixes in FLOORS:
        assert rows[name] == set(prefixes), f"floor {name!r}: docs {sorted(rows[name])} != test {sorted(prefixes)}"
