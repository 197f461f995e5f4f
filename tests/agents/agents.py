"""Agent programs for the tests: plain OpenAI-SDK code, as a user would write it."""

import itertools
import threading

import httpx
import openai

_counter = itertools.count()
_lock = threading.Lock()


def _even_fraction(ids) -> float:
    return sum(t % 2 == 0 for t in ids) / max(len(ids), 1)


def two_calls(base_url, api_key, row):
    """Answers, is asked again, answers again; returns the even-token reward of both answers."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=5)
    msgs = list(row["messages"])
    first = client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Again."}]
    second = client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
    return _even_fraction(first.choices[0].model_extra["token_ids"] + second.choices[0].model_extra["token_ids"])


def posts_reward(base_url, api_key, row):
    """One call; the reward goes to the session's reward route."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=5)
    r = client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    httpx.post(
        f"{base_url}/sessions/{row['session_id']}/reward",
        headers={"Authorization": f"Bearer {api_key}"},
        json={"reward": _even_fraction(r.choices[0].model_extra["token_ids"])},
    ).raise_for_status()


def compacts(base_url, api_key, row):
    """Two calls, the second on a rewritten history: two segments."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=5)
    client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    short = [{"role": "user", "content": "Briefly: " + row["messages"][-1]["content"][-40:]}]
    r = client.chat.completions.create(model="policy", messages=short, max_tokens=4)
    return _even_fraction(r.choices[0].model_extra["token_ids"])


def silent(base_url, api_key, row):
    """Calls the model and never says how it went."""
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=5).chat.completions.create(
        model="policy", messages=row["messages"], max_tokens=4
    )


def fails_every_other(base_url, api_key, row):
    """Every second run raises after its call: only that sample fails."""
    with _lock:
        k = next(_counter)
    reward = two_calls(base_url, api_key, row)
    if k % 2:
        raise ValueError(f"agent run {k} broke")
    return reward


async def async_two_calls(base_url, api_key, row):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=5)
    msgs = list(row["messages"])
    first = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
    await client.close()
    return _even_fraction(first.choices[0].model_extra["token_ids"] + second.choices[0].model_extra["token_ids"])


def gives_up_on_429(base_url, api_key, row):
    """Every other run: eight parallel calls in one session (sub-agents beside the main one), no
    retries: with room for one call at a time, some get a 429 and the agent stops."""
    import concurrent.futures

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    with _lock:
        k = next(_counter)
    if k % 2:  # every other run: one call, which has the proxy to itself
        r = client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
        return _even_fraction(r.choices[0].model_extra["token_ids"])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        calls = [
            pool.submit(client.chat.completions.create, model="policy", messages=row["messages"], max_tokens=4)
            for _ in range(8)
        ]
        answers = [c.result() for c in calls]
    return _even_fraction(answers[0].choices[0].model_extra["token_ids"])


# ---- hung agents (agent.timeout_s): STROP_TEST_HANG_DIR is where they leave their marks --------------
RELEASE = threading.Event()  # (threads) lets a hung agent return
AFTER_RELEASE: list[int] = []  # (threads) the status of the call a hung agent made after strop gave up on it
HUNG: list[threading.Thread] = []  # (threads) where it hangs


def _hang_dir():
    import os
    from pathlib import Path

    return Path(os.environ["STROP_TEST_HANG_DIR"])


def hangs_first(base_url, api_key, row):
    """The first run (of any thread or process) makes one call, starts a child process and then
    blocks: once the next run has started (so strop has given up on it), it calls again, notes what
    it got in AFTER_RELEASE and blocks until RELEASE. The others are two_calls. Every run writes
    when it started to ``starts``."""
    import os
    import subprocess
    import sys
    import time

    d = _hang_dir()
    with open(d / "starts", "a") as f:
        f.write(f"{time.time()}\n")
    try:
        os.close(os.open(d / "hung", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return two_calls(base_url, api_key, row)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (d / "pids").write_text(f"{os.getpid()} {child.pid}")
    HUNG.append(threading.current_thread())
    deadline = time.monotonic() + 60
    while len((d / "starts").read_text().split()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # (a worker process is killed in here)
    child.kill()
    child.wait()
    try:
        client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
        AFTER_RELEASE.append(200)
    except openai.APIStatusError as exc:
        AFTER_RELEASE.append(exc.status_code)
    RELEASE.wait(60)
    return 1.0


async def hangs_async(base_url, api_key, row):
    """An async agent that never returns: cancelled at agent.timeout_s, its thread ends."""
    import asyncio

    await asyncio.sleep(60)


def by_row(base_url, api_key, row):
    """No model call: exits its process, sleeps or returns, as its row says (worker tests)."""
    import os
    import time

    if row.get("exit"):
        os._exit(3)
    time.sleep(row.get("sleep", 0))
    return row.get("reward")
