import json

import pytest

from strop.data.sources import DataError, PromptSampler, PromptSet, read_prompt_file, reasoning_gym_rows


def test_jsonl_text_and_chat_prompts_with_keys(tmp_path, tokenizer):
    f = tmp_path / "d.jsonl"
    rows = [
        {"question": "What is 2+2?", "answer": "4", "src": "a"},
        {
            "question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}],
            "answer": "6",
            "src": "b",
        },
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    data = read_prompt_file(str(f), prompt_key="question", label_key="answer", metadata_keys=["src"])
    assert [r.label for r in data] == ["4", "6"] and data[1].metadata == {"src": "b"}
    ps = PromptSet(data, tokenizer, template="Q: {prompt}", max_prompt_tokens=1000)
    text0 = tokenizer.decode(ps.prompt_ids[0])
    assert "Q: What is 2+2?" in text0 and text0.rstrip().endswith("assistant")  # chat template applied
    assert "Be brief." in tokenizer.decode(ps.prompt_ids[1])
    group = ps.make_group(1, 3, group_id=9)
    assert [s.index for s in group] == [0, 1, 2] and {s.group_id for s in group} == {9}


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a?", "b?"], "label": ["1", "2"]}), f)
    assert [r.prompt for r in read_prompt_file(str(f))] == ["a?", "b?"]
    pq.write_table(pa.table({"prompt": ["a?", ""], "label": ["1", "2"]}), f)
    with pytest.raises(DataError, match=r"d.parquet row 1: prompt is empty"):
        read_prompt_file(str(f))


@pytest.mark.parametrize(
    "line,message",
    [
        ('["not", "an", "object"]', "expected a JSON object"),
        ('{"prompt": 5}', "prompt must be a string"),
        ('{"prompt": [{"role": "user"}]}', "chat message 0 must be an object"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, line, message):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=f"d.jsonl:2: {message}"):
        read_prompt_file(str(f))


def test_reasoning_gym_eval_is_disjoint_and_seeded():
    opts = {"min_terms": 2, "max_terms": 3, "max_digits": 2}
    train = reasoning_gym_rows("chain_sum", 1, 200, opts)
    again = reasoning_gym_rows("chain_sum", 1, 200, opts)
    held = reasoning_gym_rows("chain_sum", 2, 200, opts)
    assert [r.prompt for r in train] == [r.prompt for r in again]
    assert [r.prompt for r in train] != [r.prompt for r in held]
    with pytest.raises(DataError, match="no_such_task"):
        reasoning_gym_rows("no_such_task", 1, 5, {})


def test_sampler_covers_each_epoch_and_resumes():
    s = PromptSampler(5, seed=3)
    first = s.draw(5)
    assert sorted(i for i, _ in first) == list(range(5)) and [g for _, g in first] == list(range(5))
    state = s.state_dict()
    rest = s.draw(7)
    t = PromptSampler(5, seed=3)
    t.load_state_dict(state)
    assert t.draw(7) == rest


def test_sampler_reshuffles_every_epoch():
    s = PromptSampler(50, seed=3)
    epochs = [[i for i, _ in s.draw(50)] for _ in range(3)]
    assert all(sorted(e) == list(range(50)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # a new order each epoch, not the first one again
    assert PromptSampler(50, seed=3, shuffle=False).draw(50) == [(i, i) for i in range(50)]


def test_non_utf8_line_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"prompt": "ok", "label": "1"}\n{"prompt": "caf\xe9", "label": "2"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        read_prompt_file(str(f))


def test_directory_as_data_path_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="is a directory; expected a .jsonl or .parquet file"):
        read_prompt_file(str(tmp_path))


def test_held_out_removes_training_prompts_and_counts_them():
    from strop.data.sources import held_out

    opts = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # the default task: a small space
    train = reasoning_gym_rows("basic_arithmetic", 1, 2000, opts)
    candidates = reasoning_gym_rows("basic_arithmetic", 1_000_003, 512, opts)
    train_prompts = {r.prompt for r in train}
    overlap = sum(r.prompt in train_prompts for r in candidates[:128])
    assert overlap > 50  # why this matters: a different seed alone is not held out
    kept, removed = held_out(candidates, train, template="{prompt}", system_prompt=None, size=128)
    assert len(kept) == 128 and removed >= overlap
    assert not any(r.prompt in train_prompts for r in kept)
    assert len({r.prompt for r in kept}) == 128  # no question twice


def test_default_eval_set_is_disjoint_from_training(tiny_model_dir):
    """The set-up path itself: no eval prompt (after templating) occurs in the training prompts."""
    import torch

    from strop.config import build_config
    from strop.setup import prepare

    cfg = build_config(overrides={"model": {"path": str(tiny_model_dir)}})
    p = prepare(cfg, torch.device("cpu"))
    train_rows, eval_rows = p.train_rows, p.eval_rows
    assert len(eval_rows) == cfg.data.eval_size
    assert not {r.prompt for r in eval_rows} & {r.prompt for r in train_rows}


def test_too_few_held_out_prompts_left_is_refused(tmp_path, tiny_model_dir):
    import json

    import torch

    from strop.config import build_config
    from strop.setup import prepare

    rows = [json.dumps({"prompt": f"{i} + 1?", "label": str(i + 1)}) for i in range(40)]
    (tmp_path / "train.jsonl").write_text("\n".join(rows))
    (tmp_path / "eval.jsonl").write_text("\n".join(rows[:35] + [json.dumps({"prompt": "new?", "label": "1"})]))
    cfg = build_config(
        overrides={
            "model": {"path": str(tiny_model_dir)},
            "data": {
                "source": "file",
                "path": str(tmp_path / "train.jsonl"),
                "eval_path": str(tmp_path / "eval.jsonl"),
            },
        }
    )
    with pytest.raises(DataError, match=r"only 1 held-out prompts remain after removing 35"):
        prepare(cfg, torch.device("cpu"))


def test_missing_label_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import torch

    import strop.setup
    from strop.config import build_config

    def no_model(path):
        raise AssertionError("the model was resolved (and, cold, converted) before the data was checked")

    monkeypatch.setattr(strop.setup, "resolve_model_path", no_model)
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n{"prompt": "2+2?"}\n')
    cfg = build_config(overrides={"data": {"source": "file", "path": str(tmp_path / "d.jsonl")}})
    with pytest.raises(DataError, match=r"d.jsonl:2: no label \(key 'label'\), and rollout.reward='math'"):
        strop.setup.prepare(cfg, torch.device("cpu"))
    (tmp_path / "d.jsonl").write_bytes(b'{"prompt": "\xff"}\n')  # any data error comes first
    with pytest.raises(DataError, match="not UTF-8"):
        strop.setup.prepare(cfg, torch.device("cpu"))


def test_a_prompt_file_given_alone_means_source_file_and_an_explicit_other_source_is_refused():
    from strop.config import ConfigError, build_config

    assert build_config().data.source == "reasoning_gym"
    cfg = build_config(overrides={"data": {"path": "train.jsonl"}})  # before: source stayed reasoning_gym
    assert cfg.data.source == "file"
    assert build_config(overrides={"data": {"path": "t.jsonl", "eval_path": "e.jsonl"}}).data.source == "file"
    later = build_config()
    later.data.path = "t.jsonl"  # (assigned: the same)
    assert later.data.source == "file"
    with pytest.raises(ConfigError, match=r"data.path='t.jsonl' with data.source='reasoning_gym'.*data.source=file"):
        build_config(overrides={"data": {"source": "reasoning_gym", "path": "t.jsonl"}})
    with pytest.raises(ConfigError, match=r"data.eval_path='e.jsonl' with data.source='reasoning_gym'"):
        build_config(overrides={"data": {"source": "reasoning_gym", "eval_path": "e.jsonl"}})
    with pytest.raises(ConfigError, match=r"needs data.path.*data.eval_path='e.jsonl'"):
        build_config(overrides={"data": {"eval_path": "e.jsonl"}})


def test_a_builtin_reward_is_tried_on_the_first_rows_before_the_model_loads(tmp_path):
    import time

    from strop.config import build_config
    from strop.data.rows import prompt_rows
    from strop.rollout.reward_check import check_reward
    from strop.rollout.generate import resolve_reward

    quick = build_config(overrides={"data": {"size": 16, "eval_size": 8, "eval_min_size": 1}})
    train, held = prompt_rows(quick)
    for reward in ("math", "exact_match", "reasoning_gym"):  # the quickstart's data: every built-in scores it
        quick.rollout.reward = reward
        resolve_reward(reward)(**{"sample": _sample(train[0])})  # (imports done: what is timed is the check)
        t0 = time.perf_counter()
        check_reward(quick, resolve_reward(reward), train, held)
        assert time.perf_counter() - t0 < 0.5
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    on_file = build_config(overrides={"data": {"path": str(tmp_path / "d.jsonl")}, "rollout": {"reward": "math"}})
    rows, _ = prompt_rows(on_file)
    check_reward(on_file, resolve_reward("math"), rows)
    on_file.rollout.reward = "reasoning_gym"
    with pytest.raises(
        DataError, match=r"rollout.reward='reasoning_gym' cannot score .*d.jsonl:1 .*reasoning_gym_entry"
    ):
        check_reward(on_file, resolve_reward("reasoning_gym"), rows)
    # (a user's reward is tried the same way, as the run calls it: tests/test_reward_adapters.py)


def _sample(row):
    from strop.types import Sample

    s = Sample(prompt=row.prompt, prompt_ids=[0], label=row.label, metadata=dict(row.metadata))
    s.response_text = str(row.label)
    return s
