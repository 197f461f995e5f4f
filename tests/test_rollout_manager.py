"""The rollout manager on a scripted engine: staleness bounds, accounting, partial rollout with per-token
versions, over-sampling and dynamic sampling; every wait has a timeout."""

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch

from strop.config import build_config
from strop.data.sources import PromptSampler
from strop.rollout.generate import RolloutContext
from strop.rollout.manager import RolloutManager
from strop.rollout.schedulers import staleness
from strop.types import Completion, Sample, SamplingParams


class ScriptedEngine:
    """Tokens one at a time (``delay`` seconds each); ``abort_all`` stops every running request at its
    next token, returning what it has with finish reason 'abort'. Every completion carries the
    weight version its request started on."""

    def __init__(self, delay=0.001, seed=0, update_seconds=0.0):
        self.weight_version, self.delay, self.abort_gen = 0, delay, 0
        self.rng = random.Random(seed)
        self.requests, self.events = [], []
        self.update_seconds = update_seconds

    async def generate(self, prompt_ids, sampling):
        version, gen = self.weight_version, self.abort_gen
        self.requests.append((len(prompt_ids), sampling.max_new_tokens, version))
        self.events.append(("start", version))
        n = self.rng.randint(1, sampling.max_new_tokens)  # an early stop somewhere
        ids = []
        for _ in range(n):
            await asyncio.sleep(self.delay)
            if self.abort_gen != gen:
                return Completion(ids, [-1.0] * len(ids), "abort", version)
            ids.append(3 + len(ids) % 7)
        return Completion(ids, [-1.0] * len(ids), "stop" if n < sampling.max_new_tokens else "length", version)

    async def abort_all(self):
        self.abort_gen += 1
        self.events.append(("abort", self.weight_version))

    async def update_weights(self, state, version=None):
        await asyncio.sleep(self.update_seconds)  # loading takes a while
        self.weight_version = version
        self.events.append(("update", version))
        return version


class Prompts:
    def make_group(self, i, n, group_id):
        return [Sample(prompt=f"p{i}", prompt_ids=[1, 2, 3 + i % 5], group_id=group_id, index=j) for j in range(n)]


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


async def slow_or_fast_reward(sample: Sample) -> float:
    """Every third prompt's reward is slow to compute (a verifier that takes a while)."""
    if sample.group_id % 3 == 0:
        await asyncio.sleep(0.03)
    return float(sample.response_length % 2)


def _manager(engine, reward=slow_or_fast_reward, **rollout):
    cfg = build_config(
        overrides={
            "rollout": {"prompts_per_step": 4, "n_samples_per_prompt": 4, "max_new_tokens": 12, **rollout},
            "algo": {"use_rollout_logprobs": True},
            "train": {"steps": 6},
        }
    )
    c = SimpleNamespace(
        train_prompts=Prompts(),
        sampler=PromptSampler(50, 0),
        engine=engine,
        hooks={},
        sampling=SamplingParams(temperature=1.0, max_new_tokens=12),
    )
    ctx = RolloutContext(engine=engine, tokenizer=Tok(), config=cfg, reward=reward)
    return RolloutManager(cfg, c, ctx), cfg


async def _first_step(manager):
    try:
        return await asyncio.wait_for(manager.batch(1), timeout=20)
    finally:
        await manager.close()


