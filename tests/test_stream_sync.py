"""Streaming weight sync: a trainer at TP=2 sends a model many buckets large to a CPU engine bucket by bucket, each
bucket gathered over TP as it goes. Trainer rank 0's resident memory during a sync grows by a bounded amount that
does not depend on the model's size (a deeper model costs nothing more), and the engine ends up serving exactly the
trainer's weights."""
import json

import pytest
import ray
import torch

import convert
import data
import trainer
import transfermesh as tm
from test_trainer import Ranks, _free_port, make_cfg
from test_transfermesh import _EngineProcess, _engine_logprobs, _hf_logprobs

pytestmark = pytest.mark.timeout(1200)

BUCKET_MB = 1.0
LARGEST_MB = 1.5  # the models' largest gathered tensor: linear_fc1, (2 x 768, 256) fp32


class _Ranks(Ranks):
    """Ranks whose processes return every freed tensor to the OS at once (glibc: allocations of 64 KB and more are
    mmapped, not carved from a heap that keeps freed chunks), so their peak RSS (VmHWM) follows live tensors."""

    def __init__(self, cfg, n: int):
        actor = ray.remote(num_cpus=1)(trainer.TrainerWorker).options(
            runtime_env={"env_vars": {"MALLOC_MMAP_THRESHOLD_": "65536"}})
        port = _free_port()
        self.workers = [actor.remote(cfg, r, n, "127.0.0.1", port) for r in range(n)]


def test_buckets_are_cut_from_a_stream_with_one_tensor_of_lookahead():
    """`buckets_with_last` hands a bucket on having read only one tensor past it (a gathered stream never has two
    buckets alive), flags the last bucket once the stream ends, and reads a generator once."""
    read = []

    def stream():
        for i in range(7):
            read.append(i)
            yield f"w{i}", torch.zeros(256)  # 1 KB each

    seen = []
    for bucket, last in tm.buckets_with_last(stream(), bucket_bytes=3 * 1024):
        seen.append(([n for n, _ in bucket], last, len(read)))
    assert seen == [(["w0", "w1", "w2"], False, 4), (["w3", "w4", "w5"], False, 7), (["w6"], True, 7)]


def test_save_hf_dir_writes_shards_as_they_fill_and_transformers_loads_them(tiny_model_dir, tmp_path):
    """A model written from a generator in shards of 100 KB: several `model-0000i-of-0000n.safetensors` files and
    their index, equal tensor for tensor to the source, loaded by transformers; a second save into the same
    directory leaves no shard of the first behind."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    state = load_file(f"{tiny_model_dir}/model.safetensors")
    out = tmp_path / "hf"
    convert.save_hf_dir(((n, t) for n, t in state.items()), out, tiny_model_dir, shard_bytes=100 * 1024)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(shards)
    loaded = convert.load_hf_state(out)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[n], t) for n, t in state.items())
    AutoModelForCausalLM.from_pretrained(str(out))
    shards, nbytes = convert.save_hf_dir(state.items(), out, tiny_model_dir)  # one shard: the plain single file
    assert shards == 1 and [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert nbytes == sum(t.numel() * t.element_size() for t in state.values())


def _model(layers: int) -> str:
    """bench.py's tiny-bench shape (hidden 256, fp32; 3.1 MB a layer, the largest tensor linear_fc1 at 1.5 MB
    gathered), `layers` deep, cached."""
    return data.build_tiny_model(data.default_cache_dir() / f"tiny-bench-{layers}l", hidden_size=256,
                                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                 intermediate_size=768)


def _sync(ranks: _Ranks, path: str, tmp_path) -> list[dict]:
    """Load `path` into the trainer, start an engine on other random weights of the same shape, sync four times
    (the first makes the staging segment and pays first-call costs) and check the engine then serves `path`'s
    weights: greedy logprobs equal transformers' on `path` (a tensor that did not arrive would leave the other
    weights). Returns rank 0's stats of each sync."""
    settings = json.loads((data.Path(path) / "loongsage_tiny.json").read_text())
    other = data.build_tiny_model(tmp_path / f"other-{settings['num_hidden_layers']}", **{**settings, "seed": 7})
    engine = _EngineProcess(other)
    try:
        ranks.call("load_hf", path)
        stats = []
        for version in range(1, 5):
            rank0, rank1 = ranks.call("sync_weights", [engine.url], version)
            assert rank1 == {}  # rank 1 only takes part in the gathers
            stats.append(rank0)
        prompt = data.prompt_ids(data.load_tokenizer(path), {"messages": [{"role": "user", "content": "12+7"}]})
        out, lps, version = _engine_logprobs(engine.url, prompt)
        assert version == "4"
        assert max(abs(a - b) for a, b in zip(lps, _hf_logprobs(path, prompt, out))) < 1e-5
    finally:
        engine.shutdown()
    return stats


@pytest.mark.slow
def test_tp2_sync_streams_and_its_peak_memory_does_not_grow_with_the_model(ray_session, tmp_path):
    """Two models of the same layer shapes, 4 and 8 layers (12.8 and 24.8 MB), synced at TP=2 in 1 MB buckets into
    a CPU engine. Every tensor arrives (`_sync`), in >= model/bucket buckets. The peak extra RSS of trainer rank 0
    during a sync after the first (weights/peak_extra_mb: VmHWM minus RSS before; the least of three, as other
    threads of a Ray worker allocate now and then) is the same for both within 1 MB and at most one bucket + twice
    the largest gathered tensor (its all-gather buffer and its reorder copy) + 1 MB of slack: 5 MB, where gathering
    the whole model on rank 0 (the path before streaming) measured 14.8 MB for the 4-layer model in the same
    setting."""
    ranks = _Ranks(make_cfg(tensor_parallel=2, trainer_workers=2, kl_coef=0.0, transfer="shm", bucket_mb=BUCKET_MB), 2)
    try:
        peaks = {}
        for layers in (4, 8):
            stats = _sync(ranks, _model(layers), tmp_path)
            model_mb = stats[-1]["weights/bytes"] / 2**20
            peaks[layers] = min(s["weights/peak_extra_mb"] for s in stats[1:])
            print(f"\nstreamed sync at TP=2 of {model_mb:.1f} MB ({layers} layers) in {stats[-1]['weights/buckets']} "
                  f"buckets of {BUCKET_MB} MB: peak extra RSS of trainer rank 0 per sync "
                  f"{[round(s['weights/peak_extra_mb'], 2) for s in stats]} MB (the first makes the staging segment)")
            assert stats[-1]["weights/buckets"] >= model_mb / BUCKET_MB
            assert peaks[layers] <= BUCKET_MB + 2 * LARGEST_MB + 1
        assert abs(peaks[8] - peaks[4]) <= 1.0, peaks
    finally:
        ranks.close()
