"""TransferMesh: buckets, checksums, and every CPU transport into a real CPU engine over HTTP;
then the end-to-end promise: after a sync, engine logprobs equal trainer logprobs."""
import concurrent.futures
import json
import time

import httpx
import pytest
import torch

import cpu_engine
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


def test_flatten_roundtrip_in_sglangs_packed_layout():
    ts = [("a", torch.randn(3, 5)), ("b", torch.randn(7).bfloat16()), ("c", torch.randn(2, 3).bfloat16())]
    flat, metas = tm.flatten_bucket(ts)
    # SGLang's flattened_bucket: back to back, no padding
    assert [off for *_, off in metas] == [0, 60, 74] and flat.numel() == 60 + 14 + 12
    for (n, t), (m, u) in zip(ts, tm.unflatten_bucket(flat, metas)):
        assert n == m and u.dtype == t.dtype and torch.equal(u, t)
    # an offset that is not a multiple of the dtype size is what SGLang's receiver refuses ...
    with pytest.raises(ValueError, match="Unaligned received tensor 'd': offset 14"):
        tm.packed_layout(["c", "d"], ["bfloat16", "float32"], [[7], [2]])
    # ... so the sender starts a new bucket instead of misaligning a tensor
    mixed = [("h", torch.zeros(3, dtype=torch.bfloat16)), ("f", torch.zeros(2)), ("g", torch.zeros(2))]
    assert [[n for n, _ in b] for b in tm.iter_buckets(mixed, bucket_bytes=1 << 20)] == [["h"], ["f", "g"]]


def test_checksum_sees_flips_swaps_and_shifts():
    flat = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    ref = tm.checksum(flat)
    flipped = flat.clone()
    flipped[1234] ^= 1 << 5
    swapped = torch.cat([flat[2048:], flat[:2048]])            # two chunks swapped: same bytes, same byte sum
    shifted = torch.roll(flat, 4)                               # every byte moved by one float32
    for bad in (flipped, swapped, shifted):
        assert tm.checksum(bad) != ref
    with pytest.raises(ValueError, match="checksum mismatch"):
        tm.verify_checksum(swapped, ref)
    tm.verify_checksum(flat.clone(), ref)
    # big buffers: one checksum per chunk, in order, so swapping two whole chunks is caught as well
    big = torch.randint(0, 256, (2 * tm.CHECKSUM_CHUNK,), dtype=torch.uint8)
    big_swapped = torch.cat([big[tm.CHECKSUM_CHUNK:], big[:tm.CHECKSUM_CHUNK]])
    assert len(tm.checksum(big)) == 2 and tm.checksum(big_swapped) != tm.checksum(big)


def _roundtrip(bucket, half=0):
    """A bucket written as _push_shm writes it, then read back as the CPU engine reads SGLang's payload."""
    flat, metas, sums = tm.write_shm_bucket(bucket, half=half)
    return flat, tm.read_tensor_payload(tm.tensor_payloads(flat, metas, 1)[0], "flattened_bucket", sums)


