"""The conformance tier: what LoongSage sends to an engine, checked against SGLang 0.5.23's own code instead of our
reading of it. Runs in .venv-sglang (scripts/conformance_env.sh builds it: SGLang's pure-Python parts on a CPU torch):
  scripts/conformance_env.sh && .venv-sglang/bin/python -m pytest -q tests/test_sglang_conformance.py
`.ci/run` runs it so (LOONGSAGE_CONFORMANCE=1: a missing sglang fails the tier); in the main .venv it is skipped.

What it proves:
* every request body the project really sends (recorded at httpx while transfermesh pushes by shm, broadcast and
  disk, the colocated hand-off releases and resumes memory, and the router generates, streams and aborts through
  AgentFlow)
  validates against the request type SGLang's route declares for it, and carries no field SGLang would silently
  ignore except LoongSage's `checksum`; every (method, path) is a route of SGLang's app;
* the weights TransferMesh pushes arrive through SGLang's real app, tokenizer manager, IPC encoding, session rules,
  payload deserializer / FlattenedTensorBucket / process-group rendezvous (tests/sglang_app.py) with the pushed
  names, dtypes and bytes, and the version set;
* SGLang's own flattened_bucket payload loads in the CPU engine, and what SGLang's app refuses the CPU engine refuses;
* the LoRA adapter transfermesh pushes (/load_lora_adapter_from_tensors) is what SGLang's TP worker reads into
  the pushed tensors, and the {name: tensor} payload SGLang's own Engine sends loads in the CPU engine;
* the router's tool-call parser gives SGLang's hermes parser's calls and content on each probe text;
* json_schema / regex / ebnf: the CPU engine refuses the grammars SGLang's xgrammar backend refuses, with its message,
  and masks the same tokens at each step of the valid ones; the router's structured-output /generate body (the
  schema in `json_schema`) is a valid SGLang body.
"""
import asyncio
import dataclasses
import hashlib
import inspect
import json
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import httpx
import pytest
import torch

if os.environ.get("LOONGSAGE_CONFORMANCE") != "1":
    try:
        import sglang  # noqa: F401
    except ImportError:
        pytest.skip("the conformance tier runs in .venv-sglang: scripts/conformance_env.sh && .venv-sglang/bin/python "
                    "-m pytest -q tests/test_sglang_conformance.py", allow_module_level=True)

import agentflow  # noqa: E402
import chat  # noqa: E402
import config  # noqa: E402
import cpu_engine  # noqa: E402
import cpu_model  # noqa: E402
import data  # noqa: E402
import fleet  # noqa: E402
import rollout  # noqa: E402
import transfermesh as tm  # noqa: E402
import wire  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOONGSAGE_FIELDS = {"checksum"}  # what LoongSage adds to SGLang's bodies (SGLang ignores unknown fields)


class Recorder:
    """Every request the project sends through httpx, sync or async: (method, path, JSON body or None)."""

    def __init__(self, monkeypatch):
        self.sent = []
        for cls, name in ((httpx.Client, "send"), (httpx.AsyncClient, "send")):
            real = getattr(cls, name)
            monkeypatch.setattr(cls, name, self._wrap(real, inspect.iscoroutinefunction(real)))

    def _note(self, request):
        body = json.loads(request.content) if request.content else None
        self.sent.append((request.method, request.url.path, body))

    def _wrap(self, real, is_async):
        if is_async:
            async def send(client, request, **kw):
                self._note(request)
                return await real(client, request, **kw)
        else:
            def send(client, request, **kw):
                self._note(request)
                return real(client, request, **kw)
        return send


def _start_app(model_dir):
    """tests/sglang_app.py started, once it answers: (process, url)."""
    port = tm.free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/sglang_app.py"), "--model-path", model_dir,
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, "tests/sglang_app.py exited at start: run it by hand to see why"
        try:
            httpx.get(url + "/conformance/loaded", timeout=5).raise_for_status()
            return proc, url
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "SGLang's app did not come up within 300 s"
            time.sleep(1)


