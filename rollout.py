"""Rollout engines behind one HTTP protocol, SGLang's native one: the launcher, the contract, the client helpers.

Every caller (the router in agentflow.py, transfermesh.py, the controller) speaks SGLang's native HTTP API
(`/generate`, `/abort_request`, `/pause_generation`, `/update_weights_from_*`, ...) with SGLang's field names,
so the same client lines drive either engine:

* `RolloutEngine(cfg, rank)`: the object the controller wraps with `ray.remote(...)`. With `cfg.engine ==
  "sglang"` it launches a real SGLang server as a subprocess (CUDA only, `sglang_command`); with `"cpu"` it serves
  the CPU engine (cpu_engine.py, a stand-in as strict as SGLang) in-process; with a dotted path it calls the user's
  `start(cfg, rank, host, seed) -> (url, handle)` (docs/EXTENDING.md). Either way `url()` is all a caller
  needs.
* client helpers shared by every caller: `generate` and `generate_stream` (async), `post` / `get` (sync), each
  raising `EngineError` with the server's own message; `wait_healthy`.

The contract, as both engines serve it (read from SGLang 0.5.23's source; it moves between releases):

Generation. `/generate` takes `input_ids` (one list, or a batch of lists), `sampling_params` (SGLang's names and
defaults; an unknown key is a 400), `return_logprob`, `rid`, and answers `{"text", "output_ids", "meta_info"}` per
prompt, `meta_info.finish_reason` being `{"type": "stop" | "length" | "abort", ...}`. With `stream: true` the answer
is Server-Sent Events: `data: {chunk}` while the request runs (every `stream_interval` tokens, 1 by default; each chunk
cumulative, `finish_reason` null), then the finished answer, then `data: [DONE]`; a batch's chunks carry their
prompt's `index`. SGLang reports an error of a streamed request as a `data: {"error": {...}}` event.

Logprobs. `meta_info.output_token_logprobs` holds, for each sampled token, log_softmax of the RAW logits (temperature
1, before top-k/top-p/min-p) at that token: the policy's logprob, the number the trainer recomputes, so the
train-inference gap is a property of the numerics only. (SGLang by default reports the logprob after temperature
scaling; RolloutEngine starts it with SGLANG_RETURN_ORIGINAL_LOGPROB=True, unless the environment already sets it,
so both engines report the same quantity.)

Constrained decoding. `sampling_params.json_schema` (a JSON schema as a JSON string), `regex` or `ebnf` (at most one)
are compiled by xgrammar (SGLang's default grammar backend; the CPU engine pins the same 0.2.7) and applied as a token
bitmask to the logits before sampling, so the returned logprob of a token is log_softmax of the MASKED logits
(temperature 1): the distribution the token was drawn from, renormalized over what the grammar allowed. The
trainer's recomputed logprob is of the unmasked policy, lower by the log of the allowed mass. A grammar ends the
request as a stop once it is complete (the model's eos ids are its end tokens). One that does not compile is a 400,
"Failed to compile json grammar: ..." (schema keywords xgrammar would ignore included). SGLang with
`--reasoning-parser` lets a thinking model think before the grammar starts; the CPU engine does not, so the router
refuses structured output on a thinking model unless thinking is off.

Weight versions. Every step runs under one set of weights: weight updates and pauses are applied between steps, so
each token's logprob comes from the weights that produced it. `meta_info.weight_versions` names those weights per
token in SGLang's own format: a list of spans `{"version", "start", "end"}` over the output tokens (end exclusive),
one per run of tokens sampled under one version, so a request that spans weight updates reports exactly which tokens
each version produced; `meta_info.weight_version` is the version when the request finished. Tensor and distributed
updates are accepted only inside a `/begin_weight_update` ... `/end_weight_update` session.

Pausing. `/pause_generation` with mode "abort" ends every request (finish_reason abort, partial output returned);
"retract" frees their KV cache and requeues them, so on `/continue_generation` they are re-prefilled (prompt +
tokens so far) under the then-current weights; "in_place" keeps their KV cache, so partial rollouts continue with
new weights over a cache computed by older ones. New requests queue while paused. A paused engine answers
`/server_info` at once but `/health` only with a 503, 20 s later (it runs a generation): probe with the first.

Prefix cache. Finished requests leave their K/V for later requests with the same prefix (`meta_info.cached_tokens`).
An update with `flush_cache: false` (what an in-place pause needs) keeps it, so new requests would run over K/V the
old weights computed; `/flush_cache` drops it, and succeeds only with nothing running (waiting requests count unless
paused). The controller pauses with "retract" for an update and flushes after it (fleet.update_engines).

Memory tags (colocated runs). `/release_memory_occupation` and `/resume_memory_occupation` take `tags`
(["weights"], ["kv_cache"], ["cuda_graph"]; none = all three), really free and re-allocate that memory, and answer
JSON null. As in SGLang without --enable-weights-cpu-backup, released weights are not kept anywhere: resume gives
zeroed weights, and the next weight update restores them; nothing is generated while any memory is released
(requests wait). Two calls end the server, as they end SGLang's: a release while requests run (pause with
"retract" first), and a resume of a tag that is not released (the controller tracks each engine's, fleet.Fleet).

Routed experts (Qwen3-MoE). A request with `return_routed_experts: true` (SGLang also needs its server flag
`--enable-return-routed-experts`, which `sglang_command` adds under cfg.router_replay) gets
`meta_info.routed_experts`: base64 of the little-endian int32 array (tokens, layers, top_k) of the experts each
layer's router chose for every token the model ran on, i.e. positions [routed_experts_start_len, prompt + output - 1)
(the last sampled token is never fed back). The trainer replays them (R3, trainer.py) so training routes every token
as inference did.

LoRA adapters (cfg.lora_rank > 0; SGLang's server flags --enable-lora --max-lora-rank --lora-target-modules, which
`sglang_command` adds; --max-loras-per-batch, 8 by default, bounds the adapters one batch mixes). Adapters are
loaded by name: `/load_lora_adapter` {lora_name, lora_path: a PEFT directory, pinned} or
`/load_lora_adapter_from_tensors` {lora_name, config_dict: the adapter_config.json dict, serialized_named_tensors:
one payload per TP rank, each with the FULL tensors under their PEFT names (SGLang slices them per rank itself),
load_format: null (a pickled {name: tensor} dict) or "flattened_bucket", pinned, expected_checksums: {name:
sha256}}; both answer LoRAUpdateOutput {success, error_message, loaded_adapters: {name: path}}, HTTP 400 when
refused: LoRA not enabled, a name already loaded ("... because it is already loaded": a name is loaded once, never
replaced), a rank above --max-lora-rank or targets outside --lora-target-modules, DoRA. Neither needs a weight-update
session, nor takes a weight_version (`/update_weight_version` sets it apart). `/unload_lora_adapter` {lora_name}
first stops new requests from naming it, then waits until no request that named it is left, then drops it.
`/generate` takes `lora_path`: an adapter name (or one per prompt of a batch; null = the base model), resolved to
one adapter when the request arrives and kept until it ends, so a request in flight across a LoRA sync finishes on
the adapter it started with, while `meta_info.weight_versions` stamps its tokens with the server's version; the
router (agentflow.EnginePool) therefore takes a LoRA request's token versions from the adapter it named.

Run: nothing on its own (the controller starts RolloutEngine actors); `python cpu_engine.py --model-path DIR` serves
the CPU engine alone. Test: `pytest tests/test_rollout.py` (RolloutEngine, the SGLang command line, the SGLang child's
lifetime; the launch itself only where CUDA is); the contract, against the CPU engine, in tests/test_cpu_engine.py
(`generate_stream` in tests/test_token_stream.py).
Left out: SGLang's OpenAI-compatible endpoints (the router in agentflow.py serves those APIs), a streamed batch of
prompts (the router streams one prompt per request), SGLang's router (sgl-router): agentflow.EnginePool balances
over the engines itself.
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ray
import torch

import cpu_engine
import data
import transfermesh

SGLANG_STARTUP_TIMEOUT_S = 1200.0  # loading a large checkpoint and capturing CUDA graphs can take minutes


# ----------------------------------------------------------------------------------------------
# client helpers (shared by agentflow, transfermesh, the controller and the tests)


class EngineError(RuntimeError):
    """A rollout engine answered with a non-2xx status; the message carries the server's own explanation."""


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return json.dumps(body)