def test_shm_segment_is_reused_and_every_bucket_reads_back_its_own_bytes():
    """The sender reuses one shared segment for every bucket, the receiver keeps its mapping of it: each read must
    still see the bucket just written, not a copy of an earlier one, and a grown segment must be mapped afresh.
    Also: a payload whose metadata reaches past its tensor is refused with a clear error."""
    tm.release_shm()  # start from no segment: an earlier test in this process may have grown one past `grown`
    first = [("a", torch.randn(1000)), ("b", torch.randn(10))]
    second = [("a", torch.randn(1000)), ("b", torch.randn(10))]           # same layout, other bytes
    flat1, got1 = _roundtrip(first)
    got1 = [(n, t.clone()) for n, t in got1]
    flat2, got2 = _roundtrip(second)
    assert flat2.untyped_storage().data_ptr() == flat1.untyped_storage().data_ptr()  # the same segment, reused
    for (n, t), (m, u), (_, v) in zip(first, got1, got2):
        assert n == m and torch.equal(u, t)
    assert all(torch.equal(t, v) for (_, t), (_, v) in zip(second, got2))
    # the two halves: a bucket in half 1 leaves the one in half 0 intact (the sender writes the next bucket while
    # receivers still read the previous one)
    flat_h1, got_h1 = _roundtrip(first, half=1)
    assert flat_h1.storage_offset() % 4096 == 0 and flat_h1.storage_offset() > 0
    assert all(torch.equal(t, v) for (_, t), (_, v) in zip(second, got2))
    assert all(torch.equal(t, v) for (_, t), (_, v) in zip(first, got_h1))
    grown = [("big", torch.randn(50_001))]                                # larger than the segment: a new one
    flat3, got3 = _roundtrip(grown)
    assert flat3.untyped_storage().data_ptr() != flat1.untyped_storage().data_ptr()
    assert torch.equal(got3[0][1], grown[0][1])
    # sized for a 200,004-byte bucket, the second half still starts where a float64 view may begin
    odd = [("x", torch.randn(3, dtype=torch.float64)), ("y", torch.tensor([1], dtype=torch.uint8))]
    assert all(torch.equal(t, v) for (_, t), (_, v) in zip(odd, _roundtrip(odd, half=1)[1]))
    flat, metas, sums = tm.write_shm_bucket(grown)
    lying = [["big", "float32", [10**7], 0]]                              # 40 MB claimed of a 200 KB tensor
    with pytest.raises(ValueError, match="cut the tensor into named tensors"):
        tm.read_tensor_payload(tm.tensor_payloads(flat, lying, 1)[0], "flattened_bucket")