@pytest.fixture(scope="module")
def sglang_server(tiny_model_dir):
    """SGLang's app with the scheduler link and model faked, in a process of its own (tests/sglang_app.py)."""
    proc, url = _start_app(tiny_model_dir)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:  # a request still held by the faked scheduler link keeps uvicorn waiting
        proc.kill()
        proc.wait(timeout=20)


def _loaded(url):
    return httpx.get(url + "/conformance/loaded", timeout=30).json()


def _digest(t):
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


RECORDED = []  # (method, path, body) the project sent in the flows below, for the body and route checks


@pytest.mark.parametrize("transport", ["shm", "broadcast", "disk"])
def test_pushed_weights_arrive_through_sglangs_app(transport, sglang_server, tiny_model_dir, monkeypatch):
    """push_weights (pause in place, begin, buckets, end, continue) into SGLang's own server code: every bucket is
    accepted, the model receives exactly the pushed names, dtypes and bytes, bf16 included, and the served weight
    version is the pushed one."""
    from safetensors.torch import load_file
    rec = Recorder(monkeypatch)
    torch.manual_seed(len(transport))
    new = sorted((n, torch.randn_like(t)) for n, t in load_file(f"{tiny_model_dir}/model.safetensors").items())
    new[0] = (new[0][0], new[0][1].bfloat16().float())  # values a bf16 trip would not change: the dtype is checked
    before = len(_loaded(sglang_server)["loads"])
    tm.pause_engines([sglang_server])
    stats = tm.push_weights(new, [sglang_server], version=11, transport=transport, bucket_mb=0.05,
                            config_dir=tiny_model_dir)
    tm.continue_engines([sglang_server])
    got = _loaded(sglang_server)
    loads = got["loads"][before:]
    # disk: one shard written per bucket, one /update_weights_from_disk loading the directory
    assert len(loads) == (1 if transport == "disk" else stats["weights/buckets"]) and got["pauses"][-1] == "in_place"
    arrived = {name: (dtype, shape, sha) for load in loads for name, dtype, shape, sha in load}
    assert arrived == {n: ("float32", list(t.shape), _digest(t)) for n, t in new}
    assert rollout.get(sglang_server, "/model_info")["weight_version"] == "11"
    RECORDED.extend(rec.sent)


def test_a_sync_without_tensors_sets_the_version(sglang_server, monkeypatch):
    rec = Recorder(monkeypatch)
    tm.push_weights([], [sglang_server], version=12, transport="shm")
    assert rollout.get(sglang_server, "/model_info")["weight_version"] == "12"
    RECORDED.extend(rec.sent)


def test_the_colocated_hand_off_through_sglangs_app(sglang_server, tiny_model_dir, monkeypatch):
    """The controller's hand-off (fleet.colocate_hand_off, its three stages) against SGLang's app: retract pause,
    release both tags, resume weights, resume KV cache, continue, each accepted by SGLang's scheduler-side manager
    (which raises on resuming a tag it did not release). The trainers are Ray tasks standing in for the trainer
    actors: the part under test is what the controller sends to the engines."""
    import ray
    rec = Recorder(monkeypatch)
    cfg = config.load_config(None, [f"model_path={tiny_model_dir}", "colocate=true"])
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote
        def mem(gpu_mb=1):
            return {"rss_bytes": tm.rss_bytes(), "gpu_used_bytes": gpu_mb * 2**20}
        trainers = [type("Trainer", (), {"onload": type("M", (), {"remote": staticmethod(mem.remote)}),
                                         "offload": type("M", (), {"remote": staticmethod(lambda tags: mem.remote())}),
                                         "memory": type("M", (), {"remote": staticmethod(lambda: mem.remote(2))})})]
        fl = fleet.Fleet(pg=None, plan={}, where=[], urls=[sglang_server], released=[set()])
        for stage in ("train", "sync", "rollout"):
            out = fleet.colocate_hand_off(cfg, fl, None, trainers, stage)
            # the device is read once the stage is done on both sides (rollout: after the KV cache is resumed), not
            # in the trainers' own half of it
            assert out[f"memory/{stage}_gpu_used_mb"] == 2, out
    finally:
        ray.shutdown()
    paths = [p for _, p, _ in rec.sent]
    # each stage ends with a liveness probe, /server_info: what a paused SGLang answers at once (/health would wait)
    assert paths == ["/pause_generation", "/release_memory_occupation", "/server_info", "/resume_memory_occupation",
                     "/server_info", "/resume_memory_occupation", "/continue_generation", "/server_info"]
    assert _loaded(sglang_server)["pauses"][-1] == "retract"
    RECORDED.extend(rec.sent)


