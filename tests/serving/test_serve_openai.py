"""`strop serve` against real clients: the openai SDK (answers validated by its own response
models, stream=True, stop, n, top logprobs, echo) and SGLang-style /generate payloads (text
prompts, stop strings, SGLang sampling fields), on a real uvicorn server on 127.0.0.1."""

import logging

import httpx
import pytest
import torch

from strop.serving.server import create_app
from tests.held import HeldStep
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

    chat = _raw(
        url,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "2+2?"}],
            "max_tokens": 5,
            "logprobs": True,
            "seed": 1,
        },
    )
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
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Once upon",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks, "the stream was empty"
    for c in chunks:  # (OpenAI's own chunks leave finish_reason null until the last, which the model refuses)
        if c.choices and c.choices[0].finish_reason is not None:
            Completion.model_validate(c.model_dump())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    messages = [{"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True, logprobs=True
        )
    )
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

    for kw in (
        {"frequency_penalty": 0.5},
        {"logit_bias": {"5": 10}},
        {"top_logprobs": 21, "logprobs": True},
        {"top_logprobs": 2},
        {"response_format": {"type": "json_object"}},
    ):
        with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)) as err:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, **kw
            )
        assert next(iter(kw)) in str(err.value)


# ---- top logprobs, echo and streaming, against a direct forward of the same model ----------------------------


@pytest.fixture(params=[True, False], ids=["kv-decoder", "fallback"])
def served(request, tokenizer):
    """(base url, engine, model): the model behind the server, to score by hand. The fallback path
    (Hugging Face forward, static batches) must give the same answers as the fast decoder."""
    from tests.tiny import make_tiny_model

    model = make_tiny_model()
    engine = tiny_engine(model, fast_decode=request.param)
    with serving(create_app(engine, tokenizer=tokenizer, model_name="tiny")) as base:
        yield base, engine, model