def _check(resp: httpx.Response, url: str, path: str):
    if resp.status_code // 100 != 2:
        raise EngineError(f"{url}{path} answered HTTP {resp.status_code}: {_error_message(resp)}")
    try:
        return resp.json()
    except ValueError:
        return {"text": resp.text}


def post(url: str, path: str, payload: dict | None = None, timeout: float = 60.0):
    """POST JSON to an engine; returns the parsed JSON answer, raises EngineError with the server's message."""
    resp = httpx.post(f"{url}{path}", json=payload if payload is not None else {}, timeout=timeout)
    return _check(resp, url, path)


def get(url: str, path: str, timeout: float = 30.0):
    """GET from an engine; returns the parsed JSON answer, raises EngineError with the server's message."""
    return _check(httpx.get(f"{url}{path}", timeout=timeout), url, path)


def _generate_body(input_ids, sampling_params: dict, rid, return_logprob: bool, return_routed_experts: bool,
                   lora_path) -> dict:
    """A /generate request body (SGLang's GenerateReqInput fields), optional fields only when set."""
    body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
    if return_routed_experts:
        body["return_routed_experts"] = True
    if lora_path is not None:
        body["lora_path"] = lora_path
    if rid is not None:
        body["rid"] = rid
    return body


async def generate(client: httpx.AsyncClient, url: str, input_ids: list[int] | list[list[int]],
                   sampling_params: dict, *, rid: str | list[str] | None = None, return_logprob: bool = True,
                   return_routed_experts: bool = False, lora_path: str | list | None = None,
                   timeout: float | None = None) -> dict | list[dict]:
    """POST /generate with token ids; returns SGLang's answer: {"text", "output_ids", "meta_info": {...}}
    (a list of those for a batch of input_ids). Raises EngineError on a non-2xx answer. `return_routed_experts`:
    meta_info.routed_experts of every position from 0 (MoE models; see the module docstring). `lora_path`: the LoRA
    adapter to generate with (one name, or one per prompt; None = the base model)."""
    payload = _generate_body(input_ids, sampling_params, rid, return_logprob, return_routed_experts, lora_path)
    resp = await client.post(f"{url}/generate", json=payload, timeout=timeout)
    return _check(resp, url, "/generate")