async def _drive(manager, engine, steps, train_seconds=0.02):
    """The driver's order: take a step's groups, train (here: sleep), update the weights."""
    seen = []
    for step in range(1, steps + 1):
        groups, metrics = await asyncio.wait_for(manager.batch(step), timeout=20)
        manager.check_accounts()
        seen.append((step, groups, metrics))
        for _ in range(int(train_seconds / 0.001)):  # while "training", the accounts hold at every moment
            await asyncio.sleep(0.001)
            manager.check_accounts()
        await manager.update_weights(lambda: engine.update_weights(None, version=step), step)
    accounts = manager.check_accounts()
    await asyncio.wait_for(manager.close(), timeout=20)
    return seen, accounts


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "max_staleness,stale_groups,partial",
    [(1, "drop", "finish"), (2, "regenerate", "finish"), (0, "drop", "finish"), (2, "drop", "resume")],
)
def test_async_never_trains_a_token_staler_than_max_staleness(max_staleness, stale_groups, partial):
    engine = ScriptedEngine(delay=0.002)
    manager, _ = _manager(engine, mode="async", max_staleness=max_staleness, stale_groups=stale_groups, partial=partial)
    seen, accounts = asyncio.run(_drive(manager, engine, steps=6))
    if partial == "resume":  # aborted at an update, resumed: both versions kept, token by token, in order
        resumed = [s for _, groups, _ in seen for g in groups for s in g if s.metadata.get("resumed")]
        assert resumed and all(
            len(set(s.weight_versions)) >= 2 and s.weight_versions == sorted(s.weight_versions) for s in resumed
        )
    worst = 0
    for step, groups, metrics in seen:
        assert len(groups) == 4
        for s in (s for g in groups for s in g):
            assert all(0 <= st <= max_staleness for st in staleness(s, step)), (step, s.weight_versions)
            worst = max(worst, max(staleness(s, step), default=0))
        assert metrics["staleness_max"] <= max_staleness
    if max_staleness:
        assert worst >= 1  # generation really ran ahead of training
    # nothing disappears: generated = trained + dropped (with reasons) + still held
    assert accounts["generated"] == accounts["trained"] + accounts["dropped"] + accounts["held"]
    assert accounts["trained"] == 6 * 4 * 4
    assert set(manager.dropped) <= {"stale", "cancelled"}  # cancelled: in flight when the run closed
    assert all(m["dropped_fraction"] == m["samples_dropped"] / (m["samples_dropped"] + 16) for _, _, m in seen)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_async_starts_no_group_that_would_be_too_stale_when_its_turn_comes(max_staleness):
    """Generation fast, training slow: every group finishes long before it is taken, so a group started
    on weights that will be too old by its turn would be generated only to be dropped. None is started."""
    engine = ScriptedEngine(delay=0.0002)
    manager, _ = _manager(engine, mode="async", max_staleness=max_staleness)
    seen, accounts = asyncio.run(_drive(manager, engine, steps=6, train_seconds=0.1))
    assert manager.dropped["stale"] == 0
    assert accounts["trained"] == 6 * 4 * 4
    # still ahead by the most it may be: from step max_staleness + 1 on, every token is that many versions old
    for step, groups, _metrics in seen[max_staleness:]:
        assert {st for g in groups for s in g for st in staleness(s, step)} == {max_staleness}, step
    # and nothing is started for a step after the last: every group generated was trained
    assert accounts["generated"] == accounts["trained"]


@pytest.mark.timeout(60)
def test_one_step_off_trains_tokens_exactly_one_version_old():
    engine = ScriptedEngine(delay=0.0005)
    manager, _ = _manager(engine, mode="one_step_off")
    seen, accounts = asyncio.run(_drive(manager, engine, steps=6, train_seconds=0.05))  # train.steps=6
    for step, groups, metrics in seen[1:]:  # step 1 has nothing to be ahead of
        assert {st for g in groups for s in g for st in staleness(s, step)} == {1}
        assert metrics["staleness_mean"] == 1.0
    assert [m["groups_drawn"] for _, _, m in seen] == [4] * 6  # each step's draws, made while the last trained
    assert accounts["generated"] == accounts["trained"] + accounts["dropped"] + accounts["held"]
    assert accounts["held"] == 0  # the last step starts nothing after it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("resumed_tokens", ["correct", "mask"])
def test_partial_rollout_resumes_aborted_samples_keeping_per_token_versions(resumed_tokens):
    engine = ScriptedEngine(delay=0.004)  # slow decoding: the update lands mid-sample
    manager, _ = _manager(engine, mode="one_step_off", partial="resume", resumed_tokens=resumed_tokens)
    seen, _ = asyncio.run(_drive(manager, engine, steps=4, train_seconds=0.01))
    resumed = [(step, s) for step, groups, _ in seen for g in groups for s in g if s.metadata.get("resumed")]
    assert resumed, "no sample was resumed"
    for _step, s in resumed:
        versions = s.weight_versions
        assert len(set(versions)) >= 2 and versions == sorted(versions)  # old tokens first, then the new weights
        assert len(versions) == s.response_length <= 12  # the budget counts the tokens from before the abort
        last = versions[-1]
        if resumed_tokens == "mask":
            assert s.loss_mask == [int(v == last) for v in versions]
        else:
            assert all(s.loss_mask)
    # a resumed request continues from prompt + tokens so far, with the budget that is left
    assert any(prompt_len > 3 and budget < 12 for prompt_len, budget, _ in engine.requests)
    assert any(m["resumed_fraction"] > 0 for _, _, m in seen)


