"""On-policy distillation from a teacher behind `strop serve`: the same logprobs, and the same update, as the
teacher loaded into the trainer."""

import copy

import pytest
import torch

from strop.engines.teacher import RemoteTeacher


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
    here = _distill_step(copy.deepcopy(student), copy.deepcopy(teacher), samples, distill_teacher="t", temperature=1.0,
                         **args)
    served = _distill_step(copy.deepcopy(student), None, samples, distill_teacher_url=server.url, temperature=1.0,
                           remote_teacher=RemoteTeacher(server.url), **args)
    assert served[1]["distill_reverse_kl"] == pytest.approx(here[1]["distill_reverse_kl"], abs=1e-5)
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
    build_config(overrides={"algo": {"distill_teacher_url": url, "distill_temperature": 1.0},
                            "rollout": {"temperature": 0.7}})
    with pytest.raises(ConfigError, match="cannot be honoured"):
        build_config(overrides={"algo": {"distill_teacher_url": url, "distill_temperature": 0.7}})
    with pytest.raises(ConfigError, match="name two teachers"):
        build_config(overrides={"algo": {"distill_teacher_url": url, "distill_teacher": "x"}})


@pytest.mark.timeout(300)
def test_a_run_distils_from_a_served_teacher(start_server, tiny_model_dir, tmp_path):
    import json

    from strop.config import build_config
    from strop.loop import train
    from tests.test_e2e import tiny_overrides

    server = start_server()
    run_dir = tmp_path / "run"
    cfg = tiny_overrides(tiny_model_dir, run_dir, rollout={"temperature": 1.0},
                         algo={"distill_teacher_url": server.url, "distill_only": True})
    assert train(build_config(overrides=cfg))["steps"] == 2
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    # the served teacher holds the student's starting weights: step 1's reverse KL is the engines' gap, ~0
    assert len(rows) == 2 and abs(rows[0]["distill_reverse_kl"]) < 1e-4 and rows[1]["grad_norm"] > 0
