"""verifiers environments (strop.envs.verifiers_env): their tasks as rows, their episodes through the agent
proxy, their rewards verifiers' own. The environments are tests/envs/vf_envs/, written in verifiers' API."""

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("verifiers")

from strop.config import build_config  # noqa: E402
from strop.configbase import ConfigError  # noqa: E402
from strop.envs.verifiers_env import EnvironmentFailure, run_episode, score_completion, task_rows  # noqa: E402
from strop.loop import rollout_only, train  # noqa: E402
from tests.agents.stand import ForcedEngine, Stand  # noqa: E402
from tests.test_e2e import tiny_overrides  # noqa: E402
from tests.tiny import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.timeout(240)

SINGLE, MULTI, TOOL = (f"tests.envs.vf_envs.vf_{name}" for name in ("single", "multi", "tool"))
CALL = '<tool_call>{"name": "calc_add", "arguments": {"a": 12, "b": 30}}</tool_call>'


def single_rows(config, split: str) -> list[dict]:
    """A data_source hook (plugins.data_source): vf_single's tasks, the last data.eval_size held out."""
    return task_rows(SINGLE, {}, split, None, config.eval_size)


# ---- rows ----------------------------------------------------------------------------------------------------
def test_held_out_tasks_are_the_last_and_never_trained():
    train_rows, eval_rows = (task_rows(SINGLE, {}, split, None, 8) for split in ("train", "eval"))
    assert (len(train_rows), len(eval_rows)) == (130 - 8, 8)  # vf_single's train split: 130 tasks
    train_ix = [r["metadata"]["task_index"] for r in train_rows]
    assert train_ix == list(range(122)) and [r["metadata"]["task_index"] for r in eval_rows] == list(range(122, 130))
    first = train_rows[0]
    assert first["prompt"] == [
        {"role": "system", "content": "Reply with the number only."},
        {"role": "user", "content": "What is 1 + 1?"},
    ]
    assert first["label"] is None and first["metadata"]["verifiers_env"] == SINGLE
    assert first["metadata"]["verifiers_kwargs"] == "{}"


def test_the_eval_split_comes_from_the_eval_kwargs():
    train_rows, eval_rows = (task_rows(SINGLE, {}, split, {"split": "eval"}, 4) for split in ("train", "eval"))
    assert (len(train_rows), len(eval_rows)) == (130, 32)  # every task of each split (strop keeps eval_size)
    assert {r["metadata"]["verifiers_kwargs"] for r in eval_rows} == {'{"split": "eval"}'}
    questions = [{json.dumps(r["prompt"]) for r in rows} for rows in (train_rows, eval_rows)]
    assert len(questions[0]) == 130 and len(questions[1]) == 32 and not questions[0] & questions[1]