@pytest.mark.timeout(60)
def test_dynamic_sampling_drops_equal_reward_groups_and_tops_up():
    async def parity_of_prompt(sample: Sample) -> float:  # every sample of an even prompt gets the same reward
        return 1.0 if sample.prompt_ids[-1] % 2 == 0 else float(sample.index % 2)

    engine = ScriptedEngine()
    manager, _ = _manager(engine, reward=parity_of_prompt, dynamic_sampling=True, over_sample=1.5)
    seen, accounts = asyncio.run(_drive(manager, engine, steps=3))
    for _, groups, metrics in seen:
        assert len(groups) == 4
        assert all(len({s.reward for s in g}) > 1 for g in groups)  # no zero-signal group is trained
        dropped = sum(v for k, v in metrics.items() if k.startswith("dropped/"))
        assert dropped == metrics["samples_dropped"] > 0
        assert metrics["groups_drawn"] >= 6  # 1.5 x 4, topped up when too few survived
    assert manager.dropped["all_equal_reward"] > 0
    assert accounts["generated"] == accounts["trained"] + accounts["dropped"] + accounts["held"]


@pytest.mark.timeout(60)
def test_over_sampling_aborts_the_leftover_once_the_step_is_full():
    engine = ScriptedEngine(delay=0.003)
    manager, _ = _manager(engine, over_sample=2.0)
    seen, accounts = asyncio.run(_drive(manager, engine, steps=2))
    assert all(len(groups) == 4 for _, groups, _ in seen)
    assert manager.dropped["aborted_leftover"] + manager.dropped["over_sampled"] == 2 * 4 * 4
    assert manager.dropped["aborted_leftover"] > 0  # stopped mid-generation, not run to the end
    assert accounts["generated"] == accounts["trained"] + accounts["dropped"] + accounts["held"]


@pytest.mark.timeout(60)
def test_response_length_of_trained_and_generated_samples_are_both_reported():
    engine = ScriptedEngine(delay=0.002)
    manager, _ = _manager(engine, mode="async", max_staleness=0, over_sample=1.0)
    seen, _ = asyncio.run(_drive(manager, engine, steps=3))
    for _, groups, m in seen:
        assert m["response_length_trained_mean"] == pytest.approx(
            sum(s.response_length for g in groups for s in g) / sum(len(g) for g in groups)
        )
        assert m["response_length_generated_mean"] > 0


@pytest.mark.timeout(60)
def test_an_engine_error_in_async_generation_reaches_the_step():
    class Broken(ScriptedEngine):
        async def generate(self, prompt_ids, sampling):
            raise ConnectionError("engine gone")

    engine = Broken()
    manager, _ = _manager(engine, mode="async")

    with pytest.raises(Exception, match="engine gone"):
        asyncio.run(_first_step(manager))


def test_modes_refuse_what_they_cannot_do():
    from strop.config import ConfigError

    with pytest.raises(ConfigError, match="one_step_off.*max_staleness >= 1"):
        build_config(overrides={"rollout": {"mode": "one_step_off", "max_staleness": 0}})
    none = {"off_policy_correction": "none"}
    with pytest.raises(ConfigError, match="cannot use a rollout hook"):
        build_config(overrides={"rollout": {"mode": "async"}, "plugins": {"rollout": "x.y:z"}, "algo": none})
    with pytest.raises(ConfigError, match="importance correction"):
        build_config(overrides={"rollout": {"mode": "async", "partial": "resume"}, "algo": none})
    build_config(overrides={"rollout": {"mode": "async", "partial": "resume"}, "algo": {"tis_cap": 2.0}})
    build_config(overrides={"rollout": {"mode": "async", "partial": "resume", "resumed_tokens": "mask"}, "algo": none})


