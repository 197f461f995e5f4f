"""On-policy distillation from a teacher behind `strop serve`: the same logprobs, and the same update, as the
teacher loaded into the trainer."""

import copy

import pytest
import torch

from strop.engines.teacher import RemoteTeacher

TEACHER_TOKEN = "teacher-s3cret-5c1e"


@pytest.mark.timeout(300)
def test_a_served_teacher_scores_as_the_one_in_the_trainer(start_server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from tests.test_offpolicy import _distill_step, _teacher_logprobs
    from tests.test_trainer import make_samples, near_policy

    server = start_server()
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir).float()
    samples = near_policy(teacher, make_samples())
    remote = RemoteTeacher(server.url, "strop")(samples)
    local = _teacher_logprobs(teacher, samples, 1.0)
    assert [len(r) for r in remote] == [s.response_length for s in samples]
    for i, r in enumerate(remote):
        assert (torch.tensor(r) - local[i, : len(r)]).abs().max().item() <= 1e-5, i
    # through the trainer (both at temperature 1, what a server scores at): the same update
    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir).float()
    with torch.no_grad():  # a student a little away from the teacher, so the reverse KL is not ~0
        for p in student.parameters():
            p.add_(0.01 * torch.randn_like(p))
    args = dict(distill_only=True, distill_coef=1.0)
    here = _distill_step(
        copy.deepcopy(student), copy.deepcopy(teacher), samples, distill_teacher="t", temperature=1.0, **args
    )
    served = _distill_step(
        copy.deepcopy(student),
        None,
        samples,
        distill_teacher_url=server.url,
        temperature=1.0,
        remote_teacher=RemoteTeacher(server.url),
        **args,
    )
    # (abs 1e-4: the server and the trainer batch the sequences differently; their fp32 sums differed by 1.9e-5
    # on an AMD EPYC with AVX2)
    assert served[1]["distill_reverse_kl"] == pytest.approx(here[1]["distill_reverse_kl"], abs=1e-4)
    # (advantages equal to 1e-5 per token, as the logprobs: the update agrees to that, not to the rounding of one path)
    for key in ("loss", "grad_norm"):
        assert served[1][key] == pytest.approx(here[1][key], rel=1e-3), key
    plain = _distill_step(copy.deepcopy(student), None, samples, temperature=1.0)  # no teacher: another update
    assert plain[1]["grad_norm"] != pytest.approx(here[1]["grad_norm"], rel=1e-2)


def test_a_served_teacher_is_refused_where_it_cannot_score_as_asked():
    from strop.config import ConfigError, build_config

    url = "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match="set algo.distill_temperature=1.0 to accept the mismatch"):
        build_config(overrides={"algo": {"distill_teacher_url": url}, "rollout": {"temperature": 0.7}})
    build_config(
        overrides={"algo": {"distill_teacher_url": url, "distill_temperature": 1.0}, "rollout": {"temperature": 0.7}}
    )
    with pytest.raises(ConfigError, match="cannot be honoured"):
        build_config(overrides={"algo": {"distill_teacher_url": url, "distill_temperature": 0.7}})
    with pytest.raises(ConfigError, match="name two teachers"):
        build_config(overrides={"algo": {"distill_teacher_url": url, "distill_teacher": "x"}})


@pytest.mark.timeout(300)
def test_a_run_distils_from_a_served_teacher(start_server, tiny_model_dir, tmp_path, monkeypatch):
    """The teacher is started with a token, given to the run as the environment variable STROP_TEACHER_TOKEN:
    every teacher request carries it, and the run's saved config does not."""
    import json

    from strop.config import build_config
    from strop.loop import train
    from tests.test_e2e import tiny_overrides

    server = start_server(None, f"--token={TEACHER_TOKEN}")
    monkeypatch.setenv("STROP_TEACHER_TOKEN", TEACHER_TOKEN)
    run_dir = tmp_path / "run"
    cfg = tiny_overrides(
        tiny_model_dir,
        run_dir,
        rollout={"temperature": 1.0},
        algo={"distill_teacher_url": server.url, "distill_only": True},
    )
    assert train(build_config(overrides=cfg))["steps"] == 2
    assert TEACHER_TOKEN not in (run_dir / "config.yaml").read_text()
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    # the served teacher holds the student's starting weights: step 1's reverse KL is the engines' gap, ~0
    assert len(rows) == 2 and abs(rows[0]["distill_reverse_kl"]) < 1e-4 and rows[1]["grad_norm"] > 0


