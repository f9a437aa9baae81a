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
* `EnginePool`: the router's client of every engine: least-loaded choice, sticky sessions, health probes, a loop
  tick's requests coalesced into one batched `/generate`, each token's weight version (`token_versions`).

The contract: `CONTRACT` below lists every endpoint a client sends, the feature that needs it (plain RL, broadcast,
disk, colocation, LoRA) and the code that sends it; docs/ENGINES.md says what each does as both engines serve it
(read from SGLang 0.5.23's source; it moves between releases). What every caller relies on: `meta_info` carries, per
sampled token, log_softmax of the RAW logits (temperature 1, before top-k/top-p; under a grammar, of the masked
logits) and the weight version in SGLang's spans `{"version", "start", "end"}`; tensor and distributed updates sit
inside `/begin_weight_update` ... `/end_weight_update`; an update pauses with "retract" and flushes the prefix cache
after (fleet.update_engines); an unknown `sampling_params` key is a 400.

Run: nothing on its own (the controller starts RolloutEngine actors); `python cpu_engine.py --model-path DIR` serves
the CPU engine alone. Test: `pytest tests/test_rollout.py` (RolloutEngine, the SGLang command line, the SGLang child's
lifetime; the launch itself only where CUDA is); the contract, against the CPU engine, in tests/test_cpu_engine.py
(`generate_stream` in tests/test_token_stream.py).
Left out: SGLang's OpenAI-compatible endpoints (the router in agentflow.py serves those APIs), a streamed batch of
prompts (the router streams one prompt per request), SGLang's router (sgl-router): rollout.EnginePool balances
over the engines itself.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ray
import torch

import data
import transfermesh

log = logging.getLogger("loongsage.rollout")
SGLANG_STARTUP_TIMEOUT_S = 1200.0  # loading a large checkpoint and capturing CUDA graphs can take minutes

# The engine contract (the module docstring says what a row is). The "plain" rows are all that plain RL asks of an
# engine (sync or async, weights over shared memory or CUDA IPC on one machine); a second backend serves them and the
# rows of the features it supports (tests/test_contract.py holds the table to the code three ways).
CONTRACT = (
    # endpoint                          feature      sent by
    ("/health",                         "plain",     "rollout.wait_healthy: the launch waits for it"),
    ("/server_info",                    "plain",     "EnginePool._alive and _watch: liveness, paused or not; "
                                                     "fleet.engine_states"),
    ("/generate",                       "plain",     "rollout.generate, rollout.generate_stream (EnginePool, eval)"),
    ("/abort_request",                  "plain",     "EnginePool.abort (a group's leftovers), AgentFlow's judge"),
    ("/pause_generation",               "plain",     "fleet.update_engines, colocate_hand_off (retract); "
                                                     "transfermesh.pause_engines (in place)"),
    ("/continue_generation",            "plain",     "fleet.update_engines, transfermesh.continue_engines"),
    ("/flush_cache",                    "plain",     "fleet.update_engines: no prefix K/V of old weights survives"),
    ("/begin_weight_update",            "plain",     "transfermesh.push_weights"),
    ("/update_weights_from_tensor",     "plain",     "transfermesh._push_shm, _push_cuda_ipc"),
    ("/end_weight_update",              "plain",     "transfermesh.push_weights"),
    ("/update_weight_version",          "plain",     "transfermesh.push_weights, push_adapter"),
    ("/init_weights_update_group",      "broadcast", "transfermesh._push_broadcast: receivers on other machines"),
    ("/update_weights_from_distributed", "broadcast", "transfermesh._push_broadcast"),
    ("/destroy_weights_update_group",   "broadcast", "transfermesh._destroy_broadcast_groups"),
    ("/update_weights_from_disk",       "disk",      "transfermesh._push_disk (transfer: disk)"),
    ("/release_memory_occupation",      "colocate",  "fleet.colocate_hand_off, restart_engine"),
    ("/resume_memory_occupation",       "colocate",  "fleet.colocate_hand_off: what each engine released"),
    ("/load_lora_adapter",              "lora",      "transfermesh.push_adapter (transfer: disk)"),
    ("/load_lora_adapter_from_tensors", "lora",      "transfermesh.push_adapter (shm, cuda_ipc)"),
    ("/unload_lora_adapter",            "lora",      "EnginePool._unload: an adapter no request names any more"),
)
# R3 (router_replay) adds no endpoint: `/generate` with `return_routed_experts` (and SGLang's server flag). Routes
# an SGLang server (and the CPU engine) also serves, which no LoongSage client sends: aliases and introspection.
SERVED_NOT_SENT = ("/health_generate", "/model_info", "/get_model_info", "/get_server_info", "/get_weight_version")


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


_HTTP: httpx.Client | None = None  # post/get's, kept: httpx.post builds a client, an SSL context, each call (~25 ms)


def _http() -> httpx.Client:
    global _HTTP
    _HTTP = _HTTP or httpx.Client()
    return _HTTP


def post(url: str, path: str, payload: dict | None = None, timeout: float = 60.0):
    """POST JSON to an engine; returns the parsed JSON answer, raises EngineError with the server's message."""
    return _check(_http().post(f"{url}{path}", json=payload if payload is not None else {}, timeout=timeout), url, path)


def get(url: str, path: str, timeout: float = 30.0):
    """GET from an engine; returns the parsed JSON answer, raises EngineError with the server's message."""
    return _check(_http().get(f"{url}{path}", timeout=timeout), url, path)


def _generate_body(input_ids, sampling_params: dict, rid, return_logprob: bool, return_routed_experts: bool,
                   lora_path) -> dict:
    """A /generate request body (SGLang's GenerateReqInput fields), optional fields only when set."""
    body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob,
            "return_routed_experts": True if return_routed_experts else None, "lora_path": lora_path, "rid": rid}
    return {k: v for k, v in body.items() if v is not None}


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
# the router's engine client: least-loaded choice, stickiness, health, per-token versions