def test_the_syncs_flush_retries_while_sglang_compiles_a_grammar(sglang_server, tiny_model_dir, monkeypatch):
    """fleet.update_engines (retract pause, push, /flush_cache, continue) against SGLang's app: the flush is SGLang's
    flush wrapper's 200; while a grammar compiles (SGLang's scheduler is then not idle, paused or not) its 400 is
    retried until the grammar is done, and one that outlasts weight_sync_timeout fails the sync naming that knob,
    in about that time. The stats probe (fleet.engine_states) reads SGLang's /server_info."""
    rec = Recorder(monkeypatch)
    fl = fleet.Fleet(pg=None, plan={}, where=[], urls=[sglang_server], released=[set()])
    sync = lambda timeout: fleet.update_engines(  # noqa: E731
        config.load_config(None, [f"model_path={tiny_model_dir}", f"weight_sync_timeout={timeout}"]), fl,
        [sglang_server], lambda: tm.push_weights([], [sglang_server], version=13, transport="shm"))
    sync(60)
    assert [p for _, p, _ in rec.sent].count("/flush_cache") == 1
    assert fleet.engine_states([sglang_server])[0]["model_path"] == tiny_model_dir
    httpx.post(sglang_server + "/conformance/compile", json={"seconds": 1.5}, timeout=30)
    t0 = time.monotonic()
    sync(60)
    assert time.monotonic() - t0 >= 1.4 and [p for _, p, _ in rec.sent].count("/flush_cache") > 2
    httpx.post(sglang_server + "/conformance/compile", json={"seconds": 300}, timeout=30)
    t0 = time.monotonic()
    try:
        with pytest.raises(rollout.EngineError, match="answered HTTP 400.*weight_sync_timeout=2"):
            sync(2)
    finally:
        httpx.post(sglang_server + "/conformance/compile", json={"seconds": 0}, timeout=30)
    assert 2 <= time.monotonic() - t0 < 30
    assert _loaded(sglang_server)["pauses"][-1] == "retract"
    RECORDED.extend(rec.sent)


def test_a_bad_resume_ends_sglangs_server_as_its_scheduler_does(tiny_model_dir):
    """/resume_memory_occupation of a tag never released: SGLang's scheduler raises (offload_tags.remove) and
    SIGQUITs its launcher, which ends the server; the harness does the same, so the request fails at once."""
    proc, url = _start_app(tiny_model_dir)
    try:
        with pytest.raises(httpx.HTTPError):
            httpx.post(url + "/resume_memory_occupation", json={"tags": ["weights"]}, timeout=60)
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()


@pytest.mark.parametrize("broken", [False, True])
def test_gpu_checks_sglang_part_runs_sglangs_receiver(broken, tmp_path, monkeypatch):
    """scripts/gpu_check.py --dry-run --part sglang, reading SGLang's receiver from its source files as on the lent
    GPU machine: the pushed weights arrive bit for bit through SGLang's SafeUnpickler; its control (one bit flipped)
    FAILs the part at its check."""
    import sglang
    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path))
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry-run", "--part", "sglang",
                        "--sglang-src", str(Path(sglang.__file__).parents[1])] + (["--break", "sglang"] * broken),
                       capture_output=True, text=True, timeout=900)
    line = next((x for x in r.stdout.splitlines() if x.startswith(("PASS", "FAIL", "SKIP"))), r.stdout + r.stderr)
    if broken:
        assert r.returncode == 1 and line.startswith("FAIL (dry run) sglang") and "AssertionError" in line, line
    else:
        assert r.returncode == 0 and line.startswith("PASS (dry run) sglang") and "SGLang's definitions" in line, line