async def generate_stream(client: httpx.AsyncClient, url: str, input_ids: list[int], sampling_params: dict, *,
                          on_chunk, rid: str | None = None, return_logprob: bool = True,
                          return_routed_experts: bool = False, lora_path: str | None = None,
                          timeout: float | None = None) -> dict:
    """`generate` for one prompt with `stream: true`: SGLang's Server-Sent Events are read as they arrive, and each
    chunk of the still running request (cumulative: `output_ids`, `text` and `meta_info` from the first output token)
    goes to `on_chunk(chunk)`; returns the finished answer, the same dict `generate` returns. Raises EngineError on
    a non-2xx answer and on SGLang's in-stream error event (`{"error": {"message", "code"}}`, which SGLang sends, with
    HTTP 200, for a request its checks refuse), httpx.RemoteProtocolError when the stream ends before the answer."""
    payload = {**_generate_body(input_ids, sampling_params, rid, return_logprob, return_routed_experts, lora_path),
               "stream": True}
    async with client.stream("POST", f"{url}/generate", json=payload, timeout=timeout) as resp:
        if resp.status_code // 100 != 2:
            await resp.aread()
            _check(resp, url, "/generate")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                error = chunk["error"]
                raise EngineError(f"{url}/generate answered HTTP {error.get('code', 400)} in its stream: "
                                  f"{error.get('message')}")
            if chunk["meta_info"].get("finish_reason") is not None:
                return chunk
            on_chunk(chunk)
    raise httpx.RemoteProtocolError(f"{url}/generate ended its stream before the request finished")


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None, log_path: str | None = None) -> None:
    """Poll GET /health until it answers 200. If `proc` dies first, raise with the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"rollout server at {url} exited with code {proc.returncode} before becoming "
                               f"healthy. Last lines of {log_path}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"rollout server at {url} was not healthy after {timeout:.0f} s. "
                       f"Last lines of {log_path}:\n{_tail(log_path)}")


def _tail(path: str | None, n: int = 60) -> str:
    if not path or not os.path.exists(path):
        return "(no log)"
    with open(path, errors="replace") as f:
        return "".join(collections.deque(f, maxlen=n))


# ----------------------------------------------------------------------------------------------
# the actor the controller wraps with ray.remote


def _serve_host() -> str:
    """Loopback on one machine; this node's address when the Ray cluster spans several."""
    if ray.is_initialized() and sum(n["Alive"] for n in ray.nodes()) > 1:
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def _die_with_parent() -> None:
    """In the SGLang child, before exec: on Linux, get SIGTERM when the engine actor's process dies, even by
    SIGKILL (Ray killing the actor), so no server is left holding GPUs. Elsewhere shutdown() is the only stop."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def sglang_options(cfg, seed: int) -> dict:
    """cfg.sglang with LoongSage's defaults where the recipe's dict does not set them (a recipe drops one by setting
    it to null): the server flags of an SGLang engine, of which the CPU engine honours the ones it implements
    (enable_deterministic_inference, disable_radix_cache)."""
    opts = dict(cfg.sglang or {})
    opts.setdefault("tp_size", cfg.gpus_per_engine)
    opts.setdefault("random_seed", seed)
    opts.setdefault("weight_version", "0")  # versions count trainer steps; SGLang's own default is "default"
    opts.setdefault("dtype", cfg.dtype)  # SGLang's "auto" serves an fp32 checkpoint in float16, off the trainer's dtype
    # every trajectory carries its own sampling_seed (agentflow.sampling_seed), which SGLang honours only in this
    # mode (batch-invariant kernels: slower; null trades reproducible trajectories for throughput)
    opts.setdefault("enable_deterministic_inference", True)
    if cfg.fp32_lm_head:  # SGLang 0.5.23: exec.features.enable_fp32_lm_head
        opts.setdefault("enable_fp32_lm_head", True)
    if cfg.colocate:  # release/resume_memory_occupation need SGLang's memory saver
        opts.setdefault("enable_memory_saver", True)
    if cfg.router_replay:  # R3: the server captures routed experts only with this flag
        opts.setdefault("enable_return_routed_experts", True)
    if cfg.lora_rank:  # LoRA: adapters loaded at every sync (no --lora-paths, so rank and targets are given)
        opts.setdefault("enable_lora", True)
        opts.setdefault("max_lora_rank", cfg.lora_rank)
        opts.setdefault("lora_target_modules", list(cfg.lora_targets))
    return opts


def sglang_command(cfg, host: str, port: int, seed: int) -> list[str]:
    """`python -m sglang.launch_server ...` with every key of `sglang_options` passed through as a `--key value` flag
    (underscores become dashes, True is a bare flag, False and null are left out, lists give several values)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path,
           "--host", host, "--port", str(port)]
    for key, value in sglang_options(cfg, seed).items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            cmd += [flag, *map(str, value)]
        elif isinstance(value, dict):
            cmd += [flag, json.dumps(value)]
        else:
            cmd += [flag, str(value)]
    return cmd