@pytest.mark.timeout(300)
def test_a_served_teacher_started_with_a_token_gets_it(start_server, tokenizer):
    from strop.config import ConfigError
    from strop.wire.errors import EngineRequestError
    from tests.test_trainer import make_samples

    server = start_server(None, f"--token={TEACHER_TOKEN}")
    samples = make_samples(n=2)
    with pytest.raises(
        ConfigError,
        match=rf"algo.distill_teacher_url={server.url}: .*HTTP 401.*give its token as "
        r"algo.distill_teacher_token .*STROP_TEACHER_TOKEN",
    ):
        RemoteTeacher(server.url).check_tokenizer(tokenizer)
    with pytest.raises(EngineRequestError, match="HTTP 401"):
        RemoteTeacher(server.url)(samples)
    teacher = RemoteTeacher(server.url, token=TEACHER_TOKEN)
    teacher.check_tokenizer(tokenizer)
    assert [len(lp) for lp in teacher(samples)] == [s.response_length for s in samples]
    assert TEACHER_TOKEN not in repr(teacher)


def _model_with_another_vocabulary(path):
    """A tiny model whose tokenizer is a byte-level BPE trained here: the student's special tokens at the same
    ids (0, 1, 2), every other id another piece of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny import make_tiny_model

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(
        ["The quick brown fox jumps over the lazy dog. 0123456789"] * 20,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.save_pretrained(path)
    make_tiny_model(vocab_size=len(tokenizer)).save_pretrained(path)
    return tokenizer


@pytest.mark.timeout(300)
def test_a_served_teacher_with_another_tokenizer_is_refused_at_start(start_server, tiny_model_dir, tokenizer, tmp_path):
    """As a loaded teacher (strop.setup.load_teacher): the same tokenizer is accepted; another vocabulary, or a
    teacher lacking a token the student has, is refused before the run starts, naming the teacher's URL and
    the first token id that differs."""
    import torch

    from strop.process import free_port
    from strop.config import ConfigError, build_config
    from strop.engines.launch import LocalServer
    from strop.engines.teacher import probe_text
    from strop.setup import make_trainer
    from tests.tiny import make_tiny_model

    same = start_server()
    RemoteTeacher(same.url).check_tokenizer(tokenizer)  # the student's own tokenizer: accepted

    extended = tokenizer.__class__.from_pretrained(str(tiny_model_dir))  # the student has a token the teacher lacks
    extended.add_tokens(["<strop-student-only>"])
    with pytest.raises(
        ConfigError,
        match=rf"algo.distill_teacher_url={same.url} has another tokenizer than the "
        r"student: .*the student's 49152 \('<strop-student-only>'\)",
    ):
        RemoteTeacher(same.url).check_tokenizer(extended)

    other_tokenizer = _model_with_another_vocabulary(tmp_path / "other")
    other = LocalServer(str(tmp_path / "other"), free_port(), ["--threads=1"]).start()
    try:
        other.wait_healthy(120)
        text = probe_text(tokenizer)
        theirs, mine = other_tokenizer.encode(text), tokenizer.encode(text, add_special_tokens=False)
        assert theirs[0] != mine[0]  # "The": one id in the student's vocabulary, another in the teacher's
        cfg = build_config(
            overrides={
                "model": {"path": str(tiny_model_dir)},
                "rollout": {"temperature": 1.0},
                "algo": {"distill_teacher_url": other.url, "distill_only": True},
            }
        )
        with pytest.raises(
            ConfigError,
            match=rf"algo.distill_teacher_url={other.url} has another tokenizer than "
            rf"the student model.path='{tiny_model_dir}': a probe text is "
            rf"{len(theirs)} tokens for the teacher and {len(mine)} for the "
            rf"student; they first differ at token 0: the teacher's id "
            rf"{theirs[0]}, the student's {mine[0]} \('The'\)",
        ):
            make_trainer(cfg, make_tiny_model(), tokenizer, {}, torch.device("cpu"))
    finally:
        other.stop()
