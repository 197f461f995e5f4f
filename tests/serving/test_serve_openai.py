"""`strop serve` against real clients: the openai SDK (answers validated by its own response
models, stream=True, stop, n) and SGLang-style /generate payloads (text prompts, stop strings,
SGLang sampling fields), on a real uvicorn server on 127.0.0.1."""

import logging

import httpx
import pytest

from strop.engines.server import create_app
from tests.serving.test_serve_hostile import serving, tiny_engine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def url(tokenizer):
    with serving(create_app(tiny_engine(), tokenizer=tokenizer, model_name="tiny")) as base:
        yield base


@pytest.fixture
def client(url):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _raw(url, path, body):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_and_completion_answers_validate_against_the_sdks_models(url):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    chat = _raw(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}],
                                              "max_tokens": 5, "logprobs": True, "seed": 1})
    parsed = ChatCompletion.model_validate(chat)  # strict: every required field, every literal
    content = parsed.choices[0].logprobs.content
    assert len(content) == len(chat["choices"][0]["token_ids"]) == parsed.usage.completion_tokens
    assert "".join(t.token for t in content) == parsed.choices[0].message.content
    done = _raw(url, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "logprobs": 0})
    assert len(Completion.model_validate(done).choices[0].logprobs.token_logprobs) == 4


def test_stream_true_sends_server_sent_events_the_sdk_reads(client):
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    whole = client.completions.create(model="tiny", prompt="Once upon", max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks, "the stream was empty"
    for c in chunks:
        Completion.model_validate(c.model_dump())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    messages = [{"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, logprobs=True))
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump())
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole.choices[0].finish_reason


def test_n_gives_n_choices_and_a_seed_repeats_them(client):
    messages = [{"role": "user", "content": "Pick a word"}]
    a = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, n=3, seed=5)
    b = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, n=3, seed=5)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # three samples, not one three times
    done = client.completions.create(model="tiny", prompt=["one", "two"], max_tokens=3, n=2)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]


def test_a_stop_string_cuts_the_answer_where_it_first_appears(client, tokenizer):
    whole = client.completions.create(model="tiny", prompt="The", max_tokens=24, seed=3)
    ids = whole.choices[0].model_extra["token_ids"]
    text = whole.choices[0].text
    stop = _later_word(tokenizer, ids, text)
    cut = client.completions.create(model="tiny", prompt="The", max_tokens=24, seed=3, stop=[stop, "never!"])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kept = cut.choices[0].model_extra["token_ids"]
    assert kept == ids[: len(kept)] and stop in tokenizer.decode(kept) and stop not in tokenizer.decode(kept[:-1])


def _later_word(tokenizer, ids, text) -> str:
    """The text of a token that first appears after the answer's 4th character (a stop string that cuts)."""
    words = [tokenizer.decode([t]).strip() for t in ids[4:]]
    return next(w for w in words if w and text.index(w) > 4)


def test_unsupported_openai_options_are_refused_with_a_message(client):
    import openai

    for kw in ({"frequency_penalty": 0.5}, {"logit_bias": {"5": 10}}, {"top_logprobs": 3, "logprobs": True},
               {"response_format": {"type": "json_object"}}):
        with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)) as err:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           **kw)
        assert next(iter(kw)) in str(err.value)


# ---- item 21: SGLang-style /generate ---------------------------------------------------------------

def test_generate_takes_sglang_text_prompts_and_stop_strings(url, tokenizer):
    sp = {"temperature": 1, "max_new_tokens": 16, "stop_token_ids": [-1], "sampling_seed": 4}
    by_text = _raw(url, "/generate", {"text": "Hello there", "sampling_params": sp})
    by_ids = _raw(url, "/generate", {"input_ids": tokenizer("Hello there")["input_ids"], "sampling_params": sp})
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["text"] == by_ids["text"]
    text = by_text["text"]
    stop = _later_word(tokenizer, by_text["output_ids"], text)
    cut = _raw(url, "/generate", {"text": "Hello there", "sampling_params": {**sp, "stop": stop}})
    assert cut["text"] == text[: text.index(stop)] and cut["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                            "matched": stop}
    kept = _raw(url, "/generate", {"text": "Hello there",
                                   "sampling_params": {**sp, "stop": [stop], "no_stop_trim": True}})
    assert kept["text"].endswith(stop) and kept["output_ids"] == cut["output_ids"]
    batch = _raw(url, "/generate", {"text": ["Hello there", "Bye"], "sampling_params": sp})
    assert isinstance(batch, list) and batch[0]["output_ids"] == by_text["output_ids"]


def test_generate_accepts_sglang_sampling_fields_and_ignores_unknown_ones(url, caplog):
    sglang = {"temperature": 0.0, "max_new_tokens": 4, "min_new_tokens": 0, "min_p": 0.0, "frequency_penalty": 0.0,
              "presence_penalty": 0.0, "repetition_penalty": 1.0, "ignore_eos": True, "spaces_between_special_tokens":
              True, "no_stop_trim": False, "skip_special_tokens": True, "json_schema": None, "regex": None, "n": 1}
    with caplog.at_level(logging.WARNING, logger="strop.serve"):
        out = _raw(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {**sglang, "stream_interval": 3,
                                                                                  "custom_params": None}})
    assert len(out["output_ids"]) == 4 and out["meta_info"]["finish_reason"]["type"] == "length"  # ignore_eos
    assert "stream_interval" in caplog.text and "custom_params" in caplog.text
    r = httpx.post(url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"repetition_penalty": 1.3}})
    assert r.status_code == 422 and "repetition_penalty" in r.text  # would change the distribution: refused
    r = httpx.post(url + "/generate", json={"text": "a", "input_ids": [5, 6]})
    assert r.status_code == 400 and "exactly one" in r.text