def test_the_router_generates_and_aborts(tiny_model_dir, monkeypatch):
    """AgentFlow's router against a CPU engine, recorded: /generate bodies of a finished group and /abort_request
    of an aborted one (checked against SGLang below)."""
    rec = Recorder(monkeypatch)
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=8, max_len=256, seed=0)
    cfg = config.load_config(None, [f"model_path={tiny_model_dir}", "mode=async", "prompts_per_step=2",
                                    "samples_per_prompt=2", "global_batch_size=4", "micro_batch_size=4"])

    async def body():
        flow = agentflow.AgentFlow(cfg, [url], tiny_model_dir)
        sample = {"messages": [{"role": "user", "content": "1+2"}], "answer": "3"}
        await flow.submit([(0, sample)], 2, dict(temperature=1.0, max_new_tokens=8), 0)
        done = await flow.completed()
        await flow.submit([(1, sample)], 2, dict(temperature=1.0, max_new_tokens=200, ignore_eos=True), 0)
        while handle.engine.state()["generated_tokens"] < 20:
            await asyncio.sleep(0.01)
        await flow.abort()
        # a streamed turn's /generate (the router's stream=true path), one prompt with SGLang's stream field
        chunks = []
        _, answer = await flow.pool.generate([5, 6, 7], dict(temperature=0.0, max_new_tokens=6), "stream-probe",
                                             on_chunk=chunks.append)
        assert answer["meta_info"]["finish_reason"] is not None and all(c["output_ids"] for c in chunks)
        # structured output's /generate: the schema as SGLang's json_schema sampling param (a JSON string)
        _, answer = await flow.pool.generate([5, 6, 7], dict(temperature=0.0, max_new_tokens=6,
                                                             json_schema='{"type": "object"}'), "grammar-probe")
        assert answer["meta_info"]["finish_reason"] is not None
        # a forced tool call's /generate: the template's call syntax as SGLang's structural_tag (a JSON string)
        tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
        tag = flow.chat.tool_grammar(wire.ChatRequest([], tools, True, None, {}, None, False, forced=("calc",)), {})
        _, answer = await flow.pool.generate([5, 6, 7], dict(temperature=0.0, max_new_tokens=6, **tag), "tag-probe")
        assert answer["meta_info"]["finish_reason"] is not None
        await flow.close()
        return done
    try:
        done = asyncio.run(body())
    finally:
        handle.shutdown()
    assert len(done) == 1 and len(done[0]["trajs"]) == 2
    paths = {p for _, p, _ in rec.sent}
    assert {"/generate", "/abort_request"} <= paths, paths
    assert any(p == "/generate" and b.get("stream") is True for _, p, b in rec.sent)
    sent_params = [sp for _, p, b in rec.sent if p == "/generate" for sp in (
        b["sampling_params"] if isinstance(b["sampling_params"], list) else [b["sampling_params"]])]  # batched or not
    assert any("json_schema" in sp for sp in sent_params) and any("structural_tag" in sp for sp in sent_params)
    RECORDED.extend(rec.sent)


