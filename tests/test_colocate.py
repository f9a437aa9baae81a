"""The colocated memory hand-off on CPU, with resident memory (RSS) measured at every stage.

What each test proves:
* engine: /release_memory_occupation really frees the KV cache and the weights (RSS drops by about their size),
  nothing is generated while they are released (a request waits), /resume_memory_occupation takes the memory back,
  and after a weight update greedy generation gives the same tokens and logprobs as before the release (what SGLang
  does with a release while requests run, or a resume of a tag not released, is in tests/test_conformance.py);
* trainer: offload frees optimizer state + grads, then the weights (RSS drops), onload brings them back, and training
  goes on bit-exactly as on a trainer that never offloaded;
* the whole sequence in train() (colocate: true, two steps): memory/ metrics at each stage move as the sequence says
  (engines low while the trainers train, trainers low while the engines generate) and the run trains and syncs;
* the controller's side of it against SGLang's behaviours: paused, released engines probed as alive, and an engine
  re-created mid-way joining the hand-off's state, so no resume of a tag it did not release ends it.
"""
import json
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

import config
import cpu_engine
import data
import loongsage
import rollout
import transfermesh as tm

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)
MB = 2**20
# big enough that its weights (~13 MB fp32, plus MKL's packed copy) and KV cache stand out of RSS noise
SETTINGS = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                intermediate_size=1024, norm_std=0.2)


@pytest.fixture(scope="module")
def mid_model():
    return data.build_tiny_model(data.default_cache_dir() / f"tiny-colocate-{data.settings_hash(SETTINGS)}", **SETTINGS)


