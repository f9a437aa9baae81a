"""The CPU engine does what SGLang 0.5.23 does where SGLang refuses, blocks, ignores or dies: one test per row of
cpu_engine.SGLANG_BEHAVIOURS (test_<key>), each against a real CPU engine over HTTP, and a test that the table and
the tests name the same behaviours.

These are the behaviours a GPU run meets first and a friendlier stand-in hides: a paused engine's /health answers
503 20 s late; a resume of a tag never released, or a release while requests run, ends the server; seeds are ignored
without deterministic inference; prefix K/V outlives a weight update that does not flush; group names are unique.
SGLANG_HEALTH_CHECK_TIMEOUT is 2 s here (SGLang's default is 20 s), so a 503 costs 2 s, not 20.
"""
import concurrent.futures
import os
import threading
import time

import httpx
import pytest

import cpu_engine
import rollout
import transfermesh as tm
from test_cpu_engine import engine_logprobs, hf_greedy, hf_greedy_over_cache, hf_logprobs
from test_cpu_engine import hf_a, hf_b, other_dir  # noqa: F401 - fixtures: the tiny model, and it with every weight moved
from test_transfermesh import _EngineProcess

HEALTH_TIMEOUT = 2  # SGLANG_HEALTH_CHECK_TIMEOUT for every engine of this module
PROMPT = [5, 17, 33, 100, 7, 9, 8, 41]
LONG = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def serve_engine(tiny_model_dir):
    """serve(...) with SGLANG_HEALTH_CHECK_TIMEOUT set (read when the app is built, as SGLang reads it on import);
    every engine started is shut down after the module."""
    handles = []

    def start(**opts):
        before = os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT")
        os.environ["SGLANG_HEALTH_CHECK_TIMEOUT"] = str(HEALTH_TIMEOUT)
        try:
            url, handle = cpu_engine.serve(tiny_model_dir, **{"max_batch": 4, "max_len": 512, "seed": 0, **opts})
        finally:
            if before is None:
                del os.environ["SGLANG_HEALTH_CHECK_TIMEOUT"]
            else:
                os.environ["SGLANG_HEALTH_CHECK_TIMEOUT"] = before
        handles.append(handle)
        return url, handle

    yield start
    for handle in handles:
        handle.shutdown()


@pytest.fixture(scope="module")
def server(serve_engine):
    return serve_engine()


def gen(url, input_ids, **sp):
    return rollout.post(url, "/generate", {"input_ids": input_ids, "sampling_params": sp, "return_logprob": True})


def background(fn, *args, **kw):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(fn, *args, **kw)
    pool.shutdown(wait=False)
    return fut


def timed_get(url, path):
    t0 = time.monotonic()
    status = httpx.get(url + path, timeout=60).status_code
    return status, time.monotonic() - t0


def wait_gone(url, handle):
    """Until the server refuses connections (a dead scheduler ends it); returns why the engine died."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/server_info", timeout=5)
        except httpx.TransportError:
            return handle.engine.died
        time.sleep(0.05)
    raise AssertionError(f"{url} still answers after its scheduler died ({handle.engine.died})")


def test_every_behaviour_has_its_test():
    """SGLANG_BEHAVIOURS and this file's tests name the same behaviours, each with the SGLang source it mirrors."""
    tests = {name[len("test_"):] for name in globals() if name.startswith("test_")} - {"every_behaviour_has_its_test"}
    assert tests == set(cpu_engine.SGLANG_BEHAVIOURS)
    assert all(what and where for what, where in cpu_engine.SGLANG_BEHAVIOURS.values())