def _sdk(url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _log_softmax(model, ids, temperature):
    """Row i: log_softmax(logits / temperature) of the token after ids[: i + 1], by a plain forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def _tolerance(generated: bool) -> float:
    """An echoed prompt is scored by a plain forward, as here (1e-5); a generated token's logits come
    from a decode step with a KV cache, whose kernels differ from a whole forward by up to ~2e-5 in
    float32 (tests/test_kvdecode.py allows 1e-4)."""
    return 1e-4 if generated else 1e-5


def test_completions_give_the_top_logprobs_and_echo_the_prompt_as_a_forward_pass_scores_them(served, tokenizer):
    """What lm-eval-harness sends: echo with logprobs (the prompt scored, its first token null), and
    max_tokens 0 for a log-likelihood; each position's top-k are the forward's log_softmax at the
    sampling temperature (1 when greedy), plus the sampled token."""
    import openai

    url, _, model = served
    prompt = "The cat sat on the"
    with _sdk(url) as client:
        for temperature, k, max_tokens in ((0.7, 5, 4), (0.0, 1, 0), (1.3, 20, 3)):
            done = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=max_tokens,
                echo=True,
                logprobs=k,
                temperature=temperature,
                seed=3,
            )
            choice = done.choices[0]
            prompt_ids, generated = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
            ids = prompt_ids + generated
            assert len(generated) == max_tokens and done.usage.completion_tokens == max_tokens
            assert choice.text == prompt + tokenizer.decode(generated, skip_special_tokens=True)
            lp = choice.logprobs
            texts = [tokenizer.decode([t]) for t in ids]
            assert lp.tokens == texts and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(ids))]
            scored = _log_softmax(model, ids, temperature or 1.0)
            for i in range(1, len(ids)):
                row, tol = scored[i - 1], _tolerance(i >= len(prompt_ids))
                assert abs(lp.token_logprobs[i] - row[ids[i]].item()) < tol, (temperature, i)
                values, top = row.topk(k)
                want = {
                    texts[i]: row[ids[i]].item(),
                    **{tokenizer.decode([t]): v for t, v in zip(top.tolist(), values.tolist())},
                }
                assert lp.top_logprobs[i].keys() == want.keys(), (temperature, i)
                assert all(abs(lp.top_logprobs[i][t] - v) < tol for t, v in want.items()), (temperature, i)
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2, logprobs=21)


def test_chat_gives_the_top_logprobs_a_forward_pass_gives(served, tokenizer):
    from openai.types.chat import ChatCompletion

    url, _, model = served
    tol = _tolerance(True)
    with _sdk(url) as client:
        for temperature, k in ((0.0, 3), (0.8, 20)):
            done = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "2+2?"}],
                max_tokens=5,
                temperature=temperature,
                seed=2,
                logprobs=True,
                top_logprobs=k,
            )
            ChatCompletion.model_validate(done.model_dump())
            choice = done.choices[0]
            prompt_ids, generated = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
            scored = _log_softmax(model, prompt_ids + generated, temperature or 1.0)
            content = choice.logprobs.content
            assert len(content) == len(generated) == 5
            for j, (entry, token) in enumerate(zip(content, generated)):
                row = scored[len(prompt_ids) - 1 + j]
                assert entry.token == tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
                assert abs(entry.logprob - row[token].item()) < tol
                values, top = row.topk(k)
                assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in top.tolist()]
                assert all(abs(t.logprob - v) < tol for t, v in zip(entry.top_logprobs, values.tolist()))
                assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
                if temperature == 0:  # greedy: the chosen token is the most likely one
                    assert entry.top_logprobs[0].token == entry.token


def _streamed(chunks, key="text", index=0):
    """(token ids, text, finish reasons) of one choice from a list of SDK chunks."""
    ids, text, reasons = [], "", []
    for c in chunks:
        for choice in c.choices:
            if choice.index == index:
                ids += (choice.model_extra or {}).get("token_ids") or []
                text += (getattr(choice, key) if key == "text" else choice.delta.content) or ""
                reasons.append(choice.finish_reason)
    return ids, text, reasons


def test_stream_sends_each_token_as_it_is_decoded_and_the_same_tokens_as_a_plain_call(served, tokenizer):
    """The first token arrives while the engine is held before the generation's end (a hook in the
    engine: no timing); streamed tokens, text, logprobs and finish equal the unstreamed answer's."""
    url, engine, _ = served
    # a decode step: the kv decoder's (admit and step), or the fallback's model forward
    owner, name = (engine, "_advance") if engine.decode_path.startswith("kv-cache") else (engine.model, "forward")
    # the 5th decode step waits until the client has read a token
    with HeldStep(owner, name) as held, _sdk(url) as client:
        kw = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "logprobs": 2}
        stream = iter(client.completions.create(stream=True, **kw))
        first = next(c for c in stream if c.choices and c.choices[0].model_extra.get("token_ids"))
        assert not held.timed_out.is_set(), "the first token came only once the generation had ended"
        held.release()
        chunks = [first, *stream]
        whole = client.completions.create(**kw).choices[0]
        ids, text, reasons = _streamed(chunks)
        assert ids == whole.model_extra["token_ids"] and len(ids) == 40 and text == whole.text
        per_token = [c.choices[0] for c in chunks if c.choices and c.choices[0].model_extra.get("token_ids")]
        assert all(len(c.model_extra["token_ids"]) == 1 for c in per_token)  # one chunk per token
        assert [c.logprobs.token_logprobs[0] for c in per_token] == whole.logprobs.token_logprobs
        assert [c.logprobs.top_logprobs[0] for c in per_token] == whole.logprobs.top_logprobs
        assert [c.logprobs.text_offset[0] for c in per_token] == whole.logprobs.text_offset
        assert reasons[-1] == whole.finish_reason and all(r is None for r in reasons[:-1])

        # sampled, n=2, cut by stop strings: each choice's stream equals its unstreamed answer
        plain = client.completions.create(model="tiny", prompt="The", max_tokens=24, seed=3)
        stop = _later_word(tokenizer, plain.choices[0].model_extra["token_ids"], plain.choices[0].text)
        kw = {"model": "tiny", "prompt": "The", "max_tokens": 24, "seed": 3, "n": 2, "stop": [stop, "never!"]}
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(stream=True, **kw))
        for i, want in enumerate(whole.choices):
            ids, text, reasons = _streamed(chunks, index=i)
            assert (ids, text, reasons[-1]) == (want.model_extra["token_ids"], want.text, want.finish_reason)
        assert whole.choices[0].finish_reason == "stop"

        messages = [{"role": "user", "content": "Say hi"}]
        kw = {"model": "tiny", "messages": messages, "max_tokens": 12, "seed": 4, "logprobs": True, "top_logprobs": 3}
        whole = client.chat.completions.create(**kw).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kw))
        ids, text, reasons = _streamed(chunks, key="delta")
        assert (ids, text, reasons[-1]) == (whole.model_extra["token_ids"], whole.message.content, whole.finish_reason)
        streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.logprobs.content]