def test_a_pushed_adapter_is_what_sglangs_lora_loader_reads(tiny_model_dir, monkeypatch):
    """push_adapter's /load_lora_adapter_from_tensors body (recorded at httpx, shm transport) is read by SGLang's own
    code as its TP worker reads it (MultiprocessingSerializer through the SafeUnpickler, then FlattenedTensorBucket
    for load_format flattened_bucket) into exactly the pushed {PEFT name: tensor}; SGLang's checksum check
    (expected_checksums, sha256 per tensor) would pass on them; and the dict SGLang's own Engine serializes for
    load_format null loads in the CPU engine as the same adapter. The body joins the route / body-type check below."""
    import lora
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    hf = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    H, d = hf["hidden_size"], hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    torch.manual_seed(0)
    adapters = {lora.peft_name(0, "q_proj", "A"): torch.randn(4, H) * 0.1,
                lora.peft_name(0, "q_proj", "B"): torch.randn(hf["num_attention_heads"] * d, 4) * 0.05}
    peft_cfg = {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"]}
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=2, max_len=64,
                                   lora=dict(max_lora_rank=4, lora_target_modules=["q_proj"]))
    try:
        rec = Recorder(monkeypatch)
        tm.push_adapter(adapters, peft_cfg, [url], version=3, name="pushed", transport="shm")
        [body] = [b for _, p, b in rec.sent if p == "/load_lora_adapter_from_tensors"]
        assert body["lora_name"] == "pushed" and body["config_dict"] == peft_cfg and body["load_format"] == \
            "flattened_bucket"
        data_ = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])  # tp_worker's read
        got = dict(FlattenedTensorBucket(flattened_tensor=data_["flattened_tensor"],
                                         metadata=data_["metadata"]).reconstruct_tensors())
        assert got.keys() == adapters.keys() and all(torch.equal(got[n], t) for n, t in adapters.items())
        # SGLang's own checksum field is sent, and its values are what SGLang's TP worker computes on what it read
        assert body["expected_checksums"] == {n: _digest(t) for n, t in got.items()} == \
            {n: _digest(t) for n, t in adapters.items()}
        with tm._file_system_sharing():  # SGLang's Engine.load_lora_adapter_from_tensors, load_format null
            shared = {n: t.clone().share_memory_() for n, t in adapters.items()}
            entry = MultiprocessingSerializer.serialize(shared, output_str=True)
        r = httpx.post(url + "/load_lora_adapter_from_tensors", json={
            "lora_name": "sglang-dict", "config_dict": peft_cfg, "serialized_named_tensors": [entry],
            "expected_checksums": {n: _digest(t) for n, t in adapters.items()}}, timeout=60)
        assert r.status_code == 200 and r.json()["success"], r.text
        lps = [httpx.post(url + "/generate", json={"input_ids": [5, 6, 7], "lora_path": name, "return_logprob": True,
                                                   "sampling_params": {"temperature": 0.0, "max_new_tokens": 4}},
                          timeout=60).json()["meta_info"]["output_token_logprobs"] for name in ("pushed", "sglang-dict")]
        assert lps[0] == lps[1]
        RECORDED.extend(rec.sent)
    finally:
        handle.shutdown()


def _route(app, method, path):
    from starlette.routing import Match
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    partial = None
    for route in app.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route
        if match == Match.PARTIAL:
            partial = route
    return partial and None


def _body_type(route):
    """The request type an SGLang route declares for its JSON body (`obj: Annotated[T, Body()]` or `obj: T`)."""
    hints = typing.get_type_hints(route.endpoint, include_extras=True)
    t = hints.get("obj")
    return typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t


def _fields(t) -> set[str]:
    if dataclasses.is_dataclass(t):
        return {f.name for f in dataclasses.fields(t)}
    return set(getattr(t, "__struct_fields__", ()))


def test_every_recorded_request_is_a_route_and_a_valid_body_of_sglang():
    """Each request the flows above sent: SGLang's app has the route with that method; its body validates against
    the type the route declares (the pydantic schema FastAPI applies, SGLang's /generate contract check on top), and
    any field SGLang does not know is a LoongSage field."""
    import pydantic
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.entrypoints.http_server import app
    assert RECORDED, "the recording flows above did not run"
    seen = set()
    for method, path, body in RECORDED:
        if path.startswith("/conformance/"):
            continue  # the harness's own inspection route
        route = _route(app, method, path)
        assert route is not None, f"{method} {path}: not a route of SGLang 0.5.23's app"
        seen.add((method, path))
        t = _body_type(route)
        if t is None:
            assert not body, f"{method} {path} sends a body, the route takes none"
            continue
        pydantic.TypeAdapter(t).validate_python(body)
        unknown = set(body) - _fields(t)
        assert unknown <= LOONGSAGE_FIELDS, f"{path}: SGLang ignores {sorted(unknown - LOONGSAGE_FIELDS)}"
        if path == "/generate":
            assert generate_contract_error(body) is None, (generate_contract_error(body), body)
    assert {("POST", "/generate"), ("POST", "/abort_request"), ("POST", "/begin_weight_update"),
            ("POST", "/update_weights_from_tensor"), ("POST", "/update_weights_from_distributed"),
            ("POST", "/init_weights_update_group"), ("POST", "/update_weights_from_disk"),
            ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"),
            ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/end_weight_update"),
            ("POST", "/update_weight_version")} <= seen, seen


