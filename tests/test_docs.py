"""The user docs (README.md, docs/*.md) say only what the software does.

- every ``strop ...`` command line they show (in bash blocks and inline code) parses: ``strop train`` and
  ``strop rollout`` lines build their config (the command line's own options, then ``parse_overrides`` and
  ``build_config``, no model loads), every other command's ``--help`` exits 0 and lists each option the line uses;
- every ``section.key`` they name is an option of the config, and every YAML config block builds;
- every relative link (and its #anchor), every repository path and every ``strop.module`` they name exists;
- they speak of the software, not of the issue, session or wave that built it (docs/benchmarks.md keeps the
  dated history).

Fast: the config is torch-free and no command runs past its argument handling.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from strop.config import Config, ConfigError, build_config, parse_overrides
from strop.presets import PRESETS

ROOT = Path(__file__).resolve().parent.parent
HISTORY = {"docs/benchmarks.md"}  # the dated measurements, with the work that led to them
COMMANDS = ("train", "rollout", "eval", "serve", "proxy", "plot", "check-plugin", "export")
SHELLS = ("bash", "sh", "shell", "console")
# dotted names in the docs that look like options but are code: a Hugging Face method, not strop's config
NOT_OPTIONS = {"model.generate"}
# how a placeholder a doc line shows is filled in to check the rest of the line
FILL = {
    "N": "2",
    "NAME": "grpo",
    "FILE": "samples.jsonl",
    "RUN_DIR": "runs/x",
    "CHECKPOINT": "runs/x/checkpoints/step_000010",
}
FILE_EXT = r"\.(?:md|py|ya?ml|jsonl?|parquet|sh|toml|txt|png|cfg|safetensors|log)\b"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def spans(path: Path) -> list[tuple[int, str, str]]:
    """(line, text, where) of a doc: ``where`` is a fenced block's language ('' for none) for each of its
    lines (a line ending in a backslash joined with the next), or 'inline' for each `code span` outside them."""
    out, lines, fence, i = [], path.read_text().splitlines(), None, 0
    while i < len(lines):
        line, no = lines[i], i + 1
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:].strip()
        elif fence is not None:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            out.append((no, line, fence))
        else:
            out += [(no, m.group(1), "inline") for m in re.finditer(r"`([^`]+)`", line)]
        i += 1
    return out


def prose(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text().splitlines(), 1))


def option_names(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, object]:
    """Every dotted option of the config tree (sections too) -> its annotation."""
    out = {}
    for name, field in model.model_fields.items():
        out[prefix + name] = field.annotation
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out |= option_names(field.annotation, f"{prefix}{name}.")
    return out


OPTIONS = option_names()
SECTIONS = tuple(Config.model_fields)


def known_option(name: str) -> bool:
    """``name`` is an option, or a key inside a dict-valued option (``data.task_options.min_value``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        head = ".".join(parts[:n])
        if head in OPTIONS:
            return n == len(parts) or "dict" in str(OPTIONS[head]).lower()
    return False


# --- 1. command lines ------------------------------------------------------------------------------------------

CMD = re.compile(r"(?:^|&&\s*|;\s*|\$\s+|\.venv/bin/)(strop\s+[a-z][\w-]*(?=\s|$).*|torchrun\s.*?-m\s+strop\.cli\s.*)")


def command_lines() -> list[tuple[str, str]]:
    """(where, command) for every strop command line the docs show."""
    found = []
    for path in doc_files():
        for no, text, where in spans(path):
            if where not in SHELLS + ("inline",):
                continue
            m = CMD.search(text.strip())
            if not m:
                continue
            cmd = re.sub(r"^torchrun\s.*?-m\s+strop\.cli\s", "strop ", m.group(1))
            word = cmd.split()[1]
            if where == "inline" and word not in COMMANDS and "--" not in cmd:
                continue  # prose naming strop: `strop before` in a table header
            found.append((f"{rel(path)}:{no}", cmd))
    return found


def tokens(cmd: str) -> list[str] | None:
    """The line as argv after ``strop``, placeholders filled in; None where one cannot be (``<...>``, ``...``)."""
    try:
        argv = shlex.split(cmd, comments=True)[1:]
    except ValueError:
        return None
    out = []
    for tok in argv:
        if tok in ("...", "…") or "<" in tok or tok in ("|", "&&", ";"):
            return None
        while tok.startswith("["):  # a usage line's optional parts: [--out FILE], not a JSON list's brackets
            tok = tok[1:]
        while tok.endswith("]") and tok.count("]") > tok.count("["):
            tok = tok[:-1]
        if not tok or tok.endswith(("...", "…")):
            continue
        tok = re.sub(r"\$\{?\w+\}?", "10.0.0.1", tok)  # a shell variable: "$head:6379"
        for word, value in FILL.items():
            tok = re.sub(rf"(?<![\w/.-]){word}(?![\w/.-])", value, tok)
        out.append(tok)
    return out


def _take(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    for i, arg in enumerate(argv):
        if arg == name:
            return (argv[i + 1] if i + 1 < len(argv) else ""), argv[:i] + argv[i + 2 :]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
    return None, argv


def check_run_line(command: str, argv: list[str], tmp_path: Path) -> None:
    """What ``strop train`` / ``strop rollout`` do with their arguments before anything loads."""
    preset, argv = _take(argv, "--preset")
    _, argv = _take(argv, "--log-level")
    assert preset is None or preset in PRESETS, f"--preset {preset!r}: no such preset ({sorted(PRESETS)})"
    if command in ("rollout", "eval"):
        out, argv = _take(argv, "--out")
        assert out != "", "--out needs a file"
    else:
        nproc, argv = _take(argv, "--nproc")
        assert nproc is None or nproc.isdigit() and int(nproc) > 0, f"--nproc must be a positive integer: {nproc!r}"
        resume, argv = _take(argv, "--resume")
        allow, argv = _take(argv, "--allow-change")
        assert resume != "" and allow != "", "--resume needs RUN_DIR or 'latest'; --allow-change needs field names"
        assert allow is None or resume is not None, "--allow-change only applies with --resume"
        for name in (allow or "").split(","):
            assert not name or known_option(name), f"--allow-change {name}: no such option"
    yaml_path = None
    for i, arg in enumerate(argv):  # the config file: anywhere on the line
        if not arg.startswith("-") and (i == 0 or arg.endswith((".yaml", ".yml"))):
            yaml_path, argv = arg, argv[:i] + argv[i + 1 :]
            break
    if yaml_path is not None:
        if not (ROOT / yaml_path).is_file():  # a name for the reader's own file (my.yaml): an empty one
            (tmp_path / "placeholder.yaml").write_text("{}\n")
            yaml_path = tmp_path / "placeholder.yaml"
        yaml_path = str(ROOT / yaml_path)
    assert all(a.startswith("-") or i and argv[i - 1].startswith("-") for i, a in enumerate(argv)), argv
    build_config(yaml_path, parse_overrides(argv, prog=f"strop {command}"), preset=preset)


def help_text(command: str, capsys, flags: tuple[str, ...] | list[str] = ("--help",)) -> str:
    from strop.cli import main

    capsys.readouterr()
    try:
        code = main([command, *flags])
    except SystemExit as exc:
        code = exc.code
    text = capsys.readouterr().out
    assert code in (0, None), f"strop {command} --help exited {code}"
    return text


LINES = command_lines()


def test_the_docs_show_strop_commands():
    assert len(LINES) > 50, LINES  # the collector still finds them


@pytest.mark.parametrize("where,cmd", LINES, ids=[w for w, _ in LINES])
def test_every_strop_command_line_in_the_docs_is_valid(where, cmd, tmp_path, capsys):
    argv = tokens(cmd)
    if argv is None:
        pytest.skip(f"{where}: a placeholder that cannot be filled in: {cmd}")
    assert argv and argv[0] in COMMANDS, f"{where}: `strop {argv[0] if argv else ''}` is no strop command"
    command, rest = argv[0], argv[1:]
    if any(arg in ("-h", "--help", "--help-all") for arg in rest):
        help_text(command, capsys, rest)
        return
    if command in ("train", "rollout", "eval"):
        try:
            check_run_line(command, rest, tmp_path)
        except (ConfigError, AssertionError, SystemExit) as exc:
            pytest.fail(f"{where}: `{cmd}` is refused:\n{exc}")
        return
    listed = help_text(command, capsys)
    for arg in rest:
        if arg.startswith("--"):
            assert re.search(rf"{re.escape(arg.split('=', 1)[0])}\b", listed), (
                f"{where}: `strop {command}` has no option {arg.split('=', 1)[0]} (`strop {command} --help`)"
            )


def test_strop_help_exits_0(capsys):
    from strop.cli import main

    assert main(["--help"]) == 0
    assert "strop train" in capsys.readouterr().out


# --- 2. option names ------------------------------------------------------------------------------------------

DOTTED = re.compile(rf"(?<![\w./])((?:{'|'.join(SECTIONS)})(?:\.\w+)+)(\*|\(|{FILE_EXT})?")
PEER_OWNED = re.compile(r"\b(?:TRL|verl|slime|OpenRLHF)'s\W")  # "verl's `ppo_mini_batch_size` ... `rollout.n`"
PEERS = re.compile(r"\b(?:TRL|verl|slime|OpenRLHF|AReaL|SkyRL|SGLang|vLLM)\b")


def foreign_columns(lines: list[str]) -> dict[int, set[int]]:
    """Line index -> the table columns (by cell index) headed by another framework's name: those cells
    name its options, not strop's (docs/migrating.md's verl column holds ``data.train_files``)."""
    out, header = {}, None
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            header = None
            continue
        cells = line.split("|")
        if header is None:
            header = {k for k, cell in enumerate(cells) if PEERS.search(cell)}
        out[i] = header
    return out


def test_every_option_the_docs_name_exists():
    wrong = []
    for path in doc_files():
        text = path.read_text()
        lines = text.splitlines()
        foreign = foreign_columns(lines)
        starts = [0] + [m.end() for m in re.finditer("\n", text)]
        for m in DOTTED.finditer(text):
            name, after = m.group(1), m.group(2)
            if after and after != "*" or name in NOT_OPTIONS or re.search(FILE_EXT + "$", name):
                continue  # a call (rollout.next(step)) or a file (run.yaml, tools.md)
            no = next(i for i in range(len(starts) - 1, -1, -1) if starts[i] <= m.start())
            cell = text[starts[no] : m.start()].count("|")
            if cell in foreign.get(no, ()) or PEER_OWNED.search(text[m.start() - 80 : m.start()]):
                continue  # another framework's option, named as such
            ok = any(o.startswith(name) for o in OPTIONS) if after == "*" else known_option(name)
            if not ok:
                wrong.append(f"{rel(path)}:{no + 1}: {name}")
    assert not wrong, "options the config does not have:\n" + "\n".join(wrong)


def test_every_yaml_config_block_builds(tmp_path):
    blocks, checked = [], 0
    for path in doc_files():
        text = path.read_text()
        for m in re.finditer(r"^```ya?ml\n(.*?)^```", text, re.S | re.M):
            blocks.append((f"{rel(path)}:{text[: m.start()].count(chr(10)) + 1}", m.group(1)))
    for where, block in blocks:
        data = yaml.safe_load(block)
        if not isinstance(data, dict) or not set(data) <= set(SECTIONS) | {"preset"}:
            continue  # not a strop config (a Kubernetes manifest)
        (tmp_path / "c.yaml").write_text(block)
        try:
            build_config(str(tmp_path / "c.yaml"))
        except ConfigError as exc:
            pytest.fail(f"{where}: this config is refused:\n{exc}")
        checked += 1
    assert checked >= 1


# --- 3. links, paths, modules ---------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, links as their text, punctuation but - and _ dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            base, n = slug(line.lstrip("#")), 1
            name = base
            while name in out:
                name, n = f"{base}-{n}", n + 1
            out.add(name)
    return out


UP_PATH = re.compile(r"`(\.\./[^`\s]*[A-Za-z][^`\s]*)`")


def test_every_relative_link_and_anchor_exists():
    wrong = []
    for path in doc_files():
        for no, line in prose(path):
            for m in re.finditer(r"\]\(([^)\s]+)\)", line):
                target = m.group(1)
                if re.match(r"[a-z]+://|mailto:", target):
                    inside = re.search(r"/(?:blob|tree|raw)/[^/]+/([^#?]+)", target)  # a GitHub file address
                    if inside and (ROOT / inside.group(1)).exists():
                        wrong.append(f"{rel(path)}:{no}: {target}: links outside to {inside.group(1)}, a local file")
                    continue
                file, _, anchor = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                if not dest.is_relative_to(ROOT):
                    wrong.append(f"{rel(path)}:{no}: {target}: outside the repository")
                elif not dest.exists():
                    wrong.append(f"{rel(path)}:{no}: {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    wrong.append(f"{rel(path)}:{no}: {target}: no such heading in {rel(dest)}")
            for m in UP_PATH.finditer(line):  # a path a reader of the repository may not have
                seen = [(base / m.group(1)).resolve() for base in (path.parent, ROOT)]
                if not any(p.is_relative_to(ROOT) and p.exists() for p in seen):
                    wrong.append(f"{rel(path)}:{no}: {m.group(1)}: not a file of the repository")
    assert not wrong, "\n".join(wrong)


PATH = re.compile(rf"(?<![\w/.-])((?:strop|tests|bench|scripts|examples|docs)/[\w/.-]*?{FILE_EXT})(?:::?(\w+))?")


def defines(source: str, name: str) -> bool:
    pattern = rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^{name}\s*[:=]|^from .* import (?:\([^)]*)?\b{name}\b"
    return bool(re.search(pattern, source, re.M))


IMPORT_PATH = re.compile(r"(?<![\w./-])((?:examples|strop)(?:\.\w+)+):(\w+)")
TEST_NAMES = {name for f in (ROOT / "tests").rglob("*.py") for name in re.findall(r"def (test_\w+)", f.read_text())}


def test_every_path_the_docs_name_exists():
    wrong = []
    for path in doc_files():
        for no, line in prose(path):
            for m in PATH.finditer(line):
                file, name = ROOT / m.group(1), m.group(2)
                if not file.exists():
                    wrong.append(f"{rel(path)}:{no}: {m.group(1)}: no such file")
                elif name and file.suffix == ".py" and not defines(file.read_text(), name):
                    wrong.append(f"{rel(path)}:{no}: {m.group(0)}: {name} is not defined there")
            for m in IMPORT_PATH.finditer(line):  # a hook's import path: examples.plugins.rewards:concise_math_reward
                file = ROOT / (m.group(1).replace(".", "/") + ".py")
                if not file.is_file() or not defines(file.read_text(), m.group(2)):
                    wrong.append(f"{rel(path)}:{no}: {m.group(0)}: no such function")
            for m in re.finditer(r"`(?:[\w/.]*::)?(test_\w+)", line):  # a test named alone: some test file has it
                if m.group(1) not in TEST_NAMES:
                    wrong.append(f"{rel(path)}:{no}: {m.group(1)}: no such test under tests/")
    assert not wrong, "\n".join(wrong)


MODULE = re.compile(r"(?<![\w./-])strop((?:\.\w+)+)")


def resolve(dotted: str) -> str | None:
    """None where ``strop.<dotted>`` names a module (and an attribute it defines), else what is missing."""
    parts, here = dotted.strip(".").split("."), ROOT / "strop"
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
            continue
        if (here / f"{part}.py").is_file():
            attr = parts[i + 1] if i + 1 < len(parts) else None
            if attr is None or defines((here / f"{part}.py").read_text(), attr):
                return None
            return f"{attr} is not defined in {rel(here / f'{part}.py')}"
        init = here / "__init__.py"
        lazy = rf"[\"']{part}[\"']\s*:"  # a name the package loads on first use (strop.Config)
        if init.is_file() and (defines(init.read_text(), part) or re.search(lazy, init.read_text())):
            return None
        return f"no module {part} in {rel(here)}"
    return None


def test_every_strop_module_the_docs_name_exists():
    wrong = []
    for path in doc_files():
        for no, line in prose(path):
            for m in MODULE.finditer(line):
                why = resolve(m.group(1))
                if why:
                    wrong.append(f"{rel(path)}:{no}: strop{m.group(1)}: {why}")
    assert not wrong, "\n".join(wrong)


# --- 4. the software, not its history ---------------------------------------------------------------------------

HISTORY_WORDS = re.compile(r"\b(?:issues?|sessions?|waves?)\s*#?\d+", re.I)


def test_the_docs_speak_of_the_software_not_of_issues_sessions_or_waves():
    wrong = [
        f"{rel(path)}:{no}: {line.strip()[:120]}"
        for path in doc_files()
        if rel(path) not in HISTORY and "changelog" not in path.name
        for no, line in prose(path)
        if HISTORY_WORDS.search(line)
    ]
    assert not wrong, "history belongs in docs/benchmarks.md's dated sections:\n" + "\n".join(wrong)
