"""Tests of cpu_engine.py: the CPU engine over real HTTP (httpx, through rollout.py's client helpers), checked
against transformers on the same weights.

What they prove: greedy ids equal transformers' greedy generate; returned logprobs equal transformers' log-softmax
at the chosen tokens (fp32, <= 1e-5); requests join and leave the running batch without changing each other's
results; stop ids / max_new_tokens / abort / pause modes give the right finish_reason and partial output; weight
updates (disk, in-process, shm and gloo broadcast through transfermesh) change the outputs to exactly the new
model's and bump weight_version, with every token stamped by the weights that produced it; bad input answers 400
and the server keeps serving; top-k/top-p/min-p sampling draws from exactly the filtered distribution; json_schema /
regex / ebnf requests stay in their grammar and report the logprobs of the masked distribution (invalid grammars: 400
with SGLang's message); a fixed engine seed reproduces samples; the scheduler thread keeps the process's only OpenMP pool.
"""
import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

import cpu
import cpu_engine
import cpu_model
import data
import rollout

ROOT = Path(__file__).resolve().parents[1]

MAX_LEN = 512  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # sampling_seed counts only under deterministic inference, as in SGLang (tests/test_conformance.py)
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=8, max_len=MAX_LEN, seed=0,
                                   enable_deterministic_inference=True)
    yield url, handle
    handle.shutdown()


@pytest.fixture(scope="module")
def hf_a(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def other_dir(tiny_model_dir, tmp_path_factory):
    """A second model with the same architecture and different weights (the tiny model, perturbed)."""
    out = tmp_path_factory.mktemp("other_model")
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(tiny_model_dir, f)):
            shutil.copy(os.path.join(tiny_model_dir, f), out)
    g = torch.Generator().manual_seed(1)
    # every tensor moves, by half its spread (at least 0.01): a tensor the engine failed to reload would show
    state = {k: v + 0.5 * v.std().clamp_min(0.02) * torch.randn(v.shape, generator=g)
             for k, v in load_file(f"{tiny_model_dir}/model.safetensors").items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def hf_b(other_dir):
    return AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32).eval()


PROMPTS = [[5, 17, 33, 100, 7], [9, 8, 7], [200, 201, 202, 203, 204, 205, 206, 207], [1, 40, 41, 42]]


def hf_greedy(model, prompt, n, ignore_eos=False):
    with torch.no_grad():
        kw = {"eos_token_id": None} if ignore_eos else {}
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, prompt, output_ids) -> torch.Tensor:
    """(len(output_ids),) transformers' log-softmax at each output token, given everything before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return lp.gather(1, torch.tensor(output_ids)[:, None])[:, 0]


def engine_logprobs(out) -> torch.Tensor:
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    return torch.tensor([lp for lp, _, _ in lps])


def gen(url, input_ids, **sp):
    return rollout.post(url, "/generate", {"input_ids": input_ids, "sampling_params": sp, "return_logprob": True})


def wait_running(handle, rid, min_tokens=1, timeout=120.0):
    """Poll the engine until request `rid` is in the running batch with >= min_tokens generated (a loaded 2-core
    machine took over 30 s once)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in handle.engine.state()["running"]:
            if r["rid"] == rid and r["completion_tokens"] >= min_tokens:
                return r["completion_tokens"]
        time.sleep(0.002)
    raise AssertionError(f"request {rid} never ran")


@contextlib.contextmanager
def paused(url, mode: str):
    """/pause_generation, then /continue_generation even when an assertion inside fails, so one failing test does
    not leave the module's server paused (and every later test waiting on it)."""
    rollout.post(url, "/pause_generation", {"mode": mode})
    try:
        yield
    finally:
        rollout.post(url, "/continue_generation", {})