def test_every_endpoint_the_code_names_is_an_sglang_route():
    """The endpoints named in the modules that talk to engines (including paths the flows above do not reach,
    e.g. health probes and the stats poll) are routes of SGLang's app with the method the code uses."""
    import re
    from sglang.srt.entrypoints.http_server import app
    used = set()
    for f in ("transfermesh.py", "fleet.py", "rollout.py", "agentflow.py", "loongsage.py"):
        src = (ROOT / f).read_text()
        used |= {("GET", p) for p in re.findall(r'(?:rollout\.get|httpx\.get|http\.get|_STATS_HTTP\.get)\([^)]*?'
                                                r'"?(/[a-z_]+)"', src)}
        used |= {("POST", p) for p in re.findall(r'(?:_post|rollout\.post|engines)\([^)]*?"(/[a-z_]+)"', src)}
        used |= {("POST", p) for p in re.findall(r'\.post\(f"\{[^}]+\}(/[a-z_]+)"', src)}
        used |= {("GET", p) for p in re.findall(r'\.get\(f"\{[^}]+\}(/[a-z_]+)"', src)}
    assert {("GET", "/health"), ("POST", "/generate"), ("GET", "/server_info")} <= used, used
    missing = [(m, p) for m, p in sorted(used) if _route(app, m, p) is None]
    assert not missing, f"not routes of SGLang 0.5.23 with that method: {missing}"