def test_health_generates(server):
    """/health and /health_generate run a one-token generation: 200 from a serving engine (never before SGLang's
    first one-second look), 503 from a paused one and from a released one, only once the timeout has passed."""
    url, handle = server
    for path in ("/health", "/health_generate"):
        status, took = timed_get(url, path)
        assert status == 200 and took >= 1.0
    rollout.post(url, "/pause_generation", {"mode": "in_place"})
    try:
        for path in ("/health", "/health_generate"):
            status, took = timed_get(url, path)
            assert status == 503 and took >= HEALTH_TIMEOUT
        assert handle.engine.state()["num_waiting_reqs"] == 0  # the probes' requests were dropped, not left queued
        rollout.post(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
        try:
            status, took = timed_get(url, "/health")
            assert status == 503 and took >= HEALTH_TIMEOUT
        finally:
            rollout.post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    finally:
        rollout.post(url, "/continue_generation", {})
    assert timed_get(url, "/health")[0] == 200


@pytest.mark.parametrize("value, at_once", [("false", True), ("0", True), ("No", True), ("maybe", False)])
def test_health_without_generation(server, monkeypatch, value, at_once):
    """SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION read as SGLang's EnvBool: false/0/no (any case) make /health of a
    paused engine answer 200 at once; a value EnvBool cannot read keeps the default (generate: 503 after the
    timeout). /health_generate generates whatever the variable says."""
    url, _ = server
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", value)
    rollout.post(url, "/pause_generation", {"mode": "in_place"})
    try:
        status, took = timed_get(url, "/health")
        if at_once:
            assert status == 200 and took < HEALTH_TIMEOUT
            assert timed_get(url, "/health_generate")[0] == 503
        else:
            assert status == 503 and took >= HEALTH_TIMEOUT
    finally:
        rollout.post(url, "/continue_generation", {})


def test_server_info_while_paused(server):
    """/server_info answers from a paused engine with a request in flight, and from one whose memory is released,
    with that state: the probe the controller uses (fleet.check_engines) reads them as alive."""
    url, handle = server
    fut = background(gen, url, PROMPT, **LONG)
    while not handle.engine.state()["num_running_reqs"]:
        time.sleep(0.01)
    rollout.post(url, "/pause_generation", {"mode": "in_place"})
    try:
        state = rollout.get(url, "/server_info")["internal_states"][0]
        assert state["paused"] is True and state["num_running_reqs"] == 1
        rollout.post(url, "/pause_generation", {"mode": "retract"})  # nothing running: the memory can go
        rollout.post(url, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
        state = rollout.get(url, "/get_server_info")["internal_states"][0]
        assert state["released"] == ["kv_cache", "weights"] and state["num_waiting_reqs"] == 1
    finally:
        rollout.post(url, "/resume_memory_occupation", {"tags": ["weights"]})
        rollout.post(url, "/update_weights_from_disk", {"model_path": handle.engine.model_path})
        rollout.post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        rollout.post(url, "/continue_generation", {})
    assert len(fut.result(timeout=120)["output_ids"]) == LONG["max_new_tokens"]


@pytest.mark.parametrize("released, resumed", [(["kv_cache"], ["weights"]), (["kv_cache", "weights"], None)])
def test_resume_of_an_unreleased_tag_kills_the_server(serve_engine, released, resumed):
    """A resume of a tag the engine did not release ends the server (no tags means all three, cuda_graph among
    them, which a release of kv_cache and weights leaves alone): the call fails and the URL stops answering."""
    url, handle = serve_engine()
    rollout.post(url, "/release_memory_occupation", {"tags": released})
    with pytest.raises((rollout.EngineError, httpx.TransportError)):
        rollout.post(url, "/resume_memory_occupation", {"tags": resumed} if resumed else {})
    assert wait_gone(url, handle).startswith("KeyError")


def test_release_while_busy_kills_the_server(serve_engine):
    """A release while a request runs fails SGLang's idle assertion: the server ends, and so do the requests.
    The release is sent once a request is seen running; a loaded machine can still finish every request before the
    release reaches the scheduler, so a release that is accepted must have found the engine idle (every request
    answered), and the engine is then made busy again: no outcome depends on how fast the machine is."""
    url, handle = serve_engine()
    for _ in range(5):
        futs = [background(gen, url, PROMPT, **LONG) for _ in range(8)]  # two batches of max_batch=4
        while not handle.engine.state()["num_running_reqs"]:
            time.sleep(0.01)
        try:
            rollout.post(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
        except (rollout.EngineError, httpx.TransportError):
            break
        for f in futs:  # accepted: the scheduler was idle, so every request was answered in full
            assert len(f.result(timeout=60)["meta_info"]["output_token_logprobs"]) == LONG["max_new_tokens"]
        rollout.post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    else:
        raise AssertionError("every release found the engine idle: no request was ever running when it arrived")
    assert wait_gone(url, handle).startswith("AssertionError: release_memory_occupation should be called only")
    concurrent.futures.wait(futs, timeout=60)
    failed = [f for f in futs if f.done() and isinstance(f.exception(), (rollout.EngineError, httpx.TransportError))]
    assert failed, "the requests running when the server died were answered"


def test_memory_calls_answer_null(server):
    """Both memory calls answer 200 with a JSON null body; what is released shows in /server_info."""
    url, _ = server
    r = httpx.post(url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
    assert (r.status_code, r.content) == (200, b"null")
    assert rollout.get(url, "/server_info")["internal_states"][0]["released"] == ["kv_cache"]
    r = httpx.post(url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
    assert (r.status_code, r.content) == (200, b"null")
    assert rollout.get(url, "/server_info")["internal_states"][0]["released"] == []


def test_updates_need_a_session(server):
    """A distributed update outside a weight-update session answers success false with SGLang's text."""
    url, _ = server
    r = httpx.post(url + "/update_weights_from_distributed", json={"names": [], "dtypes": [], "shapes": []},
                   timeout=30)
    assert r.status_code == 400 and r.json() == {
        "success": False,
        "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"}


def test_unknown_sampling_params_are_refused(server):
    """An unknown sampling_params key is a 400 in SGLang's words, listing every key SGLang's schema knows (the
    CPU engine's list is SGLang's); keys SGLang knows pass at their neutral values; an unknown top-level key of
    /generate is ignored."""
    url, _ = server
    r = httpx.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_tokens": 4}}, timeout=30)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`, " in message
    assert all(f"`{k}`" in message for k in cpu_engine.SGLANG_SAMPLING_KEYS)
    assert "did you mean 'max_new_tokens'" in message
    neutral = {"stop_regex": None, "beam_width": None, "watermark": None, "choice": [], "n": 1, "logit_bias": {}}
    out = rollout.post(url, "/generate", {"input_ids": [1, 2], "not_a_field": 1,
                                          "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, **neutral}})
    assert len(out["output_ids"]) == 3


def test_sampling_seed_needs_deterministic_inference(tiny_model_dir):
    """Without --enable-deterministic-inference a request's sampling_seed changes nothing: its tokens are those of
    the same arrival without a seed. With it, the seed alone decides (any arrival), and no seed means 42."""
    sp = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}
    runs = {"ignored": (False, [{"sampling_seed": 123}, {"sampling_seed": 123}]), "unseeded": (False, [{}, {}]),
            "honoured": (True, [{"sampling_seed": 123}, {"sampling_seed": 123}, {"sampling_seed": 124}, {},
                                {"sampling_seed": 42}])}
    outs = {}
    for name, (flag, extras) in runs.items():
        engine = cpu_engine.CpuEngine(tiny_model_dir, max_batch=4, max_len=64, seed=0,
                                      enable_deterministic_inference=flag).start()
        try:
            outs[name] = [engine.generate([PROMPT], {**sp, **extra})[0]["output_ids"] for extra in extras]
        finally:
            engine.stop()
    ignored, honoured = outs["ignored"], outs["honoured"]
    assert ignored[:2] == outs["unseeded"] and ignored[0] != ignored[1]  # arrivals 1 and 2, seed or not
    assert honoured[0] == honoured[1] != honoured[2] and honoured[3] == honoured[4] != honoured[0]


def test_prefix_cache_outlives_a_weight_update(server, hf_a, hf_b, other_dir, tiny_model_dir):
    """A finished request's K/V serves the next request with the same prefix (cached_tokens). An update with
    flush_cache false keeps it: the next request runs the new weights over the old weights' K/V of its prefix,
    exactly (transformers: model B over model A's cache). /flush_cache drops it: then exactly model B's output."""
    url, handle = server
    assert rollout.post(url, "/flush_cache", {}) is not None
    try:
        first = gen(url, PROMPT, temperature=0, max_new_tokens=6, ignore_eos=True)
        again = gen(url, PROMPT, temperature=0, max_new_tokens=6, ignore_eos=True)
        assert first["meta_info"]["cached_tokens"] == 0 and again["meta_info"]["cached_tokens"] == len(PROMPT) - 1
        assert again["output_ids"] == first["output_ids"] == hf_greedy(hf_a, PROMPT, 6, ignore_eos=True)
        r = rollout.post(url, "/update_weights_from_disk", {"model_path": other_dir, "flush_cache": False,
                                                            "weight_version": "1"})
        assert r["success"]
        stale = gen(url, PROMPT, temperature=0, max_new_tokens=6, ignore_eos=True)
        assert stale["meta_info"]["cached_tokens"] == len(PROMPT) - 1
        ids, lps = hf_greedy_over_cache(hf_a, hf_b, PROMPT[:-1], PROMPT[-1], 6)
        assert stale["output_ids"] == ids and (engine_logprobs(stale) - lps).abs().max() <= 1e-5
        assert ids != hf_greedy(hf_b, PROMPT, 6, ignore_eos=True)  # so the stale prefix shows
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
        fresh = gen(url, PROMPT, temperature=0, max_new_tokens=6, ignore_eos=True)
        assert fresh["meta_info"]["cached_tokens"] == 0
        assert fresh["output_ids"] == hf_greedy(hf_b, PROMPT, 6, ignore_eos=True)
        assert (engine_logprobs(fresh) - hf_logprobs(hf_b, PROMPT, fresh["output_ids"])).abs().max() <= 1e-5
        # an update with flush_cache at its default (true) drops the cache too, and so does a kv_cache release
        rollout.post(url, "/update_weights_from_disk", {"model_path": tiny_model_dir, "weight_version": "0"})
        assert gen(url, PROMPT, temperature=0, max_new_tokens=6)["meta_info"]["cached_tokens"] == 0
        rollout.post(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
        rollout.post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert handle.engine.state()["cached_slots"] == 0
    finally:
        rollout.post(url, "/update_weights_from_disk", {"model_path": tiny_model_dir, "weight_version": "0"})


def test_flush_is_refused_while_busy(server, tiny_model_dir):
    """/flush_cache while a request runs answers 400 and drops nothing; an update with flush_cache true then loads
    its weights (the version moves) but answers success false. Paused with nothing running, queued requests do not
    count, and the flush goes through."""
    url, handle = server
    gen(url, PROMPT, temperature=0, max_new_tokens=4)
    fut = background(gen, url, [3, 4, 5], **LONG)
    while not handle.engine.state()["num_running_reqs"]:
        time.sleep(0.01)
    try:
        r = httpx.post(url + "/flush_cache", timeout=30)
        assert (r.status_code, r.text) == (400, "Flush cache failed.\n")
        assert handle.engine.state()["cached_slots"] >= 1
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": tiny_model_dir, "weight_version": "2"},
                       timeout=60)
        assert r.status_code == 400 and r.json()["success"] is False
        assert r.json()["message"].startswith("Weights were updated, but the cache was not flushed")
        assert rollout.get(url, "/get_weight_version")["weight_version"] == "2"
        rollout.post(url, "/pause_generation", {"mode": "retract"})
        assert handle.engine.state()["num_waiting_reqs"] == 1
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
        assert handle.engine.state()["cached_slots"] == 0
    finally:
        rollout.post(url, "/continue_generation", {})
        fut.result(timeout=120)
        rollout.post(url, "/update_weight_version", {"new_version": "0", "abort_all_requests": False})


def test_weight_update_group_names_are_unique(tiny_model_dir):
    """A second /init_weights_update_group under a name in use fails (torch refuses it; this process joins the
    first rendezvous as rank 0); destroying the group frees the name; destroying it again fails. The engine runs in
    a process of its own: a group registers its name once per process, on both sides, as SGLang's does."""
    import torch.distributed as dist
    engine = _EngineProcess(tiny_model_dir)
    url, port, joined = engine.url, tm.free_port(), {}

    def groups():
        return rollout.get(url, "/server_info")["internal_states"][0]["weight_update_groups"]

    trainer_side = threading.Thread(target=lambda: joined.update(
        g=tm.new_sglang_group("127.0.0.1", port, 0, 2, "weights-a", "gloo")))
    trainer_side.start()
    try:
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": "weights-a", "backend": "gloo"}
        assert rollout.post(url, "/init_weights_update_group", body)["success"]
        trainer_side.join(timeout=60)
        assert groups() == ["weights-a"] and "g" in joined
        r = httpx.post(url + "/init_weights_update_group", json={**body, "master_port": tm.free_port()}, timeout=30)
        assert r.status_code == 400 and "group name has already been created" in r.json()["message"]
        assert rollout.post(url, "/destroy_weights_update_group", {"group_name": "weights-a"})["success"]
        assert groups() == []
        r = httpx.post(url + "/destroy_weights_update_group", json={"group_name": "weights-a"}, timeout=30)
        assert r.status_code == 400 and r.json()["message"] == "The group to be destroyed does not exist."
    finally:
        engine.shutdown()
        if "g" in joined:
            dist.destroy_process_group(joined["g"])
