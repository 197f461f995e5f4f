"""A judge for tests: an OpenAI-compatible chat server on 127.0.0.1 that answers 'VERDICT: 1' when the
response slot holds the reference answer and 'VERDICT: 0' otherwise, after ``delay`` seconds, and counts
the calls in flight at once (GET /stats). Run as a process so a test can kill it mid-step:

    python tests/envs/judge_server.py PORT [--die-after N] [--delay S] [--garbage]

``--die-after N`` exits the process (no answer, no clean shutdown) on the (N+1)-th call; ``--garbage``
answers text with no verdict. Every route needs the token 'judge-key'; the process ends by itself after
``--lifetime`` seconds (a test that forgets it cannot leave it behind).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import threading

import uvicorn
from fastapi import FastAPI, HTTPException, Request

TOKEN = "judge-key"


def make_app(die_after: int | None, delay: float, garbage: bool) -> FastAPI:
    app = FastAPI()
    stats = {"calls": 0, "in_flight": 0, "max_in_flight": 0, "prompts": []}

    def _auth(request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            raise HTTPException(401, "bad token")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        _auth(request)
        body = await request.json()
        if die_after is not None and stats["calls"] >= die_after:
            os._exit(1)  # killed mid-step: the connection drops without an answer
        stats["calls"] += 1
        stats["in_flight"] += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        try:
            await asyncio.sleep(delay)
            text = body["messages"][-1]["content"]
            stats["prompts"].append(text)
            ref = re.search(r"<reference>\n(.*?)\n</reference>", text, re.S)
            slot = re.search(r"<response>\n(.*)\n</response>", text, re.S)
            verdict = int(bool(ref and slot and ref.group(1).strip() and ref.group(1).strip() in slot.group(1)))
            content = "I cannot say." if garbage else f"Looked at it.\nVERDICT: {verdict}"
            return {
                "id": "judge",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
            }
        finally:
            stats["in_flight"] -= 1

    @app.get("/stats")
    async def get_stats(request: Request):
        _auth(request)
        return stats

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--delay", type=float, default=0.02)
    ap.add_argument("--garbage", action="store_true")
    ap.add_argument("--lifetime", type=float, default=240.0)
    a = ap.parse_args()
    threading.Timer(a.lifetime, lambda: os._exit(0)).start()
    uvicorn.run(make_app(a.die_after, a.delay, a.garbage), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
