"""TransferMesh: buckets, checksums, and every CPU transport into a real CPU engine over HTTP;
then the end-to-end promise: after a sync, engine logprobs equal trainer logprobs."""
import json

import httpx
import pytest
import torch

import data
import rollout
import transfermesh as tm


def test_buckets_respect_the_size_and_keep_order():
    ts = [(f"w{i}", torch.zeros(256)) for i in range(10)]  # 1 KiB each
    buckets = list(tm.iter_buckets(ts, bucket_bytes=3 * 1024))
    assert [len(b) for b in buckets] == [3, 3, 3, 1]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in ts]
    big = [("small", torch.zeros(4)), ("huge", torch.zeros(10_000)), ("small2", torch.zeros(4))]
    assert [[n for n, _ in b] for b in tm.iter_buckets(big, bucket_bytes=1024)] == [["small"], ["huge"], ["small2"]]


def test_flatten_roundtrip_mixed_dtypes_and_checksum():
    ts = [("a", torch.randn(3, 5)), ("b", torch.randn(7).bfloat16()), ("c", torch.arange(6, dtype=torch.int64).view(2, 3))]
    flat, metas = tm.flatten_bucket(ts)
    assert all(off % 64 == 0 for *_, off in metas)
    for (n, t), (m, u) in zip(ts, tm.unflatten_bucket(flat, metas)):
        assert n == m and u.dtype == t.dtype and torch.equal(u, t)
    tm.verify_checksum(flat, tm.checksum(flat))
    flat[3] ^= 1
    with pytest.raises(ValueError, match="checksum mismatch"):
        tm.verify_checksum(flat, tm.checksum(flat) + 1)


def test_pick_transport():
    assert tm.pick_transport("http://127.0.0.1:3000", "auto") == "shm"
    assert tm.pick_transport("http://10.1.2.3:3000", "auto") == "broadcast"
    assert tm.pick_transport("http://127.0.0.1:3000", "disk") == "disk"
    with pytest.raises(ValueError, match="choose one of"):
        tm.pick_transport("http://127.0.0.1:3000", "carrier_pigeon")


@pytest.fixture(scope="module")
def other_model(tiny_model_dir, tmp_path_factory):
    """Same architecture as the tiny model, other random weights: what a sync must install."""
    settings = json.loads((data.Path(tiny_model_dir) / "loongsage_tiny.json").read_text())
    return data.build_tiny_model(tmp_path_factory.mktemp("other"), **{**settings, "seed": 99})


def _engine_logprobs(url, ids):
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 5},
                                            "return_logprob": True}, timeout=60).json()
    return r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]], r["meta_info"]["weight_version"]


def _hf_logprobs(path, prompt, out_ids):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path).eval()
    x = torch.tensor([prompt + out_ids])
    with torch.no_grad():
        logp = torch.log_softmax(m(x).logits[0, :-1].float(), -1)  # (T-1, V) next-token logprobs
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out_ids)]


@pytest.mark.parametrize("transport", ["shm", "broadcast", "disk"])
def test_each_transport_installs_the_weights(transport, tiny_model_dir, other_model):
    from safetensors.torch import load_file
    url, handle = rollout.serve(tiny_model_dir, max_batch=4, max_len=128)
    try:
        prompt = data.prompt_ids(data.load_tokenizer(tiny_model_dir), {"messages": [{"role": "user", "content": "3+4"}]})
        before, _, v0 = _engine_logprobs(url, prompt)
        assert v0 == "0"
        new = sorted(load_file(f"{other_model}/model.safetensors").items())
        stats = tm.push_weights(new, [url], version=7, transport=transport, bucket_mb=0.05, config_dir=other_model)
        assert stats["weights/version"] == 7 and stats["weights/bytes"] >= sum(t.numel() * 4 for _, t in new)
        if transport != "disk":  # buckets, never one round-trip per parameter
            assert 1 < stats["weights/buckets"] < len(new)
        out, lps, v = _engine_logprobs(url, prompt)
        assert v == "7"
        ref = _hf_logprobs(other_model, prompt, out)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-5
        assert not httpx.get(url + "/health", timeout=10).is_error  # engine still serving, unpaused
    finally:
        handle.shutdown()