def test_sglangs_own_payload_loads_in_the_cpu_engine():
    """A flattened_bucket payload built by SGLang's own code (FlattenedTensorBucket, MultiprocessingSerializer,
    its FlattenedTensorMetadata class) is what the CPU engine's reader takes; and transfermesh's payload is what
    SGLang's SafeUnpickler and FlattenedTensorBucket take."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    named = [("w", torch.randn(3, 4)), ("i", torch.arange(6, dtype=torch.int32)), ("b", torch.randn(5).bfloat16())]
    with tm._file_system_sharing():
        bucket = FlattenedTensorBucket(named_tensors=named)
        bucket.get_flattened_tensor().share_memory_()
        payload = MultiprocessingSerializer.serialize({"flattened_tensor": bucket.get_flattened_tensor(),
                                                       "metadata": bucket.get_metadata()}, output_str=True)
    got = tm.read_tensor_payload(payload, "flattened_bucket", tm.checksum(bucket.get_flattened_tensor()))
    assert [(n, t.dtype, t.shape) for n, t in got] == [(n, t.dtype, t.shape) for n, t in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, named))
    flat, metas, _ = tm.write_shm_bucket(named)
    ours = MultiprocessingSerializer.deserialize(tm.tensor_payloads(flat, metas, 1)[0])
    back = FlattenedTensorBucket(flattened_tensor=ours["flattened_tensor"], metadata=ours["metadata"])
    assert all(n == m and torch.equal(a, b) for (n, a), (m, b) in zip(back.reconstruct_tensors(), named))


def test_what_sglang_refuses_the_cpu_engine_refuses(sglang_server, tiny_model_dir):
    """The same requests to SGLang's app and to the CPU engine get the same refusal: a tensor update outside a
    begin/end session (400, SGLang's message word for word), and the JSON shared-memory descriptor of earlier
    LoongSage versions (400: not base64)."""
    flat, metas, sums = tm.write_shm_bucket([("model.norm.weight", torch.ones(128))])
    good = {"serialized_named_tensors": tm.tensor_payloads(flat, metas, 1), "load_format": "flattened_bucket",
            "flush_cache": False}
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=2, max_len=64, seed=0)
    try:
        answers = []
        for engine in (sglang_server, url):
            outside = httpx.post(engine + "/update_weights_from_tensor", json=good, timeout=60)
            rollout.post(engine, "/begin_weight_update", {"selector": "all"})
            desc = httpx.post(engine + "/update_weights_from_tensor", json={
                **good, "serialized_named_tensors": [json.dumps({"shm": "x", "size": 4, "tensors": []})]}, timeout=60)
            rollout.post(engine, "/end_weight_update", {})
            answers.append((outside.status_code, outside.json()["message"], desc.status_code))
            assert "base64" in desc.text, desc.text
    finally:
        handle.shutdown()
    assert answers[0] == answers[1] == (400, "update_weights_from_tensor must run between begin_weight_update() and "
                                             "end_weight_update()", 400), answers


# Grammar probes: (kind, source) as sampling_params carry them, compiled by SGLang's xgrammar backend and by the CPU
# engine: valid ones, and each way SGLang refuses one (malformed, unknown type, a keyword or format xgrammar would
# ignore, two string constraints at once, a NUL, a bad regex, a bad EBNF)
GRAMMARS = [
    ("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "tags": {
        "type": "array", "items": {"type": "string", "enum": ["a", "b"]}}}, "required": ["n"]})),
    ("json_schema", '{"type": "string", "format": "date"}'),
    ("json_schema", "{"),
    ("json_schema", '{"type": "nope"}'),
    ("json_schema", '{"type": "array", "items": {"type": "integer", "multipleOf": 3}}'),
    ("json_schema", '{"type": "string", "format": "color"}'),
    ("json_schema", '{"type": "string", "pattern": "a+", "maxLength": 3}'),
    ("json_schema", '{"type": "string", "pattern": "a\\u0000"}'),
    ("regex", "[0-9]{2,4}-(yes|no)"),
    ("regex", "(["),
    ("ebnf", 'root ::= "go " dir\ndir ::= "left" | "right"'),
    ("ebnf", "root ::= "),
]


def test_the_cpu_engine_compiles_and_masks_grammars_as_sglangs_xgrammar_backend(tiny_model_dir):
    """Each probe grammar: SGLang's xgrammar backend (constrained/xgrammar_backend.py, with the message its grammar
    manager answers a failure with: "Failed to compile {json|regex|ebnf} grammar: ...") and the CPU engine refuse the
    same ones with the same message (xgrammar's time stamp aside); for the valid ones, the tokens each allows are the
    same at every step of a walk through the grammar (first allowed token each time)."""
    import re
    from transformers import AutoTokenizer
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    engine = cpu_engine.CpuEngine(tiny_model_dir, max_batch=2, max_len=64)  # not started: make_request only
    V = engine.runner.vocab_size
    backend = XGrammarGrammarBackend(AutoTokenizer.from_pretrained(tiny_model_dir), vocab_size=V,
                                     model_eos_token_ids=sorted(engine.runner.eos_ids))
    stamp = re.compile(r"\[\d\d:\d\d:\d\d\] ")
    valid = 0
    # the structural tags the router sends (chat.ChatFormat.tool_grammar: the template's call syntax, a strict
    # tool's schema) for tool_choice "required" and for "auto", SGLang's legacy form, and one that is not JSON
    fmt = chat.ChatFormat(tiny_model_dir)
    strict = {"name": "pick", "parameters": {"type": "object", "properties": {"w": {"enum": ["a", "b"]}}}}
    tools = [{"type": "function", "function": f} for f in (strict, {"name": "calc", "parameters": {"type": "object"}})]
    forced = fmt.tool_grammar(wire.ChatRequest([], tools, True, None, {}, None, False, forced=("pick", "calc"),
                                               strict=frozenset({"pick"})), {})["structural_tag"]
    auto = fmt.tool_grammar(wire.ChatRequest([], tools, True, None, {}, None, False, strict=frozenset({"pick"})),
                            {})["structural_tag"]  # "auto" with a strict tool: text, or calls on its schema
    legacy = json.dumps({"structures": [{"begin": '<tool_call>{"name": "pick", "arguments": ', "end": "}</tool_call>",
                                         "schema": strict["parameters"]}], "triggers": ["<tool_call>"]})
    for key, source in GRAMMARS + [("structural_tag", t) for t in (forced, auto, legacy, "{")]:
        kind = {"json_schema": "json"}.get(key, key)
        theirs = backend._init_value_dispatch((kind, source), False)
        try:
            req = engine.make_request([5, 6, 7], {key: source})
        except cpu_model.BadRequest as e:
            assert isinstance(theirs, InvalidGrammarObject), (key, source, str(e))
            assert stamp.sub("", str(e)) == stamp.sub("", f"Failed to compile {kind} grammar: {theirs.error_message}")
            continue
        assert not isinstance(theirs, InvalidGrammarObject), (key, source, theirs.error_message)
        valid += 1
        for _ in range(12):
            mask = theirs.allocate_vocab_mask(V, 1, "cpu")
            theirs.fill_vocab_mask(mask, 0)
            sglang_logits = torch.zeros(1, V)
            theirs.apply_vocab_mask(sglang_logits, mask)
            ours = cpu_model.mask_by_grammar(torch.zeros(1, V), [req.grammar])
            assert torch.equal(torch.isinf(ours), torch.isinf(sglang_logits)), (key, source)
            tok = int(torch.isfinite(ours[0]).nonzero()[0])
            theirs.accept_token(tok)
            req.grammar.accept_token(tok)
            if req.grammar.is_terminated():
                assert theirs.is_terminated()
                break
    assert valid == 7


# Tool-call probes: the texts a Qwen-style model writes, well-formed and not. (name, text)
PROBES = [
    ("no call", "The answer is 42."),
    ("one call", '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>'),
    ("text before", 'Let me compute.\n<tool_call>{"name": "calc", "arguments": {"expression": "3*4"}}</tool_call>'),
    ("text after", '<tool_call>{"name": "calc", "arguments": {"expression": "5"}}</tool_call>\nDone.'),
    ("two calls", '<tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call>\n'
                  '<tool_call>{"name": "calc", "arguments": {"expression": "2"}}</tool_call>'),
    ("unknown tool", 'Hmm <tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'),
    ("unknown and known", '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
                          '<tool_call>{"name": "calc", "arguments": {"expression": "9"}}</tool_call>'),
    ("bad json", '<tool_call>{"name": "calc", "arguments": {"expression": </tool_call>'),
    ("unclosed", '<tool_call>{"name": "calc", "arguments": {"expression": "7"}}'),
    ("list of calls", '<tool_call>[{"name": "calc", "arguments": {"expression": "1"}}, '
                      '{"name": "calc", "arguments": {"expression": "2"}}]</tool_call>'),
    ("parameters key", '<tool_call>{"name": "calc", "parameters": {"expression": "8"}}</tool_call>'),
    ("no arguments", '<tool_call>{"name": "calc"}</tool_call>'),
    ("no name", 'x <tool_call>{"arguments": {"expression": "1"}}</tool_call>'),
    ("empty block", 'y <tool_call></tool_call>'),
    ("unicode arguments", '<tool_call>{"name": "calc", "arguments": {"expression": "√2 ≈ 1.41"}}</tool_call>'),
    ("stray closing tag", 'answer</tool_call>'),
]
# Where the router departs from SGLang on purpose (chat._calls' docstring says why)
DEPARTURES = [
    ("arguments as a JSON string", '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call>'),
]


def _sglang_parse(text):
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    tools = [Tool(type="function", function=Function(name="calc", parameters={
        "type": "object", "properties": {"expression": {"type": "string"}}}))]
    content, calls = FunctionCallParser(tools, "hermes").parse_non_stream(text)
    return content.strip(), [(c.name, json.loads(c.parameters)) for c in calls]


def _router_parse(text):
    content, calls = chat.parse_tool_calls("hermes", text, [{"type": "function", "function": {"name": "calc"}}])
    return content.strip(), [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("name,text", PROBES, ids=[p[0] for p in PROBES])
def test_the_router_parses_tool_calls_as_sglangs_hermes_parser(name, text):
    """Same text -> same calls (names, arguments) and same content as SGLang's FunctionCallParser("hermes")."""
    assert _router_parse(text) == _sglang_parse(text)


def test_the_routers_departures_from_sglangs_parser_are_the_documented_ones():
    """The one departure: arguments written as a JSON string are decoded by the router (its histories hold objects),
    forwarded as a string by SGLang."""
    (_, text), = DEPARTURES
    assert _sglang_parse(text) == ("", [("calc", '{"expression": "4"}')])
    assert _router_parse(text) == ("", [("calc", {"expression": "4"})])