class EngineUnavailable(Exception):
    """No healthy engine answered; the trajectory fails (and may be retried)."""


class EngineRejected(EngineError):
    """The engine refused the input itself (bad ids, too long): the client's fault, not the engine's (a 400)."""


def _version(v) -> int:
    """Engines report weight versions as strings (SGLang: "default" before the first update -> 0)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def token_versions(meta: dict, n: int) -> list[int]:
    """Per-token weight versions from the engine's `weight_versions` spans (SGLang >= 0.5.23 and the CPU
    engine: [{"version", "start", "end"}, ...] over the output tokens, end exclusive), so a request that spans
    a weight update keeps the exact version of every token. An engine without spans reports only the version
    at the end; every token then gets it, which can understate the lag of the request's early tokens."""
    spans = meta.get("weight_versions")
    if spans and spans[-1]["end"] == n and spans[0]["start"] == 0:
        out = [_version(span["version"]) for span in spans for _ in range(span["end"] - span["start"])]
        if len(out) == n:
            return out
    return [_version(meta.get("weight_version"))] * n


def http_status(e: Exception) -> int | None:
    """The HTTP status an engine call failed with (an httpx error's, or the one EngineError's message names)."""
    if getattr(e, "status_code", None) is not None:
        return e.status_code
    m = re.search(r"answered HTTP (\d{3})", str(e))  # EngineError's message: "... answered HTTP 400: ..."
    return int(m.group(1)) if m else None


def nodelay_transport(**kw):
    """An httpx transport with TCP_NODELAY: httpx writes a POST's headers and body separately, and with Nagle on
    the body waits for the peer's delayed ACK of the headers (docs/AGENTFLOW.md)."""
    return httpx.AsyncHTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)], **kw)