def _greedy(url, prompt):
    r = rollout.post(url, "/generate", {"input_ids": prompt, "return_logprob": True,
                                        "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})
    return r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]


def test_engine_releases_and_resumes_weights_and_kv_cache(mid_model):
    from safetensors.torch import load_file
    max_batch, max_len = 32, 512
    url, handle = cpu_engine.serve(mid_model, max_batch=max_batch, max_len=max_len, seed=0)
    try:
        eng = handle.engine
        kv_bytes = 2 * eng.runner.k_cache.numel() * eng.runner.k_cache.element_size()
        w_bytes = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
        prompt = [5, 17, 42, 9, 33]
        before = _greedy(url, prompt)

        def release_or_resume(call, tags):  # the answer is JSON null, as SGLang's; the engine runs in this process
            assert rollout.post(url, f"/{call}_memory_occupation", {"tags": tags}) is None
            return {"released": eng.state()["released"], "rss_bytes": tm.rss_bytes()}

        rss0 = tm.rss_bytes()
        kv = release_or_resume("release", ["kv_cache"])
        both = release_or_resume("release", ["weights"])
        assert kv["released"] == ["kv_cache"] and both["released"] == ["kv_cache", "weights"]
        assert rss0 - kv["rss_bytes"] > 0.8 * kv_bytes, (rss0 / MB, kv["rss_bytes"] / MB, kv_bytes / MB)
        assert kv["rss_bytes"] - both["rss_bytes"] > 0.8 * w_bytes, (kv["rss_bytes"] / MB, both["rss_bytes"] / MB)

        # nothing generates while memory is released: the request waits for the resume
        waiting = {}
        t = threading.Thread(target=lambda: waiting.update(out=_greedy(url, prompt)))
        t.start()
        while not eng.state()["num_waiting_reqs"]:  # until the request has reached the scheduler
            time.sleep(0.01)
        state = eng.state()  # answered a scheduler iteration later: it passed a step and did not admit the request
        assert not waiting and (state["num_waiting_reqs"], state["num_running_reqs"]) == (1, 0)
        with pytest.raises(RuntimeError, match="weights are released"):  # no update into freed weights
            tm.push_weights(sorted(load_file(f"{mid_model}/model.safetensors").items()), [url], version=1,
                            transport="shm")

        # two-stage onload: weights (zeroed) back, the update fills them, then the KV cache
        w = release_or_resume("resume", ["weights"])
        assert w["rss_bytes"] - both["rss_bytes"] > 0.8 * w_bytes and w["released"] == ["kv_cache"]
        # dropped, not kept (SGLang's default)
        assert all(float(p.abs().sum()) == 0 for p in eng.runner.model.parameters())
        tm.push_weights(sorted(load_file(f"{mid_model}/model.safetensors").items()), [url], version=1, transport="shm")
        assert not waiting  # still waiting: the KV cache is not back
        # measured right before the resume: the update in between frees memory of its own (run alone: 7.5 MB, so the
        # resume's 56.6 MB for the 64 MB cache read as 49.1 MB against `w`, under the bound)
        rss1 = tm.rss_bytes()
        k = release_or_resume("resume", ["kv_cache"])  # only what is released: no tags = all three, and SGLang's
        #                                                scheduler dies on the resume of a tag it did not release
        assert k["released"] == [] and k["rss_bytes"] - rss1 > 0.8 * kv_bytes, (rss1 / MB, k["rss_bytes"] / MB)
        t.join(timeout=60)
        assert waiting["out"] == before  # the waiting request ran after the resume, on the restored weights
        rollout.post(url, "/flush_cache")  # computed afresh, as `before` was (not over the waiting request's K/V)
        assert _greedy(url, prompt) == before  # same tokens, same logprobs as before the release
        with pytest.raises(rollout.EngineError, match="tags must be a list of"):
            rollout.post(url, "/release_memory_occupation", {"tags": ["weigths"]})
    finally:
        handle.shutdown()



@pytest.mark.slow
def test_trainer_offload_and_onload(ray_session, mid_model, tmp_path):
    """Offload frees memory for real and onload restores it bit-exactly: two trainers on the same batches, one
    offloading everything between its steps, end with identical losses and weights."""
    import trainer
    from config import Config
    from test_trainer import make_batch

    a = b = None
    try:
        cfg = Config(device="cpu", dtype="float32", seed=0, trainer_workers=1, prompts_per_step=4, samples_per_prompt=2,
                     global_batch_size=8, micro_batch_size=4, lr=1e-3, min_lr=1e-3, output_dir=str(tmp_path),
                     trainer_threads=1)
        actor = ray.remote(num_cpus=1)(trainer.TrainerWorker)
        a, b = (actor.remote(cfg, 0, 1, "127.0.0.1", tm.free_port()) for _ in range(2))
        n_params = ray.get([w.load_hf.remote(mid_model) for w in (a, b)])[0]["params_this_rank"]
        losses = {a: [], b: []}
        for step in range(2):
            batch = make_batch(n_groups=4, per_group=2, seed=step, vocab=384)
            for w in (a, b):
                losses[w].append(ray.get(w.train_step.remote(batch, step))["train/loss"])
            resident = ray.get(a.memory.remote())["rss_bytes"]
            m1 = ray.get(a.offload.remote(["optimizer", "grads"]))["rss_bytes"]
            m2 = ray.get(a.offload.remote(["weights"]))["rss_bytes"]
            # Adam's two moments + the grad buffer are 3 copies of the weights; the weights one more
            assert resident - m1 > 0.8 * 3 * 4 * n_params, (resident / MB, m1 / MB, n_params)
            assert m1 - m2 > 0.8 * 4 * n_params, (m1 / MB, m2 / MB)
            assert sorted(p.name for p in (tmp_path / "offload").iterdir()) == ["rank0_optimizer.bin", "rank0_weights.bin"]
            back = ray.get(a.onload.remote())["rss_bytes"]
            assert back - m2 > 0.8 * 4 * 4 * n_params
            assert not list((tmp_path / "offload").iterdir())
            ray.get(a.offload.remote(["optimizer", "grads", "weights"]))  # the next train_step onloads by itself
        assert losses[a] == losses[b] and len(set(losses[a])) == 2
        wa, wb = ray.get(a.export_hf_weights.remote()), ray.get(b.export_hf_weights.remote())
        assert all(na == nb and torch.equal(x, y) for (na, x), (nb, y) in zip(wa, wb))
    finally:
        for w in (a, b):
            if w is not None:
                ray.kill(w)


@pytest.mark.slow
def test_colocated_run_hands_memory_back_and_forth(ray_session, tmp_path):
    """train() with colocate: true on CPU: two sync steps of the arith recipe (a 4M-parameter tiny model, no warm
    start), every stage's memory logged by colocate_hand_off. Two are enough: step 0 checks the hand-off before
    Adam's moments exist, step 1 with them (a third step repeated step 1's checks)."""
    out = tmp_path / "run"
    loongsage.train(config.load_config(str(ROOT / "recipes/arith_cpu.yaml"), [
        "colocate=true", "num_steps=2", "eval_every=0", "prompts_per_step=4", "samples_per_prompt=4",
        "global_batch_size=16", "micro_batch_size=8", "engine_max_batch=64", "max_context_len=512", "print_every=0",
        "warmstart_steps=0", "tiny_model.hidden_size=256", "tiny_model.intermediate_size=1024", f"output_dir={out}"]))
    w_mb = (out / "final_hf" / "model.safetensors").stat().st_size / MB  # the weights, fp32
    steps = [x for x in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in x]
    assert [x["weights/version"] for x in steps] == [1, 2]
    for i, m in enumerate(steps):
        # engines: released while the trainers train, weights back for the sync, KV cache back for the rollouts
        assert m["memory/train_engine_mb"] < m["memory/sync_engine_mb"] < m["memory/rollout_engine_mb"], m
        assert m["memory/sync_engine_mb"] - m["memory/train_engine_mb"] > 0.7 * w_mb, (m, w_mb)
        # trainers: weights out while the engines generate ...
        assert m["memory/sync_trainer_mb"] - m["memory/rollout_trainer_mb"] > 0.6 * w_mb, (m, w_mb)
        if i:  # ... and Adam's moments + grads (3 copies of the weights; Adam's exist from the first step on)
            assert m["memory/train_trainer_mb"] - m["memory/sync_trainer_mb"] > 0.6 * 3 * w_mb, (m, w_mb)
        assert all(m[f"timing/hand_off_{s}"] >= 0 for s in ("train", "sync", "rollout"))
        assert m["rollout/generated_tokens"] > 0 and m["train/loss"] == m["train/loss"]  # generated, trained
        assert m["engines/restarts"] == 0  # no paused engine probed as dead, none ended by a resume it could not take


def test_hand_off_reads_paused_engines_right_and_a_re_created_engine_joins_it(tmp_path, tiny_model_dir,
                                                                           ray_session):
    """The controller's colocated hand-off against engines that do what SGLang does (Ray actors: one Megatron trainer,
    two CPU engines, AgentFlow). The probes of sync_engines read the paused engines, memory released, as alive: no
    engine is re-created but the one this test re-creates after the weight sync, as sync_engines re-creates a dead
    one. That engine joins the others' state (paused, KV cache released), so the "rollout" stage resumes no tag an
    engine did not release (SGLang's server would end): both engines end up serving version 1, unpaused, holding
    all their memory."""
    import config
    import fleet
    cfg = config.load_config(None, [f"model_path={tiny_model_dir}", "colocate=true", "num_engines=2",
                                    "trainer_workers=1", "engine_health_timeout=5", "engine_max_batch=8",
                                    "warmstart_steps=0", f"output_dir={tmp_path}"])
    f = fleet.reserve(cfg)  # on the session's Ray; stopped below, the engines, trainer and router with it
    try:
        f.model = tiny_model_dir
        flow = fleet.start_rollout(cfg, f)
        trainers = fleet.start_trainers(cfg, f)
        ray.get([t.load_hf.remote(f.model) for t in trainers])
        f.urls = fleet.wait([e.url.remote() for e in f.actors], "starting the engines", 300, "actor_timeout")
        fleet.colocate_hand_off(cfg, f, flow, trainers, "train")
        fleet.colocate_hand_off(cfg, f, flow, trainers, "sync")
        fleet.sync_engines(cfg, f, flow, trainers, 1)
        fleet.restart_engine(cfg, f, 1, flow, trainers, 1)
        joined = fleet.engine_states(f.urls)
        assert [(s["paused"], s["released"]) for s in joined] == [(True, ["kv_cache"])] * 2
        fleet.colocate_hand_off(cfg, f, flow, trainers, "rollout")
        states = fleet.engine_states(f.urls)
        assert f.restarts == 1 and f.released == [set(), set()] and f.hand_off == []
        assert [(s["paused"], s["released"], s["weight_version"]) for s in states] == [(False, [], "1")] * 2
        for url in f.urls:
            out = rollout.post(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}})
            assert len(out["output_ids"]) == 3 and out["meta_info"]["weight_version"] == "1"
    finally:
        fleet.stop(f)
