"""The ``strop`` command line: its flags, help, usage errors and the run's log (no model loads but in the last)."""

import logging
import os
from importlib.metadata import version

import pytest
from pydantic import BaseModel

from strop.cli import main
from strop.config import Config
from strop.observe.logs import RUN_LOG, attach_run_log, close_run_log, setup_logging

SECTIONS = list(Config.model_fields)


def _exit(argv, capsys):
    """(exit code, stdout, stderr) of ``strop ARGV``, whether it returns or exits."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version(capsys):
    code, out, _ = _exit(["--version"], capsys)
    assert code == 0 and out.strip() == f"strop {version('strop')}"


def test_train_help_fits_a_screen_and_points_to_help_all(capsys):
    code, out, _ = _exit(["train", "--help"], capsys)
    assert code == 0 and len(out.splitlines()) <= 80, len(out.splitlines())
    for flag in ("--nproc", "--preset", "--resume", "--allow-change", "--log-level", "CONFIG.yaml", "dapo"):
        assert flag in out, flag
    assert "strop train --help-all" in out
    for section in SECTIONS:  # one line each, with its description
        desc = Config.model_fields[section].description
        assert any(line.split() and line.split()[0] == section and desc in line for line in out.splitlines()), section
    assert "--train.lr" not in out  # the options are --help-all's


def _fields(model, prefix=""):
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _fields(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def test_help_all_lists_every_option_with_its_real_default(capsys):
    code, out, _ = _exit(["train", "--help-all"], capsys)
    assert code == 0
    fields = dict(_fields(Config))
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  --")]
    assert sorted(listed) == sorted(f"--{name}" for name in fields)  # each once, nothing else
    assert "default factory" not in out and "<lambda>" not in out
    assert '(default: {"min_terms": 2' in out  # data.task_options: the factory's value, not its name
    assert "(default: [])" in out  # data.metadata_keys, a list factory


def test_rollout_help_lists_its_own_flags(capsys):
    code, out, _ = _exit(["rollout", "--help"], capsys)
    assert code == 0 and len(out.splitlines()) <= 80
    assert "--out FILE" in out and "--preset NAME" in out and "CONFIG.yaml" in out and "--nproc N " not in out
    assert all(f"  {section} " in out for section in SECTIONS)


@pytest.mark.parametrize("argv", [["--preset"], ["--preset", "--train.steps=3"]])
def test_preset_without_a_name_names_the_flag_and_the_presets(argv, capsys):
    code, _, err = _exit(["train", *argv], capsys)
    assert code == 2 and "--preset needs a NAME" in err and "dapo" in err and "grpo" in err
    assert "unrecognized" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("option", ["--trian.steps=3", "--train.step=3", "--train.step"])
def test_a_misspelled_option_gets_the_closest_one(option, capsys):
    code, _, err = _exit(["train", option, "3"] if "=" not in option else ["train", option], capsys)
    assert code == 2 and "did you mean --train.steps?" in err and "usage:" not in err


def test_a_misspelled_preset_gets_the_closest_one_and_the_list(capsys):
    code, _, err = _exit(["train", "--preset", "dapp"], capsys)
    assert code == 2 and "did you mean dapo?" in err and "gspo" in err and "rloo" in err
    code, _, err = _exit(["rollout", "--preset=gsp"], capsys)
    assert code == 2 and "did you mean gspo?" in err


def test_an_unknown_command_gets_the_closest_one(capsys):
    code, _, err = _exit(["trian"], capsys)
    assert code == 2 and "did you mean train?" in err


def test_the_config_file_goes_anywhere_on_the_line(tmp_path, monkeypatch, capsys):
    import strop.cluster.launcher as launcher

    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 3\n  lr: 0.002\nrollout:\n  temperature: 0.5\n")
    seen = []
    monkeypatch.setattr(launcher, "start", lambda cfg, *a, **k: seen.append(cfg) or 0)  # no rank starts
    opts = ["--rollout.top_k", "5", "--preset=dapo", "--train.steps=7"]
    for argv in ([str(f), *opts], [*opts, str(f)], [*opts[:2], str(f), *opts[2:]]):
        assert main(["train", *argv]) == 0, capsys.readouterr().err
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
    cfg = seen[0]
    assert (cfg.train.steps, cfg.train.lr, cfg.rollout.temperature, cfg.rollout.top_k) == (7, 0.002, 0.5, 5)
    assert cfg.algo.clip_high == 0.28  # the preset


def test_a_second_positional_is_refused_saying_where_the_file_goes(tmp_path, capsys):
    code, _, err = _exit(["train", "a.yaml", "b.yaml"], capsys)
    assert code == 2 and "a second config file 'b.yaml'" in err and "one CONFIG.yaml" in err
    code, _, err = _exit(["train", "--train.steps=3", "runs/x"], capsys)
    assert code == 2 and "unexpected argument 'runs/x'" in err and "CONFIG.yaml (.yaml or .yml)" in err
    code, _, err = _exit(["rollout", "c.yml", "extra"], capsys)
    assert code == 2 and "unexpected argument 'extra'" in err


def test_nproc_above_the_cores_warns_naming_both(capsys):
    from strop.cli.train import nproc_warning

    cpus = os.cpu_count()
    assert nproc_warning(cpus, "cpu") is None
    assert f"--nproc {cpus + 1} is more than the {cpus} CPU cores" in nproc_warning(cpus + 1, "cpu")
    # through the command line, up to the warning: ray refuses --nproc before any rank starts
    code, _, err = _exit(["train", f"--nproc={cpus + 7}", "--cluster.launcher=ray"], capsys)
    assert code == 2 and f"--nproc {cpus + 7} is more than the {cpus} CPU cores" in err
    assert "with cluster.launcher=ray set cluster.trainer_ranks" in err


def test_bad_flag_values_are_one_line_errors(capsys):
    for argv, text in (
        (["train", "--nproc=0"], "argument --nproc: must be a positive integer, got '0'"),
        (["train", "--log-level=LOUD"], "argument --log-level: invalid choice: 'LOUD'"),
        (["serve", "--port", "x"], "strop serve: error: argument --port: invalid int value: 'x'"),
    ):
        code, _, err = _exit(argv, capsys)
        assert code == 2 and text in err and len(err.strip().splitlines()) == 1, err


def test_run_log_holds_what_the_terminal_shows(tmp_path, capsys):
    setup_logging("INFO")
    log = logging.getLogger("strop.test_cli")
    close_run_log()  # what an earlier run left
    log.info("strop: checked before the run directory exists")
    try:
        attach_run_log(tmp_path)
        log.info("strop: hello")
        log.warning("strop: careful")
        log.debug("strop: hidden at INFO")
    finally:
        close_run_log()
    log.info("strop: after the run")
    text = (tmp_path / RUN_LOG).read_text()
    assert text.splitlines()[0].endswith("INFO strop: checked before the run directory exists")
    assert "INFO strop: hello" in text and "WARNING strop: careful" in text
    assert "hidden" not in text and "after the run" not in text
    out = capsys.readouterr()
    assert "strop: hello" in out.out and "strop: careful" in out.err and "hidden" not in out.out + out.err
    setup_logging("DEBUG")
    log.debug("strop: shown at DEBUG")
    setup_logging("INFO")
    assert "strop: shown at DEBUG" in capsys.readouterr().out


def test_strop_train_writes_run_log(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    close_run_log()  # lines earlier tests left for the next run's log
    code = main(
        [
            "train",
            f"--model.path={tiny_model_dir}",
            "--data.size=16",
            "--data.eval_size=4",
            "--rollout.prompts_per_step=2",
            "--rollout.n_samples_per_prompt=2",
            "--rollout.max_new_tokens=4",
            "--rollout.reward=tests.plugins:even_token_reward",
            "--train.steps=2",
            "--train.warmup_steps=0",
            "--eval.every=0",
            "--run.save_final=false",
            "--run.plot=false",
            f"--run.dir={run_dir}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    text = (run_dir / RUN_LOG).read_text()
    shown = out.splitlines()  # each line the terminal showed, those from before the run directory existed too
    assert shown and shown == [line for line in text.splitlines() if " INFO " in line]
    for line in (
        "strop: run directory",
        "strop: device",
        "strop: step 1/2, reward",
        "strop: step 2/2",
        "2 steps in",
    ):
        assert line in text and line in out, line  # not a terminal: the step lines, not a bar