def test_shm_checksum_hashed_while_copying_equals_the_checksum_of_the_bytes():
    """write_shm_bucket hashes each piece right after copying it (one pass over memory). Its checksum list must be
    exactly checksum() of the bucket's bytes: tensors that straddle HASH_STEP and CHECKSUM_CHUNK boundaries, a
    bucket whose last chunk is partial, one that ends exactly on a chunk boundary, one tiny tensor, mixed dtypes."""
    step, chunk = tm.HASH_STEP, tm.CHECKSUM_CHUNK
    assert chunk % step == 0  # a piece never crosses a chunk boundary only if chunks are whole steps
    torch.manual_seed(0)
    buckets = [
        [("a", torch.randn(step // 4 + 3)), ("b", torch.randn(chunk // 4)), ("c", torch.randn(5).bfloat16())],
        [("a", torch.randn(chunk // 4)), ("b", torch.randn(chunk // 4))],               # ends on a chunk boundary
        [("a", torch.randn(3, 1)), ("b", torch.randint(0, 9, (7,), dtype=torch.int16))],  # far below one step
    ]
    for bucket in buckets:
        flat, metas, sums = tm.write_shm_bucket(bucket, half=1)
        assert sums == tm.checksum(tm.flatten_bucket(bucket)[0])
        assert len(sums) == max(1, -(-flat.numel() // chunk))
        got = tm.read_tensor_payload(tm.tensor_payloads(flat, metas, 1)[0], "flattened_bucket", sums)
        assert all(torch.equal(t, u) for (_, t), (_, u) in zip(bucket, got))


_SENDER = """
import sys, json, torch
sys.path.insert(0, {root!r})
import transfermesh as tm
bucket = [("w", torch.arange(12.0).reshape(3, 4)), ("b", torch.arange(5, dtype=torch.bfloat16))]
flat, metas, sums = tm.write_shm_bucket(bucket)
print(json.dumps([tm.tensor_payloads(flat, metas, 1)[0], sums]), flush=True)
sys.stdin.readline()  # keep the segment until the reader is done, as _push_shm does until the engine answers
"""


def test_a_bucket_crosses_to_an_unrelated_process_without_a_copy():
    """The shm payload opens in a process that the sender did not start (an engine launched by Ray or by hand):
    torch's file_system sharing, where the default file_descriptor strategy authenticates with the sender's
    multiprocessing authkey and fails there. The receiver's tensors are views of the sender's memory."""
    import subprocess
    import sys
    from pathlib import Path
    script = _SENDER.format(root=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        payload, sums = json.loads(proc.stdout.readline())
        got = dict(tm.read_tensor_payload(payload, "flattened_bucket", sums))
        assert torch.equal(got["w"], torch.arange(12.0).reshape(3, 4))
        assert got["b"].dtype == torch.bfloat16 and torch.equal(got["b"], torch.arange(5, dtype=torch.bfloat16))
        assert got["w"].is_shared()  # a view of the mapped segment, not a copy
    finally:
        proc.communicate("done\n", timeout=60)
    assert proc.returncode == 0


def test_the_receiver_refuses_what_sglangs_refuses():
    """The CPU engine's reader refuses what SGLang 0.5.23 refuses: a string that is not base64 (the JSON
    descriptor of earlier versions: SGLang answers 400 "Expected base64-encoded bytes"), a pickle naming a global
    outside SGLang's SafeUnpickler allow-list, and a load_format it has no loader for."""
    import base64
    import pickle
    desc = json.dumps({"shm": "loongsage_1_ab", "offset": 0, "size": 4, "tensors": [["w", "float32", [1], 0]]})
    with pytest.raises(ValueError, match="Expected base64-encoded bytes"):
        tm.read_tensor_payload(desc, "flattened_bucket")
    # builtins.exec: not in the allow-list (not print, which a process running Ray has replaced with Ray's own)
    evil = base64.b64encode(pickle.dumps(exec)).decode()
    with pytest.raises(ValueError, match=r"Blocked unsafe global \(builtins.exec\)"):
        tm.read_tensor_payload(evil, "flattened_bucket")
    flat, metas, _ = tm.write_shm_bucket([("w", torch.ones(2))])
    with pytest.raises(ValueError, match="load_format 'direct' is not one the CPU engine loads"):
        tm.read_tensor_payload(tm.tensor_payloads(flat, metas, 1)[0], "direct")
    pairs = base64.b64encode(pickle.dumps([("w", torch.ones(2))])).decode()  # load_format null: (name, tensor) pairs
    assert torch.equal(dict(tm.read_tensor_payload(pairs, None))["w"], torch.ones(2))


def test_broadcast_ranks_count_every_tp_rank():
    # trainer = rank 0; engine A (tp 2) holds ranks 1-2, engine B (tp 1) rank 3, engine C (tp 4) ranks 4-7
    assert tm.broadcast_ranks([("a", 2), ("b", 1), ("c", 4)]) == ([1, 3, 4], 8)
    assert tm._engines(["http://x", ("http://y", 2)]) == [("http://x", 1), ("http://y", 2)]
    with pytest.raises(ValueError, match="tp_size 0"):
        tm._engines([("http://y", 0)])


def test_cuda_ipc_payload_has_one_entry_per_tp_rank():
    """SGLang's rank r deserializes serialized_named_tensors[r]: a TP=2 engine needs two entries, each the
    whole bucket (built here from CPU tensors: the same code path, shared-memory handles instead of CUDA's)."""
    import pickle

    import torch.multiprocessing as mp
    bucket = [("w", torch.randn(4, 3)), ("b", torch.randn(3))]
    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")  # like CUDA IPC handles, a named segment can be opened by every rank
    try:
        payload = tm.cuda_ipc_payloads(bucket, tp_size=2)
    finally:
        mp.set_sharing_strategy(old)
    assert len(payload) == 2
    for entry in payload:
        got = pickle.loads(__import__("base64").b64decode(entry))
        assert [n for n, _ in got] == ["w", "b"] and all(torch.equal(a, b) for (_, a), (_, b) in zip(got, bucket))


def test_pick_transport():
    assert tm.pick_transport("http://127.0.0.1:3000", "auto") == "shm"
    assert tm.pick_transport("http://10.1.2.3:3000", "auto") == "broadcast"
    # on another Ray node (fleet.off_node): a broadcast, even where its URL is this machine's; forcing still forces
    assert tm.pick_transport("http://127.0.0.1:3000", "auto", remote=True) == "broadcast"
    assert tm.pick_transport("http://127.0.0.1:3000", "shm", remote=True) == "shm"
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


def push_and_flush(named, urls, **kw):
    """push_weights, then /flush_cache as the controller does after every push (fleet.update_engines): the updates
    keep the engines' prefix cache (flush_cache false), so a prompt served before would run over the old K/V."""
    stats = tm.push_weights(named, urls, **kw)
    for url in urls:
        rollout.post(url, "/flush_cache")
    return stats


class _EngineProcess:
    """A CPU engine in a process of its own (`python cpu_engine.py`), as Ray runs one: a broadcast group is one
    rank per process (torch registers a group's name once per process, as SGLang's TP ranks do). `flags`: more of
    cpu_engine.py's flags (e.g. --enable-lora). `wait=False`: started, not yet waited for (`ready()`), so several
    engines load at once."""

    def __init__(self, model_dir, seed=0, flags=(), wait=True):
        import subprocess
        import sys
        from pathlib import Path
        port = tm.free_port()
        self.proc = subprocess.Popen([sys.executable, "cpu_engine.py", "--model-path", str(model_dir), "--port",
                                      str(port), "--max-batch", "4", "--max-len", "128", "--seed", str(seed), *flags],
                                     cwd=str(Path(__file__).resolve().parents[1]), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        if wait:
            self.ready()

    def ready(self) -> "_EngineProcess":
        rollout.wait_healthy(self.url, timeout=180, proc=self.proc)
        return self

    def shutdown(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


# shm in the quick tier; each transport starts an engine process of its own
@pytest.mark.parametrize("transport", ["shm", pytest.param("broadcast", marks=pytest.mark.slow),
                                       pytest.param("disk", marks=pytest.mark.slow)])
def test_each_transport_installs_the_weights(transport, tiny_model_dir, other_model):
    from safetensors.torch import load_file
    handle = _EngineProcess(tiny_model_dir)
    url = handle.url
    try:
        prompt = data.prompt_ids(data.load_tokenizer(tiny_model_dir), {"messages": [{"role": "user", "content": "3+4"}]})
        before, _, v0 = _engine_logprobs(url, prompt)
        assert v0 == "0"
        new = sorted(load_file(f"{other_model}/model.safetensors").items())
        stats = push_and_flush(new, [url], version=7, transport=transport, bucket_mb=0.05, config_dir=other_model)
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


@pytest.mark.slow
def test_trainer_to_engine_sync_gives_equal_logprobs(ray_session, tiny_model_dir, tmp_path):
    """The promise of weight sync: after a train step and a sync, the engine's logprobs of its own
    sampled tokens equal the trainer's logprobs of the same tokens (fp32)."""
    import ray
    import config
    import trainer
    cfg = config.load_config(None, [f"model_path={tiny_model_dir}", "prompts_per_step=2", "samples_per_prompt=4",
                                    "global_batch_size=8", "micro_batch_size=8", "lr=1e-2", f"output_dir={tmp_path}"])
    # the engine in a process of its own, as in a run: this process also sends shared memory in other tests, and a
    # process that has mapped a segment of a sender that later exits cannot allocate through torch's shm manager
    handle = _EngineProcess(tiny_model_dir, seed=3)
    url = handle.url
    w = None
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
        rollout.post(url, "/flush_cache")  # as the controller does after a push: no prompt K/V of the old weights
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
        if w is not None:
            ray.kill(w)


@pytest.mark.slow
def test_every_transport_reaches_every_engine(tiny_model_dir, other_model):
    """Two engines: a broadcast group of three ranks (this process + both engines), shared memory read by both,
    and the broadcast group reused for a second sync. After each push BOTH engines give the pushed model's
    logprobs and report the pushed version (a rank offset or a bucket that reached only one engine shows)."""
    from safetensors.torch import load_file
    started = [h.ready() for h in [_EngineProcess(tiny_model_dir, seed=i, wait=False) for i in range(2)]]
    urls = [e.url for e in started]
    prompt = data.prompt_ids(data.load_tokenizer(tiny_model_dir), {"messages": [{"role": "user", "content": "12+7"}]})
    other = sorted(load_file(f"{other_model}/model.safetensors").items())
    tiny = sorted(load_file(f"{tiny_model_dir}/model.safetensors").items())

    def check(model_dir, version):
        for url in urls:
            out, lps, v = _engine_logprobs(url, prompt)
            assert v == str(version)
            assert max(abs(a - b) for a, b in zip(lps, _hf_logprobs(model_dir, prompt, out))) < 1e-5, url

    try:
        stats = push_and_flush(other, urls, version=3, transport="broadcast", bucket_mb=0.05)
        assert stats["weights/buckets"] > 1
        check(other_model, 3)
        push_and_flush(tiny, urls, version=4, transport="shm", bucket_mb=0.05)
        check(tiny_model_dir, 4)
        push_and_flush(other, urls, version=5, transport="broadcast", bucket_mb=0.05)  # the group, reused
        check(other_model, 5)
    finally:
        for e in started:
            e.shutdown()


def test_a_new_engine_set_gets_a_new_broadcast_group_and_the_old_one_goes(tiny_model_dir, other_model):
    """After an engine is re-created the broadcast push meets a new engine set. Its group gets a new name (torch,
    and so the engine that stayed, refuses a second group of one name) and the old group is destroyed on the engine
    that stayed, on the one replaced (still up here) and on this side, before the new one is built: the push lands
    on both engines of the new set, each holding exactly the new group."""
    from safetensors.torch import load_file
    handles = [h.ready() for h in [_EngineProcess(tiny_model_dir, seed=i, wait=False) for i in range(3)]]
    a, b, c = [h.url for h in handles]
    other = sorted(load_file(f"{other_model}/model.safetensors").items())

    def groups(i):
        return rollout.get(handles[i].url, "/server_info")["internal_states"][0]["weight_update_groups"]

    try:
        tm.push_weights(other, [a, b], version=1, transport="broadcast", bucket_mb=0.05)
        first = groups(0)
        assert len(first) == 1 and groups(1) == first
        tm.push_weights(other, [a, c], version=2, transport="broadcast", bucket_mb=0.05)  # b was "re-created" as c
        assert len(groups(0)) == 1 and groups(0) == groups(2) != first and groups(1) == []
        assert [name for name, _ in tm._BROADCAST_GROUPS.values()] == groups(0)
        assert [rollout.get(u, "/get_weight_version")["weight_version"] for u in (a, b, c)] == ["2", "1", "2"]
    finally:
        for handle in handles:
            handle.shutdown()


def test_no_kv_outlives_its_weights_across_the_controllers_update(tiny_model_dir, other_model):
    """fleet.update_engines around a push, as sync_engines runs it. A prompt served before the update and sent
    again after is computed on the new weights only, exactly as an engine started on them computes it (no prefix
    of the old weights' K/V is reused); a request in flight across the update goes on over K/V the new weights
    recomputed: its tokens after the update are the new model's greedy continuation of all it had before."""
    import config
    import fleet
    from safetensors.torch import load_file
    (url, handle), (ref_url, ref) = (cpu_engine.serve(m, max_batch=4, max_len=512, seed=0)
                                     for m in (tiny_model_dir, other_model))
    prompt = data.prompt_ids(data.load_tokenizer(tiny_model_dir), {"messages": [{"role": "user", "content": "12+7"}]})
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    try:
        before = rollout.post(url, "/generate", {"input_ids": prompt, "sampling_params": greedy})
        long = concurrent.futures.ThreadPoolExecutor(1).submit(rollout.post, url, "/generate", {
            "input_ids": [3, 4, 5], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}})
        while not handle.engine.state()["num_running_reqs"]:
            time.sleep(0.01)
        cfg = config.Config()
        f = fleet.Fleet(pg=None, plan={}, where=[], urls=[url])
        fleet.update_engines(cfg, f, [url], lambda: tm.push_weights(
            sorted(load_file(f"{other_model}/model.safetensors").items()), [url], version=1, transport="shm"))
        after = rollout.post(url, "/generate", {"input_ids": prompt, "sampling_params": greedy, "return_logprob": True})
        want = rollout.post(ref_url, "/generate", {"input_ids": prompt, "sampling_params": greedy,
                                                   "return_logprob": True})
        assert before["output_ids"] != after["output_ids"] == want["output_ids"]
        lps = [[lp for lp, _, _ in x["meta_info"]["output_token_logprobs"]] for x in (after, want)]
        assert max(abs(a - b) for a, b in zip(*lps)) <= 1e-5  # (its decode steps share a batch with `long`)
        out = long.result(timeout=120)
        k = out["meta_info"]["weight_versions"][0]["end"]
        assert 0 < k < 400 and out["meta_info"]["weight_versions"][1] == {"version": "1", "start": k, "end": 400}
        cont = rollout.post(ref_url, "/generate", {"input_ids": [3, 4, 5] + out["output_ids"][:k], "sampling_params": {
            "temperature": 0, "max_new_tokens": 400 - k, "ignore_eos": True}})
        assert out["output_ids"][k:] == cont["output_ids"]
    finally:
        handle.shutdown()
        ref.shutdown()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=4, max_len=128)
    yield url
    handle.shutdown()


def _shm_bucket(named):
    """A bucket as _push_shm sends it: (flat view of the shared segment, SGLang payload entry, checksum)."""
    flat, metas, sums = tm.write_shm_bucket(named)
    return flat, tm.tensor_payloads(flat, metas, 1)[0], sums


def test_updates_outside_a_session_are_refused_as_sglang_does(engine, tiny_model_dir):
    from safetensors.torch import load_file
    named = sorted(load_file(f"{tiny_model_dir}/model.safetensors").items())[:2]
    flat, payload, sums = _shm_bucket(named)
    body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket", "checksum": sums}
    r = httpx.post(engine + "/update_weights_from_tensor", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["success"] is False
    assert r.json()["message"] == ("update_weights_from_tensor must run between begin_weight_update() and "
                                   "end_weight_update()")
    r = httpx.post(engine + "/update_weights_from_distributed", json={"names": [], "dtypes": [], "shapes": []},
                   timeout=30)
    assert r.status_code == 400 and "update_weights_from_distributed must run between" in r.json()["message"]
    # inside a session the same bucket loads (entry 0 = this engine's TP rank); afterwards it is refused again
    rollout.post(engine, "/begin_weight_update", {"selector": "all"})
    assert rollout.post(engine, "/update_weights_from_tensor", body)["message"] == "Loaded 2 tensors."
    # a second payload of the same bytes: every dump is one reference on the segment, every load gives one back
    body["serialized_named_tensors"] = [_shm_bucket(named)[1]]
    assert rollout.post(engine, "/update_weights_from_tensor", body)["message"] == "Loaded 2 tensors."
    rollout.post(engine, "/end_weight_update", {})
    assert httpx.post(engine + "/update_weights_from_tensor", json=body, timeout=30).status_code == 400


@pytest.mark.parametrize("corruption", ["flipped_bit", "swapped_chunks", "shifted_buffer"])
def test_engine_refuses_a_corrupted_bucket_and_keeps_its_weights(corruption, engine, other_model):
    """The receiving side verifies the checksum the sender wrote: a bucket corrupted after it was checksummed is
    refused with a clear error, and the engine keeps serving its old weights and version."""
    from safetensors.torch import load_file
    prompt = [5, 6, 7, 8, 9]
    before_ids, before_lp, v0 = _engine_logprobs(engine, prompt)
    named = sorted(load_file(f"{other_model}/model.safetensors").items())  # every weight, one bucket
    tm.release_shm()  # a segment of this bucket's size: the corruptions below stay inside it
    flat, payload, sums = _shm_bucket(named)
    if corruption == "flipped_bit":
        flat[flat.numel() // 3] ^= 1 << 2
    elif corruption == "swapped_chunks":  # two 4 KiB chunks trade places: the same bytes, reordered
        a, b = flat[4096:8192].clone(), flat[8192:12288].clone()
        flat[4096:8192], flat[8192:12288] = b, a
    else:
        flat.copy_(torch.roll(flat.clone(), 4))  # every byte one float32 later
    rollout.post(engine, "/begin_weight_update", {"selector": "all"})
    r = httpx.post(engine + "/update_weights_from_tensor", json={
        "serialized_named_tensors": [payload], "load_format": "flattened_bucket", "checksum": sums,
        "weight_version": "9", "flush_cache": False}, timeout=60)
    rollout.post(engine, "/end_weight_update", {})
    assert r.status_code == 400
    assert "checksum mismatch" in r.text and "keeps its old weights" in r.text
    after_ids, after_lp, v1 = _engine_logprobs(engine, prompt)
    assert (after_ids, after_lp, v1) == (before_ids, before_lp, v0)


def test_pause_and_continue_are_separate_calls(engine):
    tm.pause_engines([engine])
    assert rollout.get(engine, "/get_server_info")["internal_states"][0]["paused"] is True
    tm.continue_engines([engine])
    assert rollout.get(engine, "/get_server_info")["internal_states"][0]["paused"] is False


def test_shm_sync_to_a_tp2_engine_sends_one_entry_per_rank(engine, other_model, monkeypatch):
    from safetensors.torch import load_file
    sent = []
    real_post = tm._post
    monkeypatch.setattr(tm, "_post", lambda url, path, payload: (sent.append((path, payload)), real_post(url, path, payload))[1])
    new = sorted(load_file(f"{other_model}/model.safetensors").items())
    try:
        stats = tm.push_weights(new, [(engine, 2)], version=5, transport="shm", bucket_mb=0.05)
        updates = [p for path, p in sent if path == "/update_weights_from_tensor"]
        assert len(updates) == stats["weights/buckets"] > 1
        assert all(len(p["serialized_named_tensors"]) == 2 and p["load_format"] == "flattened_bucket" for p in updates)
        # only the last bucket sets the version; the whole sync sits inside one session
        assert [p.get("weight_version") for p in updates] == [None] * (len(updates) - 1) + ["5"]
        assert [path for path, _ in sent][0] == "/begin_weight_update" and sent[-1][0] == "/end_weight_update"
        assert _engine_logprobs(engine, [5, 6, 7])[2] == "5"
    finally:
        rollout.post(engine, "/update_weights_from_disk", {"model_path": str(other_model), "weight_version": "0"})


def test_a_partial_update_reaches_the_packed_weights(tiny_model_dir, other_model):
    """The engine multiplies by packed copies of its weights; an update of a few tensors (a fused q|k|v part, an
    MLP projection, the tied embedding/LM head) must reach them: logprobs then equal transformers' on the same
    mixed weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    other = load_file(f"{other_model}/model.safetensors")
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"]
    engine = cpu_engine.CpuEngine(tiny_model_dir, max_batch=2, max_len=64).start()
    try:
        engine.load_weights([(n, other[n]) for n in names], version="2")
        out = engine.generate([[5, 6, 7, 8]], {"temperature": 0, "max_new_tokens": 6})[0]
    finally:
        engine.stop()
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        for n in names:
            ref.get_parameter(n).copy_(other[n])
        x = torch.tensor([[5, 6, 7, 8] + out["output_ids"]])
        logp = torch.log_softmax(ref(x).logits[0, 3:-1].float(), -1)                  # (6, V)
    want = logp.gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert out["meta_info"]["weight_version"] == "2" and (got - want).abs().max() <= 1e-5


# What SGLang 0.5.23's SafeUnpickler lets a serialized_named_tensors entry name (a subset of its ALLOWED_GLOBALS,
# utils/common.py): anything else and every TP rank refuses the update.
SGLANG_ALLOWED = {("builtins", "list"), ("builtins", "tuple"), ("builtins", "str"), ("torch", "Tensor"),
                  ("torch", "Size"), ("torch", "float32"), ("torch", "bfloat16"), ("torch", "UntypedStorage"),
                  ("torch.storage", "UntypedStorage"), ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")}


def test_cuda_ipc_payloads_are_one_dump_per_rank_with_device_uuids(monkeypatch):
    """The CUDA IPC payload as SGLang's TP ranks read it. Only torch's CUDA-only pieces are replaced (the CUDA
    reduction of a tensor, which calls storage._share_cuda_(), and the device's UUID); the builder runs as is."""
    import io
    import pickle

    from torch.multiprocessing import reductions
    calls = []

    def cuda_reduce(t):  # the shape of torch's reduction of a CUDA tensor: rebuild_cuda_tensor and 15 arguments
        calls.append(t)
        return reductions.rebuild_cuda_tensor, (torch.Tensor, t.shape, t.stride(), 0, torch.UntypedStorage, t.dtype,
                                                0, b"ipc-handle", t.numel() * 4, 0, False, b"ref", 0, b"event", True)
    monkeypatch.setattr(reductions, "reduce_tensor", cuda_reduce)
    monkeypatch.setattr(tm, "_device_uuid", lambda index: f"GPU-uuid-of-{index}")
    bucket = [("w", torch.randn(4, 3)), ("b", torch.randn(3).bfloat16())]
    payload = tm.cuda_ipc_payloads(bucket, tp_size=2)
    assert len(payload) == 2 and len(calls) == 4  # one dump per TP rank: each rank's handles are its own

    class Recorder(pickle.Unpickler):
        seen = set()

        def find_class(self, module, name):
            self.seen.add((module, name))
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return lambda *args: args  # what SGLang's patched rebuild would get
            return super().find_class(module, name)

    for entry in payload:
        got = Recorder(io.BytesIO(__import__("base64").b64decode(entry))).load()
        assert [n for n, _ in got] == ["w", "b"]
        for (_, args), (_, t) in zip(got, bucket):
            assert args[6] == "GPU-uuid-of-0"  # the device travels as its UUID, not the sender's index
            assert tuple(args[1]) == tuple(t.shape) and args[5] == t.dtype
    assert Recorder.seen <= SGLANG_ALLOWED, Recorder.seen - SGLANG_ALLOWED


_GROUP_RANK = """
import os, sys, torch
sys.path.insert(0, {root!r})
import transfermesh as tm
rank = int(sys.argv[1])
pg = tm.new_sglang_group("127.0.0.1", {port}, rank, 2, "loongsage", backend="gloo")
t = torch.arange(6.0) if rank == 0 else torch.zeros(6)
pg.broadcast(t, 0).wait()
print(t.tolist(), flush=True)
# leave without tearing the group down: the trainer keeps its group for the run, and gloo's destructor at interpreter
# exit, racing the other rank's, sometimes aborts ("terminate called without an active exception", seen under load)
pg.barrier().wait()
os._exit(0)
"""


def test_sglang_group_construction_broadcasts():
    """new_sglang_group (the trainer's NCCL side on GPU) built with gloo in two processes: the store, its
    group_name prefix and torch's constructor meet, and rank 0's tensor arrives."""
    import subprocess
    import sys
    from pathlib import Path
    script = _GROUP_RANK.format(root=str(Path(__file__).resolve().parents[1]), port=tm.free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    assert [o[0].strip() for o in outs] == ["[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]"] * 2


def test_sglang_servers_see_trainer_rank_0s_gpu_for_cuda_ipc():
    """CUDA IPC handles name trainer rank 0's GPU: an engine on the same node sees its own GPUs first (its TP ranks
    drive them) and then rank 0's; on another node it sees only its own (and gets broadcast, not cuda_ipc)."""
    from pathlib import Path

    import config
    import fleet
    recipe = str(Path(__file__).resolve().parents[1] / "recipes/code_repair_gpu.yaml")
    colocated = config.load_config(recipe)  # 8 trainer ranks; 4 engines x 2 GPUs on the trainers' GPUs
    one_node = [("n0", [str(b)]) for b in range(8)]
    plan = fleet.placement(colocated)
    assert [fleet.engine_visible_gpus(plan, one_node, i) for i in range(4)] == \
        [["0", "1"], ["2", "3", "0"], ["4", "5", "0"], ["6", "7", "0"]]
    disagg = config.load_config(recipe, ["colocate=false", "trainer_workers=4", "num_engines=2",
                                         "global_batch_size=128"])
    plan = fleet.placement(disagg)  # trainers on bundles 0-3, engines on 4-5 and 6-7
    assert [fleet.engine_visible_gpus(plan, one_node, i) for i in range(2)] == [["4", "5", "0"], ["6", "7", "0"]]
    two_nodes = [("n0" if b < 4 else "n1", [str(b % 4)]) for b in range(8)]
    assert [fleet.engine_visible_gpus(plan, two_nodes, i) for i in range(2)] == [["0", "1"], ["2", "3"]]
    assert fleet.engine_gpu_ids(plan, two_nodes, 0) == ["0", "1"]  # the engine's own GPUs are unchanged
