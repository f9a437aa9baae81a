"""Streaming weight sync: a trainer at TP=2 sends a model many buckets large to a CPU engine bucket by bucket, each
bucket gathered over TP as it goes; trainer rank 0's resident memory grows by about two buckets, never by the model,
and the engine ends up serving exactly the trainer's weights."""
import json

import pytest

import data
from test_trainer import Ranks, make_cfg
from test_transfermesh import _EngineProcess, _engine_logprobs, _hf_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BUCKET_MB = 1.0


def _bench_model() -> str:
    """bench.py's tiny-bench model (13.4 MB of fp32: hidden 256, 4 layers), cached: 13 buckets of 1 MB."""
    return data.build_tiny_model(data.default_cache_dir() / "tiny-bench", hidden_size=256, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768)


def test_tp2_sync_streams_in_buckets_and_installs_every_tensor(ray_session, tmp_path):
    """The engine starts on other random weights of the same architecture; after the trainer's sync its greedy
    logprobs equal transformers' on the trainer's model (a tensor that did not arrive would leave the other weights
    in place). The sync goes out in >= model/bucket buckets, and the peak extra RSS of trainer rank 0 during a sync
    (VmHWM reset before it; the staging segment, two buckets, made by the first sync and kept) stays within two
    buckets plus one gathered tensor's transient, where the whole model gathered on rank 0, as before, would add
    the model's 13 MB."""
    path = _bench_model()
    settings = json.loads((data.Path(path) / "loongsage_tiny.json").read_text())
    other = data.build_tiny_model(tmp_path / "other", **{**settings, "seed": 7})
    engine = _EngineProcess(other)
    ranks = Ranks(make_cfg(tensor_parallel=2, trainer_workers=2, kl_coef=0.0, transfer="shm",
                           bucket_mb=BUCKET_MB, model_path=path), 2)
    try:
        ranks.call("load_hf", path)
        first, none = ranks.call("sync_weights", [engine.url], 1)
        again, _ = ranks.call("sync_weights", [engine.url], 2)
        model_mb = again["weights/bytes"] / 2**20
        largest_mb = max(t.numel() * t.element_size() for _, t in ranks.call("export_hf_weights")[0]) / 2**20
        print(f"\nstreamed sync at TP=2 of {model_mb:.1f} MB in {again['weights/buckets']} buckets of {BUCKET_MB} MB "
              f"(largest HF tensor {largest_mb:.2f} MB): peak extra RSS of trainer rank 0 {first['weights/peak_extra_mb']:.2f}"
              f" MB on the first sync (it makes the staging segment), {again['weights/peak_extra_mb']:.2f} MB after")
        assert none == {}  # rank 1 only takes part in the gathers
        assert again["weights/buckets"] >= model_mb / BUCKET_MB
        assert again["weights/peak_extra_mb"] <= 2 * BUCKET_MB + 2 * largest_mb
        assert again["weights/peak_extra_mb"] < model_mb / 2
        prompt = data.prompt_ids(data.load_tokenizer(path), {"messages": [{"role": "user", "content": "12+7"}]})
        out, lps, version = _engine_logprobs(engine.url, prompt)
        assert version == "2"
        assert max(abs(a - b) for a, b in zip(lps, _hf_logprobs(path, prompt, out))) < 1e-5
    finally:
        ranks.close()
        engine.shutdown()