# ---- through the real driver, on the tiny model and the embedded engine ---------------------------
def _rows(run_dir):
    import json

    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "rollout",
    [
        {"mode": "one_step_off"},
        {"mode": "async", "max_staleness": 2, "partial": "resume"},
        {"mode": "sync", "dynamic_sampling": True, "over_sample": 1.5},
    ],
    ids=["one_step_off", "async-resume", "sync-dynamic"],
)
def test_modes_train_end_to_end(tiny_model_dir, tmp_path, rollout):
    import json

    from strop.loop import train
    from tests.test_e2e import tiny_overrides

    run_dir = tmp_path / "run"
    cfg = tiny_overrides(
        tiny_model_dir,
        run_dir,
        rollout=rollout,
        train={"steps": 3},
        algo={"use_rollout_logprobs": True},
        run={"save_every": 2, "plot": False},
    )
    summary = train(build_config(overrides=cfg))
    assert summary["steps"] == 3
    steps = [r for r in _rows(run_dir) if "reward_mean" in r]
    limit = {"sync": 0, "one_step_off": 1, "async": 2}[rollout["mode"]]
    for r in steps:
        assert 0 <= r["staleness_max"] <= limit and r["samples_trained"] > 0
        assert r["response_length_trained_mean"] > 0
        assert ("response_length_generated_mean" in r) == (r["samples_finished"] > 0)
        assert r.get("response_length_generated_mean", 1) > 0
    if rollout["mode"] != "sync":
        assert max(r["staleness_max"] for r in steps) >= 1  # it ran ahead
        hist = [json.loads(x) for x in (run_dir / "staleness.jsonl").read_text().splitlines()]
        assert [h["step"] for h in hist] == [1, 2, 3]
        assert sum(hist[-1]["tokens_by_staleness"].values()) > 0