def _module(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text("import verifiers.v1 as vf\n" + textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


TASKSET = """
class T(vf.Task[vf.TaskData]):
    @vf.reward
    async def r(self, trace):
        return {reward}

class S(vf.Taskset[T, vf.TasksetConfig]):
    INFINITE = {infinite}
    def load(self):
        i = 0
        while {more}:
            yield T(vf.TaskData(prompt={prompt}))
            i += 1

__all__ = ["S"]
"""


def _taskset(reward="1.0", infinite=False, more="i < 3", prompt="f'q{i}'") -> str:
    return TASKSET.format(reward=reward, infinite=infinite, more=more, prompt=prompt)


@pytest.mark.parametrize(
    "case, match",
    [
        ("no_module", r"env.verifiers='tests.envs.vf_envs.no_such_env': the module does not import: "),
        ("import_fails", r"the module does not import: .*No module named 'not_a_real_package_x'"),
        ("no_taskset", r"env.verifiers='vfbad_none': no verifiers Taskset to load: .*exports no Taskset subclass"),
        ("bad_kwargs", r"config refuses kwargs \{\"splitt\": \"eval\"\}: taskset.splitt: Extra inputs"),
        ("bad_value", r"loading its tasks failed: ValueError: split='test'"),
        ("no_tasks", r"env.verifiers='vfbad_empty': the taskset has no tasks"),
        ("no_prompt", r"env.verifiers='vfbad_noprompt': task 0 has no prompt"),
        ("all_held_out", r"130 tasks, and the last eval_size=130 are held out: none is left to train on"),
    ],
)
def test_bad_environments_are_refused_naming_them(tmp_path, monkeypatch, case, match):
    spec, kwargs, eval_size = SINGLE, {}, 2
    if case == "no_module":
        spec = "tests.envs.vf_envs.no_such_env"
    elif case == "import_fails":
        spec = _module(tmp_path, monkeypatch, "vfbad_import", "import not_a_real_package_x\n")
    elif case == "no_taskset":
        spec = _module(tmp_path, monkeypatch, "vfbad_none", "X = 1\n__all__ = ['X']\n")
    elif case == "bad_kwargs":
        kwargs = {"splitt": "eval"}
    elif case == "bad_value":
        kwargs = {"split": "test"}
    elif case == "no_tasks":
        spec = _module(tmp_path, monkeypatch, "vfbad_empty", _taskset(more="False"))
    elif case == "no_prompt":
        spec = _module(tmp_path, monkeypatch, "vfbad_noprompt", _taskset(prompt="None"))
    else:
        eval_size = 130
    with pytest.raises(ConfigError, match=match):
        task_rows(spec, kwargs, "train", None, eval_size)


def test_an_infinite_taskset_is_bounded_and_says_so(tmp_path, monkeypatch, caplog):
    spec = _module(tmp_path, monkeypatch, "vf_endless", _taskset(infinite=True, more="True"))
    with caplog.at_level(logging.WARNING):
        rows = task_rows(spec, {}, "train", None, 5, limit=30) + task_rows(spec, {}, "eval", None, 5, limit=30)
    assert [r["metadata"]["task_index"] for r in rows] == list(range(30))
    assert "more than 30 tasks (or is infinite): the first 30 are used" in caplog.text


def test_score_completion_is_the_weighted_sum_of_the_rewards():
    # task 0: "What is 1 + 1?"; exact (weight 1) + short = 1 / (1 + characters) (weight 0.1)
    assert score_completion(SINGLE, {}, 0, "2") == pytest.approx(1.0 + 0.1 / 2)
    assert score_completion(SINGLE, {}, 0, " 3 ") == pytest.approx(0.1 / 2)  # the reply is stripped
    assert score_completion(SINGLE, {"split": "eval"}, 0, "6") == pytest.approx(1.0 + 0.1 / 2)  # eval: 1 + 5


def test_strop_imports_without_verifiers_and_says_what_to_install(monkeypatch):
    code = "import sys, strop.envs.verifiers_env; assert 'verifiers' not in sys.modules, 'imported verifiers'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    monkeypatch.setitem(sys.modules, "verifiers", None)  # (an import of it now fails, as when not installed)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ImportError, match=r"pip install 'strop\[verifiers\]'"):
        task_rows(SINGLE, {"split": "not loaded yet"}, "train", None, 1)


# ---- episodes through the proxy, scripted -------------------------------------------------------------------------
@pytest.fixture
def stand_of(tokenizer):
    made = []

    def make(texts, engine_type=ForcedEngine, **kw):
        made.append(Stand(engine_type(make_tiny_model().eval(), tokenizer, texts), tokenizer, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_tool_episode_calls_the_tool_through_the_proxy_in_one_segment(stand_of, tokenizer):
    stand = stand_of([CALL, "42"])  # the model calls calc_add(12, 30), reads 42 back, answers 42
    session = stand.open()
    row = task_rows(TOOL, {}, "train", None, 1)[0]  # "What is 12 + 30? ..."
    assert run_episode(stand.proxy.base_url, session.key, row) == pytest.approx(1.1)  # correct + used_tools
    (sample,) = stand.end(session)  # what verifiers sent after the call (no content, its index) continued
    assert sample.metadata["session_calls"] == 2 and stand.proxy.counts["agent_forks"] == 0
    masked = tokenizer.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if not m])
    assert "<tool_response>\n42\n</tool_response>" in masked  # the MCP tool's result, masked
    assert "calc_multiply" in tokenizer.decode(sample.prompt_ids)  # the toolset's tools were offered
    assert stand.proxy.counts["agent_sampling_overridden"] == 0  # verifiers asked for no sampling of its own


def test_a_multi_turn_episode_gets_the_environments_replies(stand_of, tokenizer):
    stand = stand_of(["1", "3"])  # task 2: the secret is 3
    session = stand.open()
    row = task_rows(MULTI, {}, "train", None, 1)[2]
    assert run_episode(stand.proxy.base_url, session.key, row) == pytest.approx(1.0 + 0.1 / 2)
    (sample,) = stand.end(session)
    assert sample.metadata["session_calls"] == 2 and sample.metadata["segments"] == 1
    masked = tokenizer.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if not m])
    assert "Wrong, go higher." in masked