def background(fn, *args, **kw):
    """Run fn in a thread; returns its Future (for requests that must be in flight while the test acts)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(fn, *args, **kw)
    pool.shutdown(wait=False)
    return fut


def test_a_groups_samples_share_one_prefill_and_keep_their_own_draws(tiny_model_dir, hf_a):
    """Requests with the same prompt admitted together (a group's N samples) prefill it once: the others get its K/V
    copied into their slots (SGLang's `cached_tokens` says so). Each still samples with its own draws, and every
    logprob is transformers' (<= 1e-5), the first token's too."""
    engine = cpu_engine.CpuEngine(tiny_model_dir, max_batch=8, max_len=MAX_LEN, seed=3).start()
    p, q = PROMPTS[0], PROMPTS[2]
    try:
        reqs = [engine.make_request(x, {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True})
                for x in [p, q, p, p, p]]
        outs = [f.result() for f in engine.submit(*reqs)]
    finally:
        engine.stop()
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, len(p), len(p), len(p)]
    assert len({tuple(o["output_ids"]) for o in outs[2:] + outs[:1]}) > 1  # the four samples of p differ
    for x, o in zip([p, q, p, p, p], outs):
        assert (engine_logprobs(o) - hf_logprobs(hf_a, x, o["output_ids"])).abs().max() <= 1e-5


def test_engine_norm_and_rope_are_transformers_bit_for_bit():
    """The CPU engine's RMSNorm (one weight per head for q|k together) and its RoPE (roll times a signed sin, q and
    k at once) are exactly transformers' Qwen3 computations, not just close."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 5, 4, 16, generator=g), torch.randn(3, 5, 2, 16, generator=g)  # (B, T, heads, D)
    qn, kn = Qwen3RMSNorm(16, eps=1e-6), Qwen3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        qn.weight.copy_(torch.randn(16, generator=g))
        kn.weight.copy_(torch.randn(16, generator=g))
        w = torch.cat([qn.weight.expand(4, -1), kn.weight.expand(2, -1)])  # (6, D) as the engine packs it
        qk = cpu_model._rms_norm(torch.cat([q, k], dim=2), w, 1e-6)                 # (B, T, 6, D)
        assert torch.equal(qk[:, :, :4], qn(q)) and torch.equal(qk[:, :, 4:], kn(k))
        cos, sin = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
        hq, hk = apply_rotary_pos_emb(qn(q), kn(k), cos, sin, unsqueeze_dim=2)
        ours = qk * cos[:, :, None] + qk.roll(8, dims=-1) * cpu_model._signed_sin(sin)[:, :, None]  # as the engine
    assert torch.equal(ours[:, :, :4], hq) and torch.equal(ours[:, :, 4:], hk)


def test_greedy_matches_transformers_generate_and_logprobs(server, hf_a):
    url, _ = server
    for prompt in PROMPTS:
        out = gen(url, prompt, temperature=0, max_new_tokens=24)
        ref = hf_greedy(hf_a, prompt, 24)  # both stop at the model's eos
        assert out["output_ids"] == ref
        assert (engine_logprobs(out) - hf_logprobs(hf_a, prompt, ref)).abs().max() <= 1e-5
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(ref)
        assert meta["weight_version"] == "0" and meta["weight_versions"] == [{"version": "0", "start": 0, "end": len(ref)}]
        eos = hf_a.generation_config.eos_token_id  # an int or, as Qwen ships it, a list ([<|im_end|>, <|endoftext|>])
        eos = [eos] if isinstance(eos, int) else eos
        expected = {"type": "stop", "matched": ref[-1]} if ref[-1] in eos else {"type": "length", "length": 24}
        assert meta["finish_reason"] == expected
    # the first prompt stops at eos within 24 tokens, so both kinds of finish were exercised
    assert gen(url, PROMPTS[0], temperature=0, max_new_tokens=24)["meta_info"]["finish_reason"]["type"] == "stop"


def test_concurrent_requests_join_and_leave_the_batch(server, hf_a):
    """A long request runs while shorter ones (greedy and sampled) join and leave; each greedy one equals its solo
    result, every logprob equals transformers', and the short ones finish while the long one is still running."""
    url, handle = server
    specs = [(PROMPTS[i % 4], {"temperature": t, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": i})
             for i, (t, n) in enumerate([(0, 7), (1.0, 12), (0, 20), (0.7, 5), (0, 33), (1.3, 9)])]
    solo = [gen(url, p, **sp) for p, sp in specs]
    long_prompt = [3, 4, 5, 6]
    handle.engine.stats["max_running"] = 0

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            long_task = asyncio.create_task(rollout.generate(
                client, url, long_prompt, {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}, rid="long"))
            await asyncio.to_thread(wait_running, handle, "long", 1)
            outs = await asyncio.gather(*(rollout.generate(client, url, p, sp) for p, sp in specs))
            long_done_early = long_task.done()
            return outs, await long_task, long_done_early

    outs, long_out, long_done_early = asyncio.run(run())
    assert not long_done_early, "the short requests should leave the batch before the long one finishes"
    assert handle.engine.stats["max_running"] >= 3
    for (prompt, sp), out, ref in zip(specs, outs, solo):
        assert len(out["output_ids"]) == sp["max_new_tokens"]
        assert out["output_ids"] == ref["output_ids"]  # greedy: same ids; sampled: same seed -> same ids
        assert (engine_logprobs(out) - hf_logprobs(hf_a, prompt, out["output_ids"])).abs().max() <= 1e-5
    assert long_out["output_ids"] == hf_greedy(hf_a, long_prompt, 300, ignore_eos=True)
    assert (engine_logprobs(long_out) - hf_logprobs(hf_a, long_prompt, long_out["output_ids"])).abs().max() <= 1e-5


def test_sampling_seed_and_filters(server):
    url, _ = server
    a = gen(url, PROMPTS[1], temperature=1.0, max_new_tokens=30, ignore_eos=True, sampling_seed=123)
    b = gen(url, PROMPTS[1], temperature=1.0, max_new_tokens=30, ignore_eos=True, sampling_seed=123)
    c = gen(url, PROMPTS[1], temperature=1.0, max_new_tokens=30, ignore_eos=True, sampling_seed=124)
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]
    # top_k=1 samples the argmax, whatever the temperature
    # both compute their prompt afresh (a prefix cached by another request: the same K/V up to float rounding)
    rollout.post(url, "/flush_cache")
    greedy = gen(url, PROMPTS[2], temperature=0, max_new_tokens=15, ignore_eos=True)
    rollout.post(url, "/flush_cache")
    top1 = gen(url, PROMPTS[2], temperature=2.0, top_k=1, max_new_tokens=15, ignore_eos=True)
    assert top1["output_ids"] == greedy["output_ids"]
    # logprobs are the policy's (temperature 1, unfiltered), not the sampling distribution's
    assert engine_logprobs(top1).tolist() == engine_logprobs(greedy).tolist()


@pytest.mark.parametrize("params, kept", [
    ({"top_p": 0.6}, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),     # keeps the smallest prefix whose mass reaches top_p
    ({"top_k": 3}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    ({"min_p": 0.5}, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),     # drops p < min_p * max p
    ({"temperature": 1.0}, [0.5, 0.3, 0.15, 0.05]),
])
def test_sample_filters_and_inverse_cdf(params, kept):
    """With a uniform grid of u, the sampled frequencies equal the filtered, renormalised distribution, and the
    returned logprob is always the unfiltered log-softmax at the sampled token."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 2000
    logits = probs.log().expand(n, 4)
    sp = cpu_engine.parse_sampling_params(params, vocab_size=4)
    u = (torch.arange(n) + 0.5) / n
    tokens, logp = cpu_model.sample(logits, [sp] * n, u)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor(kept), atol=2e-3), freq
    assert torch.allclose(logp, probs.log()[tokens], atol=1e-6)


def test_engine_seed_makes_sampling_reproducible(tiny_model_dir):
    """Same engine seed and arrival order -> same samples; another seed -> other samples."""
    sp = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
    runs = []
    for seed in (7, 7, 8):
        engine = cpu_engine.CpuEngine(tiny_model_dir, max_batch=4, max_len=64, seed=seed).start()
        try:
            runs.append([o["output_ids"] for o in engine.generate(PROMPTS, sp)])
        finally:
            engine.stop()
    assert runs[0] == runs[1] != runs[2]


def test_stop_token_ids_and_max_new_tokens(server):
    url, _ = server
    ref = gen(url, PROMPTS[2], temperature=0, max_new_tokens=20, ignore_eos=True)["output_ids"]
    stop = next(t for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])
    k = ref.index(stop)
    out = gen(url, PROMPTS[2], temperature=0, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    assert out["output_ids"] == ref[:k + 1]  # the matched stop token is kept in output_ids (it is trained on)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    out = gen(url, PROMPTS[2], temperature=0, max_new_tokens=5, ignore_eos=True)
    assert out["output_ids"] == ref[:5] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    # a prompt near the end of the context gets max_new_tokens clipped to what the slot holds
    out = gen(url, [7] * (MAX_LEN - 3), temperature=0, max_new_tokens=50, ignore_eos=True)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_batched_input_ids_returns_a_list(server, hf_a):
    url, _ = server
    outs = rollout.post(url, "/generate", {"input_ids": PROMPTS[:3], "rid": "batch",
                                            "sampling_params": {"temperature": 0, "max_new_tokens": 10}})
    assert isinstance(outs, list) and [o["meta_info"]["id"] for o in outs] == ["batch_0", "batch_1", "batch_2"]
    for prompt, out in zip(PROMPTS, outs):
        assert out["output_ids"] == hf_greedy(hf_a, prompt, 10)
        assert "output_token_logprobs" not in out["meta_info"]  # return_logprob defaults to false, as in SGLang


def test_abort_by_rid_returns_partial_output(server):
    url, handle = server
    long = {"temperature": 0, "max_new_tokens": 480, "ignore_eos": True}
    # while running: the other requests keep going, the aborted one answers with what it has
    futs = {rid: background(rollout.post, url, "/generate", {"input_ids": [3, 4, 5], "rid": rid, "return_logprob": True,
                                                              "sampling_params": {**long, "max_new_tokens": n}})
            for rid, n in (("victim", 480), ("bystander", 150))}
    wait_running(handle, "victim", 1)
    rollout.post(url, "/abort_request", {"rid": "victim"})
    out = futs["victim"].result(timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 480 and len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    assert futs["bystander"].result(timeout=60)["meta_info"]["finish_reason"]["type"] == "length"
    # abort_all, including a request that is still waiting (engine paused)
    with paused(url, "in_place"):
        fut = background(gen, url, [3, 4, 5], **long)
        while not handle.engine.state()["num_waiting_reqs"]:  # until it has reached the scheduler
            time.sleep(0.01)
        rollout.post(url, "/abort_request", {"abort_all": True})
        out = fut.result(timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []


def hf_greedy_over_cache(model_a, model_b, prefix, last, n):
    """What in-place pause + weight swap computes: model A's KV cache of `prefix`, then model B feeding `last`
    and its own greedy tokens one at a time over that cache. Returns (ids, (n,) logprobs)."""
    import inspect
    arg = "cache" if "cache" in inspect.signature(model_b.forward).parameters else "past_key_values"  # renamed in 5.x
    ids, lps = [], []
    with torch.no_grad():
        o = model_a(torch.tensor([prefix]), use_cache=True)
        cache, tok = o[arg], last
        for _ in range(n):
            o = model_b(torch.tensor([[tok]]), use_cache=True, **{arg: cache})
            cache = o[arg]
            lp = torch.log_softmax(o.logits[0, -1].float(), -1)  # (V,)
            tok = int(lp.argmax())
            ids.append(tok)
            lps.append(float(lp[tok]))
    return ids, torch.tensor(lps)


def test_pause_in_place_keeps_kv_and_new_weights_stamp_new_tokens(server, hf_a, hf_b):
    """In-place pause keeps the request in its slot with its KV cache; after a weight swap the tokens that follow
    are exactly model B's greedy tokens computed over model A's cache (neither A's continuation nor B's from a
    fresh prefill), each stamped with the new version."""
    url, handle = server
    fut = background(rollout.post, url, "/generate", {"input_ids": PROMPTS[0], "rid": "inplace", "return_logprob": True,
                                                      "sampling_params": {"temperature": 0, "max_new_tokens": 200,
                                                                          "ignore_eos": True}})
    wait_running(handle, "inplace", 2)
    with paused(url, "in_place"):
        n = wait_running(handle, "inplace", 1)
        # frozen while paused, still holding its slot: an unpaused scheduler steps between any two state() answers
        assert wait_running(handle, "inplace", 1) == n
        handle.engine.load_weights(hf_b.state_dict().items(), version=5)  # the in-process path
    out = fut.result(timeout=60)
    try:
        # SGLang's span format: tokens [0, n) from version 0, [n, 200) from version 5
        assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": n},
                                                       {"version": "5", "start": n, "end": 200}]
        assert out["meta_info"]["weight_version"] == "5"
        ids, lps = out["output_ids"], engine_logprobs(out)
        old = ids[:n]
        assert old == hf_greedy(hf_a, PROMPTS[0], n, ignore_eos=True)
        assert (lps[:n] - hf_logprobs(hf_a, PROMPTS[0], old)).abs().max() <= 1e-5
        # after the swap: model B's forward over the KV cache model A wrote (the cache was kept, not recomputed)
        ref_ids, ref_lps = hf_greedy_over_cache(hf_a, hf_b, PROMPTS[0] + old[:-1], old[-1], 200 - n)
        assert ids[n:] == ref_ids and (lps[n:] - ref_lps).abs().max() <= 1e-5
        # both alternatives differ: B re-prefilled from scratch (the cache dropped), or A still running
        assert ids[n:n + 20] != hf_greedy(hf_b, PROMPTS[0] + old, 20, ignore_eos=True)
        assert ids[n:n + 20] != hf_greedy(hf_a, PROMPTS[0] + old, 20, ignore_eos=True)
    finally:
        rollout.post(url, "/update_weights_from_disk", {"model_path": handle.engine.model_path, "weight_version": "0"})


def test_pause_retract_recomputes_with_new_weights(server, hf_a, hf_b, other_dir, tiny_model_dir):
    """Retracted requests give back their KV slot; on continue they are re-prefilled under the new weights, so
    every token after the update is exactly the new model's greedy continuation, with its logprobs."""
    url, handle = server
    prompt, n = PROMPTS[3], 400  # long enough to be still running when the pause (an HTTP call) lands
    fut = background(rollout.post, url, "/generate", {"input_ids": prompt, "rid": "retract", "return_logprob": True,
                                                      "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                                          "ignore_eos": True}})
    wait_running(handle, "retract", 2)
    with paused(url, "retract"):
        state = handle.engine.state()
        assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 1 and state["paused"]
        r = rollout.post(url, "/update_weights_from_disk", {"model_path": other_dir, "weight_version": "6"})
        assert r["success"] and "6" in r["message"]
    out = fut.result(timeout=60)
    try:
        spans = out["meta_info"]["weight_versions"]
        k = spans[0]["end"]
        assert 2 <= k < n and spans == [{"version": "0", "start": 0, "end": k}, {"version": "6", "start": k, "end": n}]
        ids, lps = out["output_ids"], engine_logprobs(out)
        assert ids[:k] == hf_greedy(hf_a, prompt, k, ignore_eos=True)
        assert (lps[:k] - hf_logprobs(hf_a, prompt, ids[:k])).abs().max() <= 1e-5
        assert ids[k:] == hf_greedy(hf_b, prompt + ids[:k], n - k, ignore_eos=True)
        assert (lps[k:] - hf_logprobs(hf_b, prompt + ids[:k], ids[k:])).abs().max() <= 1e-5
    finally:
        rollout.post(url, "/update_weights_from_disk", {"model_path": tiny_model_dir, "weight_version": "0"})


def test_pause_abort_mode_and_requests_queued_while_paused(server, hf_a):
    url, handle = server
    fut = background(rollout.post, url, "/generate", {"input_ids": PROMPTS[1], "rid": "paused-abort",
                                                      "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})
    wait_running(handle, "paused-abort", 1)
    with paused(url, "abort"):
        assert fut.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
        queued = background(gen, url, PROMPTS[1], temperature=0, max_new_tokens=8)
        while not handle.engine.state()["num_waiting_reqs"]:  # until it has reached the scheduler
            time.sleep(0.01)
        # still waiting a scheduler iteration later (an unpaused scheduler would have admitted it by then)
        assert handle.engine.state()["num_waiting_reqs"] == 1 and not queued.done()
    assert queued.result(timeout=60)["output_ids"] == hf_greedy(hf_a, PROMPTS[1], 8)


def test_weight_updates_change_outputs_and_bump_version(server, hf_a, hf_b, other_dir, tiny_model_dir):
    import transfermesh
    url, _ = server

    def check(model, version):
        for prompt in PROMPTS[:2]:
            out = gen(url, prompt, temperature=0, max_new_tokens=12, ignore_eos=True)
            assert out["output_ids"] == hf_greedy(model, prompt, 12, ignore_eos=True)
            assert (engine_logprobs(out) - hf_logprobs(model, prompt, out["output_ids"])).abs().max() <= 1e-5
            assert out["meta_info"]["weight_version"] == version
        assert rollout.get(url, "/get_weight_version")["weight_version"] == version

    try:
        assert hf_greedy(hf_a, PROMPTS[0], 12, ignore_eos=True) != hf_greedy(hf_b, PROMPTS[0], 12, ignore_eos=True)
        rollout.post(url, "/update_weights_from_disk", {"model_path": other_dir, "weight_version": "3"})
        check(hf_b, "3")
        r = rollout.post(url, "/update_weight_version", {"new_version": "4", "abort_all_requests": False})
        assert r["new_version"] == "4"
        check(hf_b, "4")
        # transfermesh updates keep the prefix cache (flush_cache false, as a pause in place needs): the controller
        # flushes it after the push (fleet.update_engines), and so does this test
        transfermesh.push_weights(hf_a.state_dict().items(), [url], 7, transport="shm", bucket_mb=0.05)
        rollout.post(url, "/flush_cache")
        check(hf_a, "7")
        # broadcast: tests/test_transfermesh.py, into engines in processes of their own (a weight-update group is
        # registered by name once per process, on both sides, as SGLang's is)
        transfermesh.push_weights(hf_b.state_dict().items(), [url], 8, transport="disk", bucket_mb=0.05)
        rollout.post(url, "/flush_cache")
        check(hf_b, "8")
    finally:
        rollout.post(url, "/update_weights_from_disk", {"model_path": tiny_model_dir, "weight_version": "0"})
    check(hf_a, "0")


def _family_model(kind: str, out: Path) -> str:
    """A random 2-layer model of another family the CPU engine serves, every parameter random (biases and norm
    weights moved off their 0/1 init), saved as HF without a tokenizer (the engine then answers ids only)."""
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
    model = {"qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)),  # q/k/v biases, no q_norm/k_norm
             "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=True)),  # no biases
             }[kind]()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.float().save_pretrained(str(out / kind))
    return str(out / kind)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_other_families_match_transformers(kind, tmp_path):
    """The CPU engine on Qwen2 (q/k/v biases in the fused qkv matmul, no q_norm) and Llama (no biases, tied
    embeddings): greedy ids equal transformers' generate and logprobs equal its log-softmax, in a batch of
    prompts of different lengths; a weight update by name lands in the fused tensors."""
    path = _family_model(kind, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 17, 33, 100, 7], [9, 8, 7], [20, 21, 22, 23, 24, 25, 26, 27]]
    engine = cpu_engine.CpuEngine(path, max_batch=4, max_len=128, seed=0).start()
    try:
        outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
        for prompt, out in zip(prompts, outs):
            assert out["output_ids"] == hf_greedy(hf, prompt, 16, ignore_eos=True)
            assert (engine_logprobs(out) - hf_logprobs(hf, prompt, out["output_ids"])).abs().max() <= 1e-5
        with torch.no_grad():  # a bias (qwen2) or a norm (llama) reloaded by name changes what the engine computes
            name = "model.layers.0.self_attn.k_proj.bias" if kind == "qwen2" else "model.layers.1.input_layernorm.weight"
            p = dict(hf.named_parameters())[name]
            p.copy_(p + torch.randn_like(p))
        engine.load_weights([(name, p.detach().clone())], version=1, flush_cache=True)
        out = engine.generate(prompts[:1], {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})[0]
        assert out["meta_info"]["weight_version"] == "1"
        assert (engine_logprobs(out) - hf_logprobs(hf, prompts[0], out["output_ids"])).abs().max() <= 1e-5
        assert out["output_ids"] == hf_greedy(hf, prompts[0], 16, ignore_eos=True) != outs[0]["output_ids"]
    finally:
        engine.stop()


TEST_SETTINGS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, norm_std=0.2)  # conftest's tiny model, built here with longer contexts


def _tiny(**over) -> str:
    s = {**TEST_SETTINGS, **over}
    return data.build_tiny_model(data.default_cache_dir() / f"tiny-test-{data.settings_hash(s)}", **s)


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
def test_chunked_prefill_through_the_fused_kernel_matches_transformers(kind, monkeypatch):
    """A prefill longer than CHUNKED_PREFILL_SIZE runs in pieces, each over the K/V the pieces before it wrote, and
    past DENSE_ATTENTION_MAX_LEN through torch's fused kernel: the first piece causal, later pieces and a
    prefix-cache hit masked, DeepSeek-V3's value heads (of another size) padded. Greedy ids are transformers' and
    logprobs within 1e-5 of its, as for short prompts; the routed experts are those of one unchunked prefill. The
    written-out attention reaches as far as the trainer's (cpu.EXPLICIT_ATTENTION_MAX_LEN)."""
    assert cpu_model.DENSE_ATTENTION_MAX_LEN == cpu.EXPLICIT_ATTENTION_MAX_LEN
    monkeypatch.setattr(cpu_model, "CHUNKED_PREFILL_SIZE", 96)
    monkeypatch.setattr(cpu_model, "DENSE_ATTENTION_MAX_LEN", 8)
    path = _tiny() if kind == "qwen3" else _tiny(model_type="deepseek_v3", num_experts=8, moe_intermediate_size=32,
                                                 v_head_dim=12)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(10, 300, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    engine = cpu_engine.CpuEngine(path, max_batch=2, max_len=MAX_LEN, seed=0).start()
    try:
        moe = dict(return_routed_experts=kind != "qwen3")
        first = engine.generate([prompt], sp, **moe)[0]
        longer = prompt + first["output_ids"] + prompt[:150]  # over the first request's cached K/V
        second = engine.generate([longer], sp)[0]
        monkeypatch.setattr(cpu_model, "CHUNKED_PREFILL_SIZE", MAX_LEN)
        assert engine.flush_cache()
        whole = engine.generate([prompt], sp, **moe)[0]
    finally:
        engine.stop()
    assert second["meta_info"]["cached_tokens"] == len(prompt) + 5  # all but the last sampled token's K/V
    for p, out in ((prompt, first), (longer, second)):
        assert out["output_ids"] == hf_greedy(hf, p, 6, ignore_eos=True)
        assert (engine_logprobs(out) - hf_logprobs(hf, p, out["output_ids"])).abs().max() <= 1e-5
    assert first["meta_info"].get("routed_experts") == whole["meta_info"].get("routed_experts")


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch op returns while it is on (bytes of its own extent, views included)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.numel() * t.element_size())
        return out


def test_prefill_memory_is_linear_in_the_prompt():
    """The largest tensor a prefill makes grows linearly with the prompt, at most one 4-byte number per (piece
    query, key) pair: 4 MB at 4,096 tokens (a boolean mask of one piece over the keys), where the scores and additive
    mask of the whole prompt took 256 MB (quadratic: 64 MB at 2,048 tokens). It counts what every op returns, not a
    kernel's own scratch (peak engine RSS in docs/CPU.md: 0.9 GB at 32K tokens). The chunked prefill's last logits are
    the unchunked written-out path's, to float rounding."""
    n_max = 4096
    runner = cpu_model.ModelRunner(_tiny(max_position_embeddings=n_max + 64), max_batch=1, max_len=n_max + 64,
                                    dtype="float32", fp32_lm_head=False)
    largest, logits = {}, {}
    for n in (n_max // 2, n_max):
        with torch.inference_mode(), _LargestTensor() as seen:
            logits[n], _ = runner.forward([0], [0], [[10 + i * 7 % 290 for i in range(n)]])
        largest[n] = seen.nbytes
        assert seen.nbytes <= 4 * cpu_model.CHUNKED_PREFILL_SIZE * n, (n, seen.nbytes)
    assert largest[n_max] <= 2.1 * largest[n_max // 2], largest
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:  # every token in one piece, written out
        for name, big in (("CHUNKED_PREFILL_SIZE", n_max), ("DENSE_ATTENTION_MAX_LEN", n_max),
                          ("DENSE_ATTENTION_MAX_SCORES", 2 ** 40)):
            mp.setattr(cpu_model, name, big)
        whole, _ = runner.forward([0], [0], [[10 + i * 7 % 290 for i in range(n_max // 2)]])
    assert (torch.log_softmax(whole, -1) - torch.log_softmax(logits[n_max // 2], -1)).abs().max() <= 1e-5


def test_a_kv_cache_past_the_machines_memory_is_refused_at_start(tiny_model_dir, monkeypatch):
    """The KV cache (--max-batch x --max-len tokens) is allocated at start: one larger than the memory available
    is refused then, naming the flag to lower, instead of the engine dying in the allocation. Where /proc cannot be
    read (macOS), the memory available is unknown: the model runner still builds its cache, unchecked."""
    with pytest.raises(ValueError, match=r"--max-batch 10000000 x --max-len 512 tokens needs .* smaller --max-len"):
        cpu_engine.CpuEngine(tiny_model_dir, max_batch=10 ** 7, max_len=MAX_LEN)
    real, refused = open, []

    def no_proc(file, *args, **kw):
        if str(file).startswith("/proc"):
            refused.append(str(file))
            raise FileNotFoundError(2, "No such file or directory (no /proc, as on macOS)", str(file))
        return real(file, *args, **kw)
    monkeypatch.setattr("builtins.open", no_proc)
    runner = cpu_model.ModelRunner(tiny_model_dir, max_batch=2, max_len=MAX_LEN, dtype="float32", fp32_lm_head=False)
    assert "/proc/meminfo" in refused and runner.k_cache.shape[1:2] == (2,) and runner.k_cache.shape[-2] == MAX_LEN


# Constrained decoding: each of SGLang's three grammar fields, with a sampled (seeded) request
CONSTRAINTS = {
    "json_schema": (json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                                "required": ["n", "ok"], "additionalProperties": False}),
                    lambda text: set(json.loads(text)) == {"n", "ok"} and isinstance(json.loads(text)["n"], int)
                    and isinstance(json.loads(text)["ok"], bool)),
    "regex": ("[0-9]{2,4}-(yes|no)", lambda text: re.fullmatch("[0-9]{2,4}-(yes|no)", text) is not None),
    "ebnf": ('root ::= "go " dir\ndir ::= "left" | "right"', lambda text: text in ("go left", "go right")),
}


@pytest.mark.parametrize("key", list(CONSTRAINTS))
def test_constrained_decoding_samples_and_scores_the_masked_distribution(key, server, hf_a, tiny_model_dir):
    """A grammar request's text is in its grammar and ends at the grammar's end (a model eos, finish "stop"); each
    token's logprob is log_softmax of the logits with the refused tokens masked out (an xgrammar matcher of our own
    walks the same tokens), which is larger than the raw one wherever the mask removed mass; a request without a
    grammar in the same batch is the same as alone."""
    import xgrammar
    url, handle = server
    source, valid = CONSTRAINTS[key]
    prompt = [5, 6, 7, 8]
    sp = {key: source, "temperature": 1.0, "max_new_tokens": 200, "sampling_seed": 3}
    plain = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 4}
    both = rollout.post(url, "/generate", {"input_ids": [prompt, prompt], "sampling_params": [sp, plain],
                                           "return_logprob": True})
    out, alongside = both
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]["finish_reason"]
    assert out["output_ids"][-1] in handle.engine.runner.eos_ids
    text = handle.engine.tokenizer.decode(out["output_ids"][:-1])
    assert valid(text), text
    assert alongside["output_ids"] == gen(url, prompt, **plain)["output_ids"]

    info = xgrammar.TokenizerInfo.from_huggingface(handle.engine.tokenizer, vocab_size=hf_a.config.vocab_size,
                                                   stop_token_ids=sorted(handle.engine.runner.eos_ids))
    compiler = xgrammar.GrammarCompiler(info)
    matcher = xgrammar.GrammarMatcher({"json_schema": compiler.compile_json_schema, "regex": compiler.compile_regex,
                                       "ebnf": compiler.compile_grammar}[key](source))
    with torch.no_grad():
        logits = hf_a(torch.tensor([prompt + out["output_ids"]])).logits[0, len(prompt) - 1:-1].float()  # (T, V)
    masked = []
    for t, tok in enumerate(out["output_ids"]):
        bitmask = xgrammar.allocate_token_bitmask(1, logits.shape[1])
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = torch.tensor([(int(bitmask[0, i // 32]) >> (i % 32)) & 1 for i in range(logits.shape[1])]).bool()
        masked.append(torch.log_softmax(logits[t].masked_fill(~allowed, float("-inf")), -1)[tok])
        assert matcher.accept_token(tok)
    got = engine_logprobs(out)
    assert (got - torch.stack(masked)).abs().max() <= 1e-5
    raw = hf_logprobs(hf_a, prompt, out["output_ids"])
    assert bool((got >= raw - 1e-6).all()) and bool((got > raw + 1e-3).any())


@pytest.mark.parametrize("payload, needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"sampling_params": {"max_new_tokens": 4}}, "input_ids"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": [[1, 2], []]}, "non-empty"),
    ({"input_ids": [1, 2, 99999]}, "outside the vocabulary"),
    ({"input_ids": [1, -1]}, "outside the vocabulary"),
    ({"input_ids": [1, "a"]}, "integers"),
    ({"input_ids": [1] * MAX_LEN}, "--max-len"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"max_tokens": 4}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}}, "not implemented"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [100000]}}, "stop_token_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"json_schema": "{"}}, "Failed to compile json grammar"),
    ({"input_ids": [1, 2], "sampling_params": {"json_schema": '{"type": "nope"}'}}, "Failed to compile json grammar"),
    ({"input_ids": [1, 2], "sampling_params": {"json_schema": '{"type": "array", "uniqueItems": true}'}},
     "uniqueItems would be ignored"),
    ({"input_ids": [1, 2], "sampling_params": {"regex": "(["}}, "Failed to compile regex grammar"),
    ({"input_ids": [1, 2], "sampling_params": {"ebnf": "root ::= "}}, "Failed to compile ebnf grammar"),
    ({"input_ids": [1, 2], "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "Only one of"),
    ({"input_ids": [1, 2], "sampling_params": {"json_schema": {"type": "object"}}}, "expected a string"),
    ({"input_ids": [1, 2], "sampling_params": {"structural_tag": "{}"}}, "Failed to compile structural_tag grammar"),
])
def test_bad_input_answers_400_and_server_keeps_serving(server, payload, needle):
    url, _ = server
    if isinstance(payload, bytes):
        kw = {"content": payload, "headers": {"content-type": "application/json"}}
    else:
        kw = {"json": payload}
    r = httpx.post(f"{url}/generate", timeout=30, **kw)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and needle in err["message"], err
    assert len(gen(url, [1, 2, 3], temperature=0, max_new_tokens=3, ignore_eos=True)["output_ids"]) == 3


THREADS_SCRIPT = """
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import cpu_engine
torch.set_num_threads(2)
if sys.argv[3] == "caller":  # the model built on this thread, which lives on
    engine = cpu_engine.CpuEngine.__new__(cpu_engine.CpuEngine)
    engine._build(sys.argv[2], max_batch=8, max_len=64)
else:
    engine = cpu_engine.CpuEngine(sys.argv[2], max_batch=8, max_len=64)
engine.start()
engine.generate([[5, 6, 7, 8]] * 8, {"max_new_tokens": 4, "ignore_eos": True})
print(len(os.listdir("/proc/self/task")), flush=True)
os._exit(0)  # the scheduler thread still runs: a normal interpreter exit can abort in C++ teardown ("terminate called")
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
@pytest.mark.slow
def test_engine_scheduler_keeps_the_only_openmp_pool(tiny_model_dir):
    """CpuEngine builds its model on a thread that ends, so that its scheduler thread is the only one in the
    process to keep an OpenMP pool (with two pools on 2 cores libgomp makes every waiting thread sleep, and a
    2-thread engine generated ~2x slower). Built on the lasting caller's thread instead, that thread keeps a pool
    worker of its own: one thread more, in a fresh process each (2 torch threads)."""
    counts = {}
    procs = {where: subprocess.Popen([sys.executable, "-c", THREADS_SCRIPT, str(ROOT), tiny_model_dir, where],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for where in ("own thread", "caller")}  # side by side: each counts only its own threads
    for where, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        counts[where] = int(out.split()[-1])
    assert counts["caller"] == counts["own thread"] + 1, counts