class RolloutEngine:
    """One rollout engine (SGLang server or CPU engine) as a plain class; the controller wraps it in ray.remote.

    Reads cfg.model_path, cfg.engine ("auto"|"cpu"|"sglang"|a dotted path), cfg.engine_max_batch, cfg.max_prompt_len,
    cfg.max_new_tokens, cfg.max_context_len, cfg.seed, cfg.dtype, cfg.sglang, cfg.gpus_per_engine, cfg.output_dir,
    cfg.lora_rank and cfg.lora_targets (LoRA adapters on: the CPU engine's `lora`, SGLang's flags).
    """

    def __init__(self, cfg, rank: int, gpu_ids: list[str] | None = None, busy_file: str = ""):
        """`gpu_ids`: the GPUs of every placement bundle this engine spans (fleet.placement); an SGLang server
        with tensor parallel size k needs all k visible, while Ray shows the actor only its own bundle's.
        `busy_file`: the run's file where a CPU engine keeps byte `rank` at 1 while computing (cpu.engine_busy_file)."""
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.handle: cpu_engine.ServerHandle | None = None
        host = _serve_host()
        seed = int(cfg.seed) + 1000 * rank  # different engines draw different samples
        engine = cfg.engine if cfg.engine != "auto" else ("sglang" if torch.cuda.is_available() else "cpu")
        if engine == "cpu":
            if cfg.engine_threads > 0:  # see Config.engine_threads: sync uses every core
                torch.set_num_threads(int(cfg.engine_threads))
            max_len = max(int(cfg.max_prompt_len) + int(cfg.max_new_tokens), int(cfg.max_context_len or 0))
            flags = sglang_options(cfg, seed)  # the SGLang flags the CPU engine implements, as SGLang would get them
            self._url, self.handle = cpu_engine.serve(cfg.model_path, host=host, max_batch=int(cfg.engine_max_batch),
                                           max_len=max_len, seed=seed, dtype=cfg.dtype,
                                           fp32_lm_head=bool(getattr(cfg, "fp32_lm_head", False)),
                                           busy_flag=(busy_file, rank) if busy_file else None,
                                           enable_deterministic_inference=bool(
                                               flags.get("enable_deterministic_inference")),
                                           disable_radix_cache=bool(flags.get("disable_radix_cache")),
                                           lora=dict(max_lora_rank=cfg.lora_rank,
                                                     lora_target_modules=list(cfg.lora_targets))
                                           if cfg.lora_rank else None)
        elif engine == "sglang":
            if not torch.cuda.is_available():
                raise RuntimeError("engine=sglang needs CUDA, and none is visible to this actor; use engine=cpu "
                                   "or give the rollout actors GPUs")
            port = transfermesh.free_port(host)
            self._url = f"http://{host}:{port}"
            log_dir = Path(cfg.output_dir or tempfile.gettempdir())
            log_dir.mkdir(parents=True, exist_ok=True)
            self.log_path = str(log_dir / f"sglang_engine_{rank}.log")
            cmd = sglang_command(cfg, host, port, seed)
            with open(self.log_path, "w") as log:
                log.write(" ".join(cmd) + "\n")
                log.flush()
                # raw (temperature-1) logprobs, the same quantity the CPU engine and the trainer compute
                env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "True", **os.environ}
                if gpu_ids:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
                # own session: shutdown() kills the server and every process it spawned (schedulers, detokenizer)
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True, preexec_fn=_die_with_parent)
            try:
                wait_healthy(self._url, SGLANG_STARTUP_TIMEOUT_S, self.proc, self.log_path)
            except BaseException:
                self.shutdown()
                raise
        elif data.is_dotted(engine):  # EXT: a user's engine, fn(cfg, rank, host, seed) -> (url, handle), serving
            #                           SGLang's HTTP contract; handle.shutdown() stops it
            self._url, self.handle = data.import_object(engine)(cfg, rank=rank, host=host, seed=seed)
        else:
            raise ValueError(f"cfg.engine must be 'auto', 'cpu', 'sglang' or a dotted path 'module.function', got "
                             f"{cfg.engine!r}")

    def url(self) -> str:
        return self._url

    def shutdown(self) -> None:
        if self.handle is not None:
            self.handle.shutdown()
            self.handle = None
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.proc = None