class EnginePool:
    """Routes /generate calls over several engines, and keeps track of which are alive.

    A request goes to the session's engine if it has one and it is healthy (so its prefix cache stays
    warm), else to the healthy engine with the fewest requests in flight (ties rotate).

    Health. Every failed call (connection error, 5xx) is followed at once by a `/server_info` probe: no answer
    within `health_timeout_s` means dead (or hung), out of routing until `replace()` puts its successor in; one that
    answers only sits out `cooldown_s`. `check()` probes every engine, every `check_every_s` while requests are in
    flight, so a hung engine is found too: refused or failed, it leaves at once; silent past `health_timeout_s`, at
    the second probe in a row (one slow answer, from an engine on a loaded machine, is not a death). Requests in
    flight on an engine that leaves routing are retried on the others, invisibly to the trajectory; with no engine
    left a request waits up to `wait_s` before it fails.

    LoRA. After `use_adapter(name, version)` every request names that adapter (`lora_path`) and its tokens carry
    that adapter's version (an engine keeps a request on the adapter it named); the adapter it replaces is unloaded
    once no request of this pool uses it.
    """

    def __init__(self, urls: list[str], *, timeout_s: float = 600.0, cooldown_s: float = 5.0,
                 health_timeout_s: float = 10.0, check_every_s: float = 5.0, wait_s: float = 300.0,
                 return_routed_experts: bool = False):
        if not urls:
            raise ValueError("EnginePool needs at least one engine URL (got an empty list); start the rollout "
                             "engines first and pass their URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self.inflight = {u: 0 for u in self.urls}
        self.down_until = {u: 0.0 for u in self.urls}
        self.dead: set[str] = set()  # engines found dead or hung: out of routing until replace()
        self.timeout_s, self.cooldown_s = timeout_s, cooldown_s
        self.health_timeout_s, self.check_every_s, self.wait_s = health_timeout_s, check_every_s, wait_s
        self.retried = 0  # requests moved to another engine after their engine failed (rollout/retried)
        self.silent: collections.Counter = collections.Counter()  # url -> check()'s probes in a row it did not answer
        self.return_routed_experts = return_routed_experts  # ask every /generate for meta_info.routed_experts (R3)
        self._rotate = 0
        self._http: httpx.AsyncClient | None = None
        self.running: dict[str, str] = {}  # rid -> engine url of every request this pool has in flight
        self._pending: dict[tuple[str, str], list] = {}  # (engine url, batch key) -> requests of this loop tick,
        #                                                   sent as one batch
        self._sent: dict[str, set] = {}  # engine url -> futures of requests sent to it and not answered yet
        self._watcher: asyncio.Task | None = None
        self.adapter: tuple[str, int] | None = None  # LoRA: (adapter name, its weight version) new requests name
        self.adapter_users: collections.Counter = collections.Counter()  # adapter name -> requests in flight on it
        self.retired: set[str] = set()  # adapters replaced by a newer one, unloaded when their last request ends

    @property
    def http(self) -> httpx.AsyncClient:
        # Created lazily so it binds to the event loop that uses it (a Ray async actor's loop).
        if self._http is None:
            # Few idle connections kept: httpcore scans every connection on each request and response, which costs
            # more than a new local connection (docs/AGENTFLOW.md)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=8)
            self._http = httpx.AsyncClient(timeout=self.timeout_s, transport=nodelay_transport(limits=limits))
        return self._http

    def healthy(self) -> list[str]:
        # An engine that failed a call but still answers the probe sits out a cool-down (down_until) rather than
        # leaving for good: it is more likely overloaded or restarting than dead.
        now = time.monotonic()
        return [u for u in self.urls if u not in self.dead and self.down_until[u] <= now]

    def pick(self, prefer: str | None = None) -> str:
        up = self.healthy()
        if not up:
            raise EngineUnavailable(f"no engine of {self.urls} is up (dead: {sorted(self.dead)}); check their "
                                    f"logs; one that failed a call is retried {self.cooldown_s:.0f}s later")
        if prefer in up:
            return prefer
        # Rotate the starting point so that ties in requests in flight (all idle at the start of a step) spread
        # new sessions over the engines instead of always landing on the first one.
        self._rotate += 1
        order = up[self._rotate % len(up):] + up[:self._rotate % len(up)]
        return min(order, key=lambda u: self.inflight[u])

    async def _pick_or_wait(self, prefer: str | None) -> str:
        """pick(), or wait up to `wait_s` for an engine to come back (a cool-down ends, a dead one is replaced)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return self.pick(prefer)
            except EngineUnavailable:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.2)

    def use_adapter(self, name: str, version: int) -> None:
        """LoRA: new requests generate with adapter `name` (weight version `version`), which every engine has loaded;
        the one it replaces goes once its requests have ended."""
        old, self.adapter = self.adapter, (name, int(version))
        if old is not None and old[0] != name:
            self.retired.add(old[0])
            self._release(old[0])

    def _release(self, name: str) -> None:
        """Unload a retired adapter from every engine in routing, in the background, once no request uses it."""
        if name in self.retired and not self.adapter_users[name]:
            self.retired.discard(name)
            asyncio.ensure_future(self._unload(name))

    async def _unload(self, name: str) -> None:
        for url in [u for u in self.urls if u not in self.dead]:
            try:
                r = await self.http.post(f"{url}/unload_lora_adapter", json={"lora_name": name})
                if r.status_code >= 400:  # e.g. an engine re-created after this adapter's sync never had it
                    log.warning("engine %s did not unload LoRA adapter %s: %s", url, name, r.text[:300])
            except httpx.HTTPError as e:  # a dead engine leaves routing through the health checks, not here
                log.warning("engine %s did not unload LoRA adapter %s: %r", url, name, e)

    async def generate(self, input_ids: list[int], sampling_params: dict, rid: str,
                       prefer: str | None = None, batch: str = "", on_chunk=None) -> tuple[str, dict]:
        """POST /generate on one engine (generate); returns (engine url, the engine's answer).
        A failed engine is probed and the request moves to another; at most two tries per engine.
        `batch`: requests of one loop tick with the same key travel together (see `_coalesced`).
        `on_chunk`: stream instead (generate_stream, alone, never batched): it gets every chunk of the
        running request, cumulative; a retry on another engine starts its chunks again from the first token.
        LoRA: each try names the current adapter, and the answer's weight versions become that adapter's."""
        if self._watcher is None and self.check_every_s > 0:
            self._watcher = asyncio.ensure_future(self._watch())
        last_error: Exception | None = None
        # Two tries per engine: one transient failure (a dropped connection, an engine being replaced) must not
        # fail a trajectory. Stickiness only on the first try: a retry is free to leave the engine that failed.
        for attempt in range(2 * len(self.urls)):
            url = await self._pick_or_wait(prefer if attempt == 0 else None)
            self.inflight[url] += 1
            self.running[rid] = url
            adapter = self.adapter  # LoRA: this try's adapter, fixed now (a sync may name another meanwhile)
            if adapter is not None:
                self.adapter_users[adapter[0]] += 1
            try:
                lora_path = adapter[0] if adapter else None
                answer = await (self._coalesced(url, input_ids, sampling_params, rid, batch, lora_path)
                                if on_chunk is None else
                                self._streamed(url, input_ids, sampling_params, rid, lora_path, on_chunk))
                if adapter is not None:  # every token came from the adapter this request named (the docstring)
                    n = len(answer.get("output_ids", []))
                    answer.setdefault("meta_info", {}).update(weight_version=str(adapter[1]), weight_versions=[
                        {"version": str(adapter[1]), "start": 0, "end": n}])
                return url, answer
            except EngineError as e:
                status = http_status(e)
                if status is not None and status < 500:
                    # The engine refused the input itself (bad ids, too long): the client's fault, not the engine's.
                    raise EngineRejected(f"the rollout engine rejected the request: {e}") from None
                last_error = e
            except (httpx.TransportError, EngineUnavailable) as e:  # EngineUnavailable: its engine left routing
                last_error = e
            finally:
                self.inflight[url] -= 1
                self.running.pop(rid, None)
                if adapter is not None:
                    self.adapter_users[adapter[0]] -= 1
                    self._release(adapter[0])
            self.retried += 1
            if url not in self.dead and not await self._alive(url):
                self.mark_dead(url, f"it failed a call ({last_error!r}) and then did not answer /server_info")
            elif url not in self.dead:
                self.down_until[url] = time.monotonic() + self.cooldown_s
                log.warning("engine %s failed a call (%r) but answers /server_info; skipped for %.0fs", url,
                            last_error, self.cooldown_s)
        raise EngineUnavailable(f"no engine could serve request {rid}: {last_error!r}")

    async def _alive(self, url: str) -> bool | None:
        """GET /server_info within health_timeout_s: True if it answers 200, None if no answer came in time (hung, or
        slow), False if it failed (dead). Not /health: SGLang's runs a generation, which a paused engine (mid weight
        sync, or memory released) answers with a 503 only after 20 s; /server_info its scheduler answers between two
        steps, paused or not."""
        try:
            r = await self.http.get(f"{url}/server_info", timeout=self.health_timeout_s)
            return r.status_code == 200
        except httpx.TimeoutException:
            return None
        except (httpx.HTTPError, OSError):
            return False

    def mark_dead(self, url: str, why: str) -> None:
        """Take an engine out of routing now; the requests waiting on it fail over to the other engines."""
        if url in self.dead or url not in self.inflight:
            return
        self.dead.add(url)
        log.warning("engine %s is out of routing: %s", url, why)
        error = EngineUnavailable(f"engine {url} left routing: {why}")
        for key in [k for k in self._pending if k[0] == url]:
            self._fail(self._pending.pop(key), error)
        for fut in list(self._sent.pop(url, ())):
            if not fut.done():
                fut.set_exception(error)

    def replace(self, old: str, new: str) -> None:
        """The engine at `old` was re-created at `new` (same slot, current weights): it rejoins routing."""
        new = new.rstrip("/")
        i = self.urls.index(old)
        self.mark_dead(old, "replaced")
        self.urls[i] = new
        self.inflight.setdefault(new, 0)
        self.down_until[new] = 0.0
        self.dead.discard(new)

    async def check(self) -> list[str]:
        """Probe every engine in routing now; return the URLs of every engine out of routing for good."""
        live = [u for u in self.urls if u not in self.dead]
        for url, ok in zip(live, await asyncio.gather(*(self._alive(u) for u in live))):
            self.silent[url] = self.silent[url] + 1 if ok is None else 0
            if ok is False or self.silent[url] > 1:
                self.mark_dead(url, "/server_info failed: the engine is dead" if ok is False else "no /server_info "
                               f"within {self.health_timeout_s:.0f}s (cfg.engine_health_timeout) twice in a row: hung")
        return [u for u in self.urls if u in self.dead]

    async def _watch(self) -> None:
        """Probe the engines every check_every_s while requests are in flight: a hung engine fails no call
        (its connection stays open), so only a probe finds it and frees the requests stuck on it."""
        while True:
            await asyncio.sleep(self.check_every_s)
            if self.running:
                await self.check()

    async def _coalesced(self, url: str, input_ids: list[int], sampling_params: dict, rid: str,
                         batch: str = "", lora_path: str | None = None) -> dict:
        """Requests for one engine made in the same event-loop tick with the same `batch` key travel as ONE
        batched /generate (SGLang takes lists of input_ids, sampling_params and rids). A step starts hundreds
        of trajectories at once; sent one by one, they would spend most of their time in the HTTP client's
        connection pool (quadratic in open connections) rather than in the engine. A batched /generate
        answers when its LAST request ends, so AgentFlow keys by prompt group: a group is complete only
        when all its samples are anyway, and one group's long tail then never holds back another's."""
        fut = asyncio.get_running_loop().create_future()
        pending = self._pending.setdefault((url, batch), [])
        pending.append((input_ids, sampling_params, rid, lora_path, fut))
        if len(pending) == 1:  # the first of this tick schedules the send, after everyone else has queued
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._send_batch(url, batch)))
        return await self._awaited(url, fut)

    async def _awaited(self, url: str, fut: asyncio.Future) -> dict:
        """`fut`'s answer, the future listed as sent to `url` meanwhile (mark_dead fails what it lists over)."""
        sent = self._sent.setdefault(url, set())
        sent.add(fut)
        try:
            return await fut
        finally:
            sent.discard(fut)

    async def _streamed(self, url: str, input_ids: list[int], sampling_params: dict, rid: str,
                        lora_path: str | None, on_chunk) -> dict:
        """One streamed /generate, failed over like a batched one: `mark_dead` fails its future, which ends the
        stream (the engine aborts a request whose stream is closed)."""
        fut = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(generate_stream(
            self.http, url, input_ids, sampling_params, on_chunk=on_chunk, rid=rid,
            return_routed_experts=self.return_routed_experts, lora_path=lora_path))

        def settle(t: asyncio.Task) -> None:
            if fut.done():
                return
            if t.cancelled():
                fut.cancel()
            elif t.exception() is not None:
                fut.set_exception(t.exception())
            else:
                fut.set_result(t.result())
        task.add_done_callback(settle)
        try:
            return await self._awaited(url, fut)
        finally:
            task.cancel()

    async def _send_batch(self, url: str, key: str) -> None:
        batch = self._pending.pop((url, key), [])
        if not batch:  # mark_dead() already failed them over
            return
        try:
            loras = [b[3] for b in batch]
            out = await generate(self.http, url, [b[0] for b in batch], [b[1] for b in batch],
                                 rid=[b[2] for b in batch], return_routed_experts=self.return_routed_experts,
                                 lora_path=loras if any(loras) else None)
            for (*_, fut), answer in zip(batch, out):
                if not fut.done():
                    fut.set_result(answer)
        except EngineError as e:
            if len(batch) > 1 and (http_status(e) or 500) < 500:
                # the engine refused the batch for one bad request: resend one by one, so only it fails
                await asyncio.gather(*(self._send_one(url, b) for b in batch))
            else:
                self._fail(batch, e)
        except BaseException as e:
            # every waiter sees the transport's error, cancellation included: a future never resolved would hang
            # its trajectory until agent_timeout
            self._fail(batch, e)

    async def _send_one(self, url: str, item) -> None:
        input_ids, sampling_params, rid, lora_path, fut = item
        try:
            answer = await generate(self.http, url, input_ids, sampling_params, rid=rid,
                                    return_routed_experts=self.return_routed_experts, lora_path=lora_path)
            if not fut.done():
                fut.set_result(answer)
        except BaseException as e:
            self._fail([item], e)

    @staticmethod
    def _fail(batch, error: BaseException) -> None:
        for *_, fut in batch:
            if not fut.done():
                fut.set_exception(error)

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (rid) or every request of this pool (rid=None) on its engine. By rid, not
        abort_all: other clients of the same engines (an eval, a second AgentFlow) keep their requests."""
        rids = [rid] if rid is not None else list(self.running)
        await asyncio.gather(*(self.http.post(f"{self.running[r]}/abort_request", json={"rid": r})
                               for r in rids if r in self.running), return_exceptions=True)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None


# ----------------------------------------------------------------------------------------------
# launching engines


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
    # each trajectory's sampling_seed (agentflow.sampling_seed) is honoured only in this mode (batch-invariant
    # kernels: slower; null trades reproducible trajectories for throughput)
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


def server_flags(opts: dict) -> list[str]:
    """Every key of `opts` as a `--key value` flag (underscores become dashes, True is a bare flag, False and null
    are left out, lists give several values, a dict goes as JSON)."""
    cmd = []
    for key, value in opts.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif isinstance(value, (list, tuple)):
            cmd += [flag, *map(str, value)]
        elif value is not False and value is not None:
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return cmd


def sglang_command(cfg, host: str, port: int, seed: int) -> list[str]:
    """`python -m sglang.launch_server ...` with every key of `sglang_options` passed through as a flag."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path,
            "--host", host, "--port", str(port), *server_flags(sglang_options(cfg, seed))]


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
        self.handle = None  # the CPU engine's in-process server (cpu_engine.ServerHandle)
        host = _serve_host()
        seed = int(cfg.seed) + 1000 * rank  # different engines draw different samples
        engine = cfg.engine if cfg.engine != "auto" else ("sglang" if torch.cuda.is_available() else "cpu")
        if engine == "cpu":
            import cpu_engine  # late: the contract does not depend on its stand-in; only a CPU engine's start needs it
            if cfg.engine_threads > 0:  # see Config.engine_threads: sync uses every core
                torch.set_num_threads(int(cfg.engine_threads))
            max_len = max(int(cfg.max_prompt_len) + int(cfg.max_new_tokens), int(cfg.max_context_len or 0))
            flags = sglang_options(cfg, seed)  # the SGLang flags the CPU engine implements, as SGLang would get them
            self._url, self.handle = cpu_engine.serve(
                cfg.model_path, host=host, max_batch=int(cfg.engine_max_batch), max_len=max_len, seed=seed,
                dtype=cfg.dtype, fp32_lm_head=bool(cfg.fp32_lm_head), rank=rank,
                busy_flag=(busy_file, rank) if busy_file else None,
                enable_deterministic_inference=bool(flags.get("enable_deterministic_inference")),
                disable_radix_cache=bool(flags.get("disable_radix_cache")),
                lora=dict(max_lora_rank=cfg.lora_rank, lora_target_modules=list(cfg.lora_targets)) if cfg.lora_rank
                else None)
        elif engine in ("sglang", "vllm"):
            if engine == "sglang" and not torch.cuda.is_available():
                raise RuntimeError("engine=sglang needs CUDA, and none is visible to this actor; use engine=cpu "
                                   "or give the rollout actors GPUs")
            port = transfermesh.free_port(host)
            self._url = f"http://{host}:{port}"
            log_dir = Path(cfg.output_dir or tempfile.gettempdir())
            log_dir.mkdir(parents=True, exist_ok=True)
            self.log_path = str(log_dir / f"{engine}_engine_{rank}.log")
            if engine == "vllm":  # vllm_engine.py: its own venv; a front serves SGLang's endpoints over it
                import vllm_engine
                cmd, env = vllm_engine.vllm_command(cfg, host, port)
                cmd += server_flags(vllm_engine.vllm_options(cfg, seed))
            else:  # raw (temperature-1) logprobs, the same quantity the CPU engine and the trainer compute
                cmd = sglang_command(cfg, host, port, seed)
                env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "True", **os.environ}
            with open(self.log_path, "a") as log:  # "a": a re-created engine keeps its predecessor's log
                log.write(" ".join(cmd) + "\n")
                log.flush()
                if gpu_ids:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
                # own session: shutdown() kills the server and every process it spawned (schedulers, detokenizer)
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True, preexec_fn=_die_with_parent)
            try:
                wait_healthy(self._url, SGLANG_STARTUP_TIMEOUT_S, self.proc, self.log_path)
                if engine == "vllm":  # versions count trainer steps (vLLM starts at "default")
                    post(self._url, "/update_weight_version", {"new_version": "0"})
                    self._url, self.handle = vllm_engine.serve_front(self._url, cfg.model_path, host)
            except BaseException:
                self.shutdown()
                raise
        elif data.is_dotted(engine):  # EXT: a user's engine, fn(cfg, rank, host, seed) -> (url, handle), serving
            #                           SGLang's HTTP contract; handle.shutdown() stops it
            self._url, self.handle = data.import_object(engine)(cfg, rank=rank, host=host, seed=seed)
        else:
            raise ValueError(f"cfg.engine must be 'auto', 'cpu', 'sglang', 'vllm' or a dotted path 'module.function', "
                             f"got {cfg.engine!r}")

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