class TwoAtOnce(ForcedEngine):
    """Answers only once two calls wait at once: the episodes run concurrently."""

    async def generate(self, prompt_ids, sampling):
        self.waiting = getattr(self, "waiting", 0) + 1
        for _ in range(3000):
            if self.waiting >= 2:
                return await super().generate(prompt_ids, sampling)
            await asyncio.sleep(0.01)
        raise TimeoutError("the second episode's call never came while the first waited")


def test_concurrent_episodes_each_use_their_own_session_key(stand_of, tokenizer):
    stand = stand_of(["7"], engine_type=TwoAtOnce)
    rows = task_rows(SINGLE, {}, "train", None, 1)[:2]  # "What is 1 + 1?", "What is 1 + 2?"
    sessions = [stand.open(index=i) for i in range(2)]
    rewards = [None, None]

    def play(i):
        rewards[i] = run_episode(stand.proxy.base_url, sessions[i].key, rows[i])

    threads = [threading.Thread(target=play, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert rewards == [pytest.approx(0.05), pytest.approx(0.05)]  # "7": wrong, short = 1 / 2
    for i, session in enumerate(sessions):  # each session recorded its own episode's call, and only it
        samples = stand.end(session)
        assert len(samples) == 1 and samples[0].metadata["session_calls"] == 1, f"session {i}: {len(samples)} samples"
        sample = samples[0]
        assert f"What is 1 + {i + 1}?" in tokenizer.decode(sample.prompt_ids)


class Refusing(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"error": {"message": "no such model", "type": "invalid_request_error", "code": "boom"}})
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_a_failed_episode_raises_naming_env_task_and_error():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        row = task_rows(SINGLE, {}, "train", None, 1)[4]
        with pytest.raises(EnvironmentFailure, match=rf"env.verifiers='{SINGLE}' task 4: .*upstream 400.*boom"):
            run_episode(f"http://127.0.0.1:{server.server_address[1]}/v1", "key", row)
    finally:
        server.shutdown()
        server.server_close()


def test_a_reward_that_is_not_a_finite_number_fails_the_episode(stand_of, tmp_path, monkeypatch):
    spec = _module(tmp_path, monkeypatch, "vf_nan", _taskset(reward="float('nan')"))
    stand = stand_of(["4"])
    row = task_rows(spec, {}, "train", None, 1)[0]
    with pytest.raises(
        EnvironmentFailure, match=r"env.verifiers='vf_nan' task 0: the environment's reward is nan, not a finite number"
    ):
        run_episode(stand.proxy.base_url, stand.open().key, row)


# ---- runs on the tiny model ---------------------------------------------------------------------------------------
def _overrides(model_dir, run_dir, spec: str | None, **extra) -> dict:
    sections = {"train": {"steps": 1}, "eval": {"every": 0}, "data": {"eval_size": 0}}
    for section, values in extra.items():
        sections[section] = {**sections.get(section, {}), **values}
    cfg = tiny_overrides(model_dir, run_dir, **sections)
    if spec is None:  # the two hooks env.verifiers puts in place, set by hand
        cfg["plugins"] = {"agent": "strop.envs.verifiers_env:run_episode", "data_source": f"{__name__}:single_rows"}
    else:
        cfg["env"] = {"verifiers": spec}
    return cfg


def _samples(path) -> list[dict]:
    return [json.loads(line) for line in open(path).read().splitlines()[1:]]


def _last_reply(tokenizer, sample) -> str:
    """The text of the sample's last run of sampled tokens: the model's last reply."""
    ids, mask = sample["response_ids"], sample["loss_mask"]
    end = max(i for i, m in enumerate(mask) if m) + 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return tokenizer.decode(ids[start:end], skip_special_tokens=True).strip()


def test_a_single_turn_environment_trains(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    cfg = _overrides(tiny_model_dir, run_dir, SINGLE, train={"steps": 2}, agent={"concurrency": 8})
    cfg["env"]["verifiers_eval"] = {"split": "eval"}
    cfg["data"], cfg["eval"] = {"eval_size": 2}, {"every": 2}
    assert train(build_config(overrides=cfg))["steps"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2 and [r for r in rows if "eval_reward_mean" in r]
    for r in steps:
        assert r["samples_trained"] == 8 and r["agent_sessions/completed"] == 8 and r["failed_samples"] == 0
        assert 0 < r["reward_mean"] <= 1.1 and r["train_rollout_logprob_abs_diff"] < 1e-3
    before, after = make_tiny_model(), AutoModelForCausalLM.from_pretrained(run_dir / "final")
    for (name, a), b in zip(after.named_parameters(), before.parameters()):
        assert not a.detach().equal(b.detach()), f"{name} did not change"


def test_rewards_are_what_verifiers_computes_for_the_same_replies(tiny_model_dir, tmp_path, tokenizer):
    cfg = _overrides(tiny_model_dir, tmp_path / "run", None, agent={"concurrency": 8})
    samples = _samples(rollout_only(build_config(overrides=cfg)))
    assert len(samples) == 8
    for s in samples:
        meta = s["metadata"]
        expected = score_completion(SINGLE, {}, meta["task_index"], _last_reply(tokenizer, s))
        assert s["reward"] == pytest.approx(expected), (meta["task_index"], meta["transcript"])


def test_a_multi_turn_environment_runs_every_sample_scored(tiny_model_dir, tmp_path, tokenizer):
    cfg = _overrides(tiny_model_dir, tmp_path / "run", MULTI, rollout={"max_new_tokens": 64, "n_samples_per_prompt": 2})
    cfg["agent"] = {"concurrency": 4, "max_call_tokens": 8}
    samples = _samples(rollout_only(build_config(overrides=cfg)))
    assert len(samples) == 4 and all(s["status"] in ("completed", "truncated") for s in samples)
    assert all(s["metadata"]["session_calls"] >= 2 and s["metadata"]["segments"] == 1 for s in samples)
    for s in samples:  # the environment answered between turns; the reward reads the last reply
        assert "Guess again" in s["metadata"]["transcript"] or "Wrong, go" in s["metadata"]["transcript"]
        expected = score_completion(MULTI, {}, s["metadata"]["task_index"], _last_reply(tokenizer, s))
        assert s["reward"] == pytest.approx(expected)


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory, tokenizer):
    """The tiny model with a 1024-token window: the toolset's schemas alone take 250 tokens of the prompt."""
    path = tmp_path_factory.mktemp("tiny-llama-1024")
    model = make_tiny_model()
    model.config.max_position_embeddings = 1024
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_tool_environment_runs_with_its_tools_offered(long_context_model_dir, tmp_path, tokenizer):
    cfg = _overrides(long_context_model_dir, tmp_path / "run", TOOL, rollout={"prompts_per_step": 1})
    cfg["rollout"] |= {"n_samples_per_prompt": 2, "max_new_tokens": 16}
    samples = _samples(rollout_only(build_config(overrides=cfg)))
    assert len(samples) == 2 and all(s["status"] in ("completed", "truncated") for s in samples)
    for s in samples:
        prompt = tokenizer.decode(s["prompt_ids"])
        assert '"name": "calc_add"' in prompt and '"name": "calc_multiply"' in prompt
        called = "<tool_response>" in s["metadata"]["transcript"]  # (the random model does not call)
        reply = _last_reply(tokenizer, s)
        expected = score_completion(TOOL, {}, s["metadata"]["task_index"], reply) + 0.1 * called
        assert s["reward"] == pytest.approx(expected)
