"""An engine launcher (`engine: tests.recording_engine:start`, docs/EXTENDING.md) that puts a recording proxy in
front of the CPU engine RolloutEngine would start: every request's method and path is appended to the run's
`engine_calls.txt` (in cfg.output_dir), then forwarded unchanged (streamed answers too). tests/test_contract.py runs the default
recipe through it to see which rows of rollout.CONTRACT a plain run really uses."""

import dataclasses
import socket
import threading
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

import rollout


class Handle:
    def __init__(self, engine: rollout.RolloutEngine, server: uvicorn.Server, thread: threading.Thread):
        self.engine, self.server, self.thread = engine, server, thread

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()


def start(cfg, rank: int, host: str, seed: int):
    engine = rollout.RolloutEngine(dataclasses.replace(cfg, engine="cpu"), rank)  # the CPU engine, as a run gets it
    upstream, record = engine.url(), Path(cfg.output_dir) / "engine_calls.txt"
    record.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    client = httpx.AsyncClient(timeout=None)

    async def forward(request: Request):
        with lock, open(record, "a") as f:
            f.write(f"{request.method} {request.url.path}\n")
        req = client.build_request(request.method, upstream + request.url.path, params=request.query_params,
                                   content=await request.body(), headers={"content-type": "application/json"})
        answer = await client.send(req, stream=True)
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code,
                                 media_type=answer.headers.get("content-type"), background=None)

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT"])])
    sock = socket.socket()
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://{host}:{sock.getsockname()[1]}"
    rollout.wait_healthy(url, timeout=60)
    return url, Handle(engine, server, thread)