def test_trainer_to_engine_sync_gives_equal_logprobs(tiny_model_dir, tmp_path):
    """The promise of weight sync: after a train step and a sync, the engine's logprobs of its own
    sampled tokens equal the trainer's logprobs of the same tokens (fp32)."""
    import ray
    import loongsage
    import trainer
    cfg = loongsage.load_config(None, [f"model_path={tiny_model_dir}", "prompts_per_step=2", "samples_per_prompt=4",
                                       "global_batch_size=8", "micro_batch_size=8", "lr=1e-2", f"output_dir={tmp_path}"])
    ray.init(num_cpus=2, include_dashboard=False)
    url, handle = rollout.serve(tiny_model_dir, max_batch=8, max_len=128, seed=3)
    try:
        w = ray.remote(trainer.TrainerWorker).remote(cfg, 0, 1, "127.0.0.1", tm.free_port())
        ray.get(w.load_hf.remote(tiny_model_dir))
        tok = data.load_tokenizer(tiny_model_dir)
        prompts = [data.prompt_ids(tok, s) for s in data.arith_samples(2, 0)]
        batch = []
        for g, p in enumerate(prompts):
            for i in range(4):
                r = httpx.post(url + "/generate", json={"input_ids": p, "return_logprob": True, "sampling_params": {
                    "temperature": 1.0, "max_new_tokens": 6}}, timeout=60).json()
                n = len(r["output_ids"])
                batch.append({"prompt_ids": p, "response_ids": r["output_ids"], "loss_mask": [1] * n,
                              "rollout_logprobs": [x[0] for x in r["meta_info"]["output_token_logprobs"]],
                              "weight_versions": [0] * n, "reward": float(i % 2), "status": "ok", "group_id": g,
                              "sample_index": i})
        metrics = ray.get(w.train_step.remote(batch, 0))
        assert metrics["train/gap_max"] < 1e-4  # step 0: same weights on both sides
        ray.get(w.sync_weights.remote([url], 1))
        fresh = []  # the engine samples anew under the synced weights
        for t in batch:
            r = httpx.post(url + "/generate", json={"input_ids": t["prompt_ids"], "return_logprob": True,
                                                    "sampling_params": {"temperature": 1.0, "max_new_tokens": 6}},
                           timeout=60).json()
            assert r["meta_info"]["weight_version"] == "1"
            fresh.append({**t, "response_ids": r["output_ids"], "loss_mask": [1] * len(r["output_ids"]),
                          "rollout_logprobs": [x[0] for x in r["meta_info"]["output_token_logprobs"]]})
        trainer_lp = ray.get(w.compute_logprobs.remote(fresh))
        diffs = [abs(a - b) for t, lp in zip(fresh, trainer_lp) for a, b in zip(lp, t["rollout_logprobs"])]
        assert len(diffs) == sum(len(t["response_ids"]) for t in fresh) and max(diffs) < 1e-5
        # and the step really changed the policy: the old rollout logprobs no longer match
        old_lp = ray.get(w.compute_logprobs.remote(batch))
        assert max(abs(a - b) for t, lp in zip(batch, old_lp) for a, b in zip(lp, t["rollout_logprobs"])) > 1e-4
    finally:
        handle.shutdown()
        ray.shutdown()


def test_every_transport_reaches_every_engine(tiny_model_dir, other_model):
    """Two engines: a broadcast group of three ranks (this process + both engines), shared memory read by both,
    and the broadcast group reused for a second sync. After each push BOTH engines give the pushed model's
    logprobs and report the pushed version (a rank offset or a bucket that reached only one engine shows)."""
    from safetensors.torch import load_file
    started = [rollout.serve(tiny_model_dir, max_batch=4, max_len=128, seed=i) for i in range(2)]
    urls = [url for url, _ in started]
    prompt = data.prompt_ids(data.load_tokenizer(tiny_model_dir), {"messages": [{"role": "user", "content": "12+7"}]})
    other = sorted(load_file(f"{other_model}/model.safetensors").items())
    tiny = sorted(load_file(f"{tiny_model_dir}/model.safetensors").items())

    def check(model_dir, version):
        for url in urls:
            out, lps, v = _engine_logprobs(url, prompt)
            assert v == str(version)
            assert max(abs(a - b) for a, b in zip(lps, _hf_logprobs(model_dir, prompt, out))) < 1e-5, url

    try:
        stats = tm.push_weights(other, urls, version=3, transport="broadcast", bucket_mb=0.05)
        assert stats["weights/buckets"] > 1
        check(other_model, 3)
        tm.push_weights(tiny, urls, version=4, transport="shm", bucket_mb=0.05)
        check(tiny_model_dir, 4)
        tm.push_weights(other, urls, version=5, transport="broadcast", bucket_mb=0.05)  # the group, reused
        check(other_model, 5)
    finally:
        for _, handle in started:
            handle.shutdown()
