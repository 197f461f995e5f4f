"""A stand-in engine behind strop's token guard (tests/serving/test_engine_guard.py): a raw ASGI app on a Unix
socket (``unix:PATH``) or ``127.0.0.1:PORT``, started once the file $GO_FILE exists (until then the guard has
nothing to forward to). It records every request it receives; paths under ``/_`` are the test's own:

  /_log          the requests received so far (method, path, query, headers, body), JSON
  /_release      lets the held second chunk of /stream go
  /stream        server-sent events: one event, then a second only after /_release
  /hold          answers nothing; records "hold: gone" when the client's connection closes
  /hold_stream   one event, then nothing; records "hold_stream: gone" when the connection closes
  /drop          promises 100 bytes, sends 10 and breaks the connection
  /status/N      answers status N with a header x-upstream: yes
  anything else  200 with what it received
"""

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import uvicorn

log: list[dict] = []
release = asyncio.Event()


async def _wait_gone(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _json(send, status: int, value, headers=()) -> None:
    body = json.dumps(value).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"), *headers]}
    )
    await send({"type": "http.response.body", "body": body})


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    path = scope["path"]
    if not path.startswith("/_"):
        log.append(
            {
                "method": scope["method"],
                "path": scope["raw_path"].decode(),
                "query": scope["query_string"].decode(),
                "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]],
                "body": body.decode(),
            }
        )
    if path == "/_log":
        await _json(send, 200, log)
    elif path == "/_release":
        release.set()
        await _json(send, 200, {})
    elif path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"data: 2\n\n"})
    elif path in ("/hold", "/hold_stream"):
        if path == "/hold_stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await _wait_gone(receive)
        log.append({"event": f"{path[1:]}: gone"})
    elif path == "/drop":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]})
        await send({"type": "http.response.body", "body": b"0123456789", "more_body": True})
        raise RuntimeError("the stand-in engine breaks the connection (expected)")
    elif path.startswith("/status/"):
        await _json(send, int(path.rsplit("/", 1)[1]), {"status": True}, [(b"x-upstream", b"yes")])
    else:
        await _json(send, 200, log[-1])


if __name__ == "__main__":
    deadline = time.monotonic() + 60
    while not Path(os.environ["GO_FILE"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    where = sys.argv[1]
    bind = {"uds": where[5:]} if where.startswith("unix:") else {"host": "127.0.0.1", "port": int(where.split(":")[1])}
    uvicorn.run(app, log_level="critical", **bind)
