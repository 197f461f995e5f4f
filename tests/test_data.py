import json

import pytest

from strop.data.sources import DataError, PromptSampler, PromptSet, read_prompt_file, reasoning_gym_rows


def test_jsonl_text_and_chat_prompts_with_keys(tmp_path, tokenizer):
    f = tmp_path / "d.jsonl"
    rows = [
        {"question": "What is 2+2?", "answer": "4", "src": "a"},
        {"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}], "answer": "6", "src": "b"},
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


@pytest.mark.parametrize("line,message", [
    ('["not", "an", "object"]', "expected a JSON object"),
    ('{"prompt": 5}', "prompt must be a string"),
    ('{"prompt": [{"role": "user"}]}', "chat message 0 must be an object"),
])
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