# ---- item 21: SGLang-style /generate ---------------------------------------------------------------


def test_generate_takes_sglang_text_prompts_and_stop_strings(url, tokenizer):
    sp = {"temperature": 1, "max_new_tokens": 16, "stop_token_ids": [-1], "sampling_seed": 4}
    by_text = _raw(url, "/generate", {"text": "Hello there", "sampling_params": sp})
    by_ids = _raw(url, "/generate", {"input_ids": tokenizer("Hello there")["input_ids"], "sampling_params": sp})
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["text"] == by_ids["text"]
    text = by_text["text"]
    stop = _later_word(tokenizer, by_text["output_ids"], text)
    cut = _raw(url, "/generate", {"text": "Hello there", "sampling_params": {**sp, "stop": stop}})
    assert cut["text"] == text[: text.index(stop)] and cut["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": stop,
    }
    kept = _raw(
        url, "/generate", {"text": "Hello there", "sampling_params": {**sp, "stop": [stop], "no_stop_trim": True}}
    )
    assert kept["text"].endswith(stop) and kept["output_ids"] == cut["output_ids"]
    batch = _raw(url, "/generate", {"text": ["Hello there", "Bye"], "sampling_params": sp})
    assert isinstance(batch, list) and batch[0]["output_ids"] == by_text["output_ids"]


def test_generate_accepts_sglang_sampling_fields_and_ignores_unknown_ones(url, caplog):
    sglang = {
        "temperature": 0.0,
        "max_new_tokens": 4,
        "min_new_tokens": 0,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "ignore_eos": True,
        "spaces_between_special_tokens": True,
        "no_stop_trim": False,
        "skip_special_tokens": True,
        "json_schema": None,
        "regex": None,
        "n": 1,
    }
    with caplog.at_level(logging.WARNING, logger="strop.serve"):
        out = _raw(
            url,
            "/generate",
            {"input_ids": [5, 6, 7], "sampling_params": {**sglang, "stream_interval": 3, "custom_params": None}},
        )
    assert len(out["output_ids"]) == 4 and out["meta_info"]["finish_reason"]["type"] == "length"  # ignore_eos
    assert "stream_interval" in caplog.text and "custom_params" in caplog.text
    r = httpx.post(url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"repetition_penalty": 1.3}})
    assert r.status_code == 422 and "repetition_penalty" in r.text  # would change the distribution: refused
    r = httpx.post(url + "/generate", json={"text": "a", "input_ids": [5, 6]})
    assert r.status_code == 400 and "exactly one" in r.text


def test_a_streamed_answer_decodes_each_token_once(tokenizer):
    """strop serve's stream decodes each token's text from the few tokens since the last piece (a
    bounded number of token ids per token, plus one whole decode at the end), never the whole prefix
    again per token (n * n / 2 ids); the text still equals the unstreamed answer's."""
    from tests.agents.test_proxy import CountingTokenizer

    counting = CountingTokenizer(tokenizer)
    with serving(create_app(tiny_engine(), tokenizer=counting, model_name="tiny")) as base, _sdk(base) as client:
        kw = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
        whole = client.completions.create(**kw).choices[0]
        counting.decoded = 0
        ids, text, _ = _streamed(list(client.completions.create(stream=True, **kw)))
    n = len(ids)
    assert ids == whole.model_extra["token_ids"] and text == whole.text and n > 100
    assert counting.decoded <= 5 * n, (counting.decoded, n)  # the prefix each token: over 100 * n