@pytest.mark.timeout(300)
def test_rollout_only_then_train_only_reproduces_the_first_step(tiny_model_dir, tmp_path, capsys):
    from strop.cli import main

    args = [
        f"--model.path={tiny_model_dir}",
        "--data.size=16",
        "--data.eval_size=4",
        "--rollout.prompts_per_step=2",
        "--rollout.n_samples_per_prompt=4",
        "--rollout.max_new_tokens=8",
        "--rollout.temperature=1.3",
        "--rollout.reward=tests.plugins:even_token_reward",
        "--train.lr=1e-3",
        "--train.warmup_steps=0",
        "--run.progress=false",
        "--run.save_every=0",
        "--run.plot=false",
    ]
    assert main(["train", *args, "--train.steps=1", f"--run.dir={tmp_path / 'sync'}"]) == 0
    out = tmp_path / "samples.jsonl"
    assert main(["rollout", *args, "--train.steps=1", f"--out={out}", f"--run.dir={tmp_path / 'ro'}"]) == 0
    assert main(["train", *args, "--train.steps=1", f"--data.samples={out}", f"--run.dir={tmp_path / 'to'}"]) == 0
    sync = [r for r in _rows(tmp_path / "sync") if "loss" in r][0]
    replay = [r for r in _rows(tmp_path / "to") if "loss" in r][0]
    for key in ("loss", "grad_norm", "reward_mean", "entropy", "train_rollout_logprob_abs_diff", "advantage_std"):
        assert replay[key] == sync[key], key  # exactly: same samples, same logprobs, same trainer
    assert sync["grad_norm"] > 0
    capsys.readouterr()
    # the file's temperature must match: the trainer scales logits by it
    assert (
        main(
            [
                "train",
                *args,
                "--train.steps=1",
                f"--data.samples={out}",
                "--rollout.temperature=1.0",
                f"--run.dir={tmp_path / 'bad'}",
            ]
        )
        == 1
    )
    assert "rollout.temperature=1.3" in capsys.readouterr().err
    assert main(["train", *args, "--train.steps=2", f"--data.samples={out}", f"--run.dir={tmp_path / 'bad2'}"]) == 1
    assert "needs step 2" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad2").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_a_killed_run_resumes_with_what_the_rollout_manager_held(tiny_model_dir, tmp_path, mode):
    """The checkpoint holds the manager's finished groups (one_step_off: the next step's); the resumed
    run trains each step once and keeps its accounts."""
    import torch

    from tests.test_checkpoint import _args, _strop

    run = tmp_path / "run"
    args = _args(
        tiny_model_dir,
        run,
        f"--rollout.mode={mode}",
        "--rollout.max_staleness=2",
        "--run.save_every=1",
        "--algo.use_rollout_logprobs=true",
    )
    killed = _strop(args, kill_at="rollout:4")
    assert killed.returncode != 0 and "SIGKILL at rollout" in killed.stderr, killed.stderr[-2000:]
    state = torch.load(run / "checkpoints" / "step_000003" / "controller.pt", weights_only=False)["rollout"]
    held = sum(len(g) for g in state["ready"]) + sum(len(g) for g in state["prefetched"] or [])
    assert held > 0 and state["generated"] == state["trained"] + sum(state["dropped"].values()) + held
    done = _strop([f"--resume={run}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in _rows(run) if "reward_mean" in r] == [1, 2, 3, 4, 5]


@pytest.mark.timeout(60)
def test_async_dynamic_sampling_gives_up_after_filter_max_rounds_instead_of_hanging():
    async def always_right(sample: Sample) -> float:  # a saturated task: every group has equal rewards
        return 1.0

    engine = ScriptedEngine()
    manager, _ = _manager(engine, reward=always_right, mode="async", dynamic_sampling=True, filter_max_rounds=2)

    with pytest.raises(RuntimeError, match="no group passed the filters"):
        asyncio.run(_first_step(manager))
    assert manager.dropped["all_equal_reward"] >= 2 * 4 * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_partial_resume_sends_no_request_between_the_abort_and_the_new_weights(mode):
    engine = ScriptedEngine(delay=0.003, update_seconds=0.05)  # a slow weight load: time for a stray request
    manager, _ = _manager(engine, mode=mode, partial="resume", max_staleness=2)
    asyncio.run(_drive(manager, engine, steps=4, train_seconds=0.01))
    aborted_at = None
    for kind, version in engine.events:
        if kind == "abort":
            aborted_at = version
        elif kind == "update":
            aborted_at = None
        elif kind == "start":
            assert aborted_at is None, f"a request started on version {version} after the abort, before the update"
    assert any(kind == "abort" for kind, _ in engine.events)


@pytest.mark.timeout(60)
def test_accounts_hold_at_every_tick_while_the_next_step_generates():
    """one_step_off generates step k+1 while step k trains: between a group finishing and its round
    counting it, its samples must still count as held (checked at every event-loop tick)."""
    engine = ScriptedEngine(delay=0.0)
    manager, cfg = _manager(engine, mode="one_step_off", over_sample=1.5)
    cfg.train.steps = 30

    async def go():
        for step in range(1, 31):
            await asyncio.wait_for(manager.batch(step), timeout=20)
            for _ in range(300):
                manager.check_accounts()
                await asyncio.sleep(0)
            await manager.update_weights(lambda: engine.update_weights(None, version=step), step)
        await manager.close()

    asyncio.run(go())


CALL = [ord(c) for c in '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>']


class FlakyEngine(ScriptedEngine):
    """The first sample of each prompt calls the calculator, and the engine then aborts its second
    turn (one token, no logprobs, as a dying server might): the sample holds a turn and a tool
    output when it is aborted. With ``hopeless``, every request for a prompt whose last id is a
    multiple of 5 is aborted."""

    def __init__(self, hopeless=False, **kw):
        super().__init__(**kw)
        self.hopeless, self.called, self.aborted = hopeless, set(), set()

    async def generate(self, prompt_ids, sampling):
        base = tuple(prompt_ids[:3])
        await asyncio.sleep(self.delay)
        if self.hopeless and prompt_ids[2] % 5 == 0:
            return Completion([5], None, "abort", self.weight_version)
        if base not in self.called:
            self.called.add(base)
            return Completion(CALL, [-1.0] * len(CALL), "stop", self.weight_version)
        if len(prompt_ids) > 3 and base not in self.aborted:
            self.aborted.add(base)
            return Completion([5], None, "abort", self.weight_version)
        return await super().generate(prompt_ids, sampling)


class UniquePrompts:
    def make_group(self, i, n, group_id):
        return [Sample(prompt=f"p{i}", prompt_ids=[1, 2, 100 + i], group_id=group_id, index=j) for j in range(n)]


class TextTok(Tok):
    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _multi_turn_manager(engine, **rollout):
    from strop.rollout.multiturn import TurnLimits
    from strop.rollout.multiturn import generate as multiturn_generate
    from strop.tools import CALCULATOR, ToolSet

    from strop.rollout.generate import rollout as default_rollout

    manager, cfg = _manager(engine, **rollout)
    manager.c.hooks["rollout"] = default_rollout
    manager.c.train_prompts = UniquePrompts()
    manager.c.sampling = SamplingParams(temperature=1.0, max_new_tokens=300)  # room for the call and its output
    limits = TurnLimits(max_turn_tokens=12, observation_template="{output}")  # the scripted turns: up to 12 tokens
    manager.ctx = RolloutContext(
        engine=engine,
        tokenizer=TextTok(),
        config=cfg,
        reward=slow_or_fast_reward,
        generate=multiturn_generate,
        extra={"tools": ToolSet([CALCULATOR]), "turn_limits": limits},
    )
    return manager


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_aborted_multi_turn_samples_are_requeued_in_off_policy_modes(mode):
    """A multi-turn sample the engine aborted starts over (clean) in the off-policy modes, at most 3 times;
    one that aborts every time comes back ABORTED and is never trained."""
    from strop.types import Status

    from strop.observe.metrics import rollout_metrics

    engine = FlakyEngine(hopeless=True, delay=0.001)  # prompts 0, 5, 10, ... abort every time
    manager = _multi_turn_manager(engine, mode=mode, max_staleness=1)
    seen, accounts = asyncio.run(_drive(manager, engine, steps=3))
    samples = [s for _, groups, _ in seen for g in groups for s in g]
    requeued = [s for s in samples if s.metadata.get("requeued") and s.status != Status.ABORTED]
    fine = {s.prompt for s in samples if s.prompt_ids[-1] % 5}
    assert sorted(s.prompt for s in requeued if s.metadata["requeued"] == 1) == sorted(fine)  # one per group
    assert all(
        s.metadata["tool_calls"] == 0
        and s.metadata["turns"] == 1
        and s.response_length >= 1
        and max(s.response_ids) < 10
        for s in requeued
    )  # it starts clean: the call and the tool's
    # output of the aborted attempt are gone (the scripted engine's own tokens are 3..9)
    hopeless = [s for s in samples if s.prompt_ids[-1] % 5 == 0]
    assert all(s.status == Status.ABORTED and s.metadata["requeued"] == 3 for s in hopeless)
    assert all(s.status.trainable for s in samples if s.prompt_ids[-1] % 5)
    assert accounts["generated"] == accounts["trained"] + accounts["dropped"] + accounts["held"]
    assert hopeless, "no group of an always-aborting prompt was drawn"
    assert [rollout_metrics(groups, 1.0)["aborted_fraction"] for _, groups, _ in seen] == [
        sum(s.status == Status.ABORTED for g in groups for s in g) / 16 for _, groups, _ in seen
    ]


@pytest.mark.timeout(60)
def test_sync_mode_does_not_requeue_aborted_multi_turn_samples_and_counts_them():
    from strop.types import Status

    from strop.observe.metrics import rollout_metrics

    engine = FlakyEngine(delay=0.001)
    manager = _multi_turn_manager(engine, mode="sync")
    seen, _ = asyncio.run(_drive(manager, engine, steps=2))
    samples = [s for _, groups, _ in seen for g in groups for s in g]
    aborted = [s for s in samples if s.status == Status.ABORTED]
    assert len(aborted) == 8 and not any(s.metadata.get("requeued") for s in samples)  # one per group
    assert all(
        s.response_ids[: len(CALL)] == CALL and s.metadata["tool_calls"] == 1 and s.metadata["turns"] == 2
        for s in aborted
    )  # aborted in its second turn, after the tool ran
    assert [rollout_metrics(groups, 1.0)["aborted_fraction"] for _, groups, _ in seen] == [4 / 16, 4 / 16]


class StaleEngine(ScriptedEngine):
    """Takes every weight update (its ``weight_version`` moves, as a router's does) but keeps serving
    its initial weights, and says so in every completion: an engine that never really synced."""

    async def generate(self, prompt_ids, sampling):
        out = await super().generate(prompt_ids, sampling)
        return Completion(out.token_ids, out.logprobs, out.finish_reason, 0)


@pytest.mark.timeout(60)
def test_async_stale_drops_count_toward_giving_up_and_the_error_names_the_reason():
    engine = StaleEngine()
    manager, _ = _manager(engine, mode="async", max_staleness=1, stale_groups="regenerate")

    async def main():
        for step in range(1, 7):  # step 3 onwards: every token is 2+ versions old, regenerated ones too
            await asyncio.wait_for(manager.batch(step), timeout=30)
            await manager.update_weights(lambda: engine.update_weights(None, version=step), step)

    try:
        with pytest.raises(
            RuntimeError,
            match=r"dropped as stale \(tokens of weight versions \[0\], the trainer is "
            r"at version 2",
        ):
            asyncio.run(main())
    finally:
        asyncio.run(asyncio.wait_for(manager.close(), 20)) if manager.tasks else None
    assert manager.dropped["stale"] > 0


@pytest.mark.timeout(60)
def test_sync_mode_refuses_to_train_tokens_of_weights_the_engine_was_not_updated_to():
    engine = StaleEngine()
    manager, _ = _manager(engine, mode="sync", over_sample=1.25)  # (rounds: the path without a rollout hook)

    async def main():
        groups, _ = await asyncio.wait_for(manager.batch(1), timeout=20)  # version 0 is current: fine
        await manager.update_weights(lambda: engine.update_weights(None, version=1), 1)
        await asyncio.wait_for(manager.batch(2), timeout=20)

    with pytest.raises(RuntimeError, match=r"sampled by weight versions \[0\], but the engine's current version is 1"):
        asyncio.run(main())


@pytest.mark.timeout(60)
def test_the_routers_failovers_and_engine_events_reach_the_steps_metrics():
    class Routed(ScriptedEngine):
        def __init__(self):
            super().__init__()
            self.counts = [{"engine_failovers": 3, "engine_down": 1, "engine_readmitted": 0, "engines_healthy": 1}]

        def take_counts(self):
            return self.counts.pop()

    manager, _ = _manager(Routed(), mode="sync", over_sample=1.25)
    _, metrics = asyncio.run(_first_step(manager))
    assert (metrics["engine_failovers"], metrics["engine_down"], metrics["engines_healthy"]) == (3, 1, 1)


@pytest.mark.timeout(120)
def test_partial_keep_freezes_samples_in_the_engine_and_each_token_keeps_its_version(tiny_model_dir):
    """rollout.partial=keep on the embedded engine: what is generating at an update freezes (the engine's keep
    pause), the weights load, it continues on them; a sample spanning the update reports per token the version
    that sampled it (old tokens first), and none was aborted or restarted."""
    from transformers import AutoModelForCausalLM

    from strop.serving.embedded import EmbeddedEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = EmbeddedEngine(model, pad_token_id=0, max_batch_size=4)  # (rows queue: the update lands mid-sample)
    states = [{n: t + 0.01 * k * torch.randn_like(t) for n, t in model.state_dict().items()} for k in range(1, 5)]
    manager, _ = _manager(engine, mode="one_step_off", partial="keep", max_new_tokens=200, resumed_tokens="mask")
    manager.c.sampling = SamplingParams(temperature=1.0, max_new_tokens=200, stop_token_ids=[-1])

    async def drive():
        seen = []
        for step in range(1, 4):
            groups, _ = await asyncio.wait_for(manager.batch(step), timeout=60)
            seen.append(groups)
            await asyncio.sleep(0.3)  # "training", while the next step's samples generate
            await manager.update_weights(lambda: engine.update_weights(states[step], version=step), step)
        await asyncio.wait_for(manager.close(), timeout=60)
        return seen

    seen = asyncio.run(drive())
    samples = [s for groups in seen for g in groups for s in g]
    spanning = [s for s in samples if len(set(s.weight_versions)) > 1]
    assert spanning, [sorted(set(s.weight_versions)) for s in samples]
    for s in spanning:
        assert s.weight_versions == sorted(s.weight_versions) and len(s.weight_versions) == s.response_length == 200
        last = s.weight_versions[-1]
        assert s.loss_mask == [int(v == last) for v in s.weight_versions]  # resumed_tokens=mask: old ones out
        assert not s.metadata.get("resumed")  # kept in the engine, never aborted and sent again
    assert engine.paused is None
