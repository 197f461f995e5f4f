"""Run tracking: TensorBoard and Weights & Biases receive every metric row; a few sampled
prompts and responses per step go to ``samples.jsonl`` and to the trackers.

Both trackers are optional extras, imported when a run asks for them. A resumed run continues
the same TensorBoard folder (events after the checkpoint's step are purged) and the same
wandb run (its id is kept in ``<run dir>/tracking.json``).
"""

from __future__ import annotations

import logging
import contextlib
import json
import math
import os
import sys
import uuid
from pathlib import Path

log = logging.getLogger(__name__)


class MissingExtra(ImportError):
    """A tracker was asked for but its package is not installed."""


def _need(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(
            f"run.trackers includes {extra!r} but {module!r} is not installed: "
            f"pip install -e '.[{extra}]' from a checkout, or 'strop[{extra}]' (or remove it from run.trackers)"
        ) from exc


class TensorBoard:
    def __init__(self, run_dir: Path, resume_step: int | None):
        tb = _need("torch.utils.tensorboard", "tensorboard")
        # purge_step: a resumed run rewrites the steps after its checkpoint; older events of them are hidden
        self.writer = tb.SummaryWriter(
            str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1 if resume_step is not None else None
        )

    def log(self, row: dict, step: int) -> None:
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, step)

    def samples(self, rows: list[dict], step: int) -> None:
        lines = ["| prompt | response | reward |", "|---|---|---|"]
        for r in rows:
            cell = lambda s: str(s).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
            lines.append(f"| {cell(r['prompt'])} | {cell(r['response'])} | {r['reward']} |")
        self.writer.add_text("samples", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandB:
    def __init__(self, run_dir: Path, config: dict, project: str, mode: str, resume_step: int | None):
        wandb = _need("wandb", "wandb")
        self.wandb = wandb
        ids = Path(run_dir) / "tracking.json"
        known = json.loads(ids.read_text()) if ids.exists() else {}
        run_id = known.get("wandb_id") or uuid.uuid4().hex[:12]
        if "wandb_id" not in known:
            ids.write_text(json.dumps(known | {"wandb_id": run_id}))
        with redacted_argv():  # wandb records the command line
            self.run = wandb.init(
                project=project,
                dir=str(run_dir),
                id=run_id,
                name=Path(run_dir).name,
                mode=mode,
                config=config,
                resume="allow" if resume_step is not None else None,
            )
        if resume_step is not None:  # wandb keeps one value per step and only moves forward
            log.info(
                "strop: wandb: a resumed run continues the same wandb run; the steps it runs again after its "
                "checkpoint keep their first values there (metrics.jsonl and TensorBoard have the new ones)"
            )

    def log(self, row: dict, step: int) -> None:
        clean = {
            k: v
            for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
        }
        self.run.log(clean, step=step)

    def samples(self, rows: list[dict], step: int) -> None:
        table = self.wandb.Table(
            columns=["step", "prompt", "response", "reward", "status"],
            data=[[step, r["prompt"], r["response"], r["reward"], r["status"]] for r in rows],
        )
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # stop the wandb-core service this process started


@contextlib.contextmanager
def redacted_argv():
    """``sys.argv`` with the value of every secret option (``--engine.token=...``) masked, while a
    tracker reads it."""
    from strop.config import secret_fields
    from strop.configbase import REDACTED

    options = {f"--{name}" for name in secret_fields()}
    argv, masked = sys.argv, []
    for i, arg in enumerate(sys.argv):
        name = arg.split("=", 1)[0]
        if name in options and "=" in arg:
            arg = f"{name}={REDACTED}"
        elif i and argv[i - 1] in options:  # --engine.token VALUE
            arg = REDACTED
        masked.append(arg)
    sys.argv = masked
    try:
        yield
    finally:
        sys.argv = argv


EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # tracker -> the module it needs


def require_trackers(names: list[str]) -> None:
    """Fail before anything loads when a tracker's package is missing."""
    for name in names:
        _need(EXTRAS[name], name)


def open_trackers(
    names: list[str],
    run_dir: Path,
    config: dict,
    *,
    project: str = "strop",
    mode: str = "offline",
    resume_step: int | None = None,
) -> list:
    """The trackers ``names`` asks for; a missing package fails here, before any step runs."""
    out = []
    try:
        for name in names:
            if name == "tensorboard":
                out.append(TensorBoard(run_dir, resume_step))
            elif name == "wandb":
                os.environ.setdefault("WANDB_SILENT", "true")
                out.append(WandB(run_dir, config, project, mode, resume_step))
    except BaseException:
        for t in out:
            t.close()
        raise
    return out


def sample_rows(groups, tokenizer, n: int, step: int) -> list[dict]:
    """The first sample of each of the first ``n`` groups, readable: prompt, response, reward."""
    rows = []
    for g in groups[:n]:
        s = g[0]
        prompt = s.prompt if isinstance(s.prompt, str) else tokenizer.decode(s.prompt_ids, skip_special_tokens=True)
        rows.append(
            {
                "step": step,
                "group_id": s.group_id,
                "prompt": prompt,
                "response": tokenizer.decode(s.response_ids, skip_special_tokens=True),
                "reward": s.reward,
                "status": s.status.value,
                "response_length": s.response_length,
            }
        )
    return rows
