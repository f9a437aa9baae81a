"""LoRA end to end against the real parts: Megatron-Core over gloo in Ray actors, the CPU engine over HTTP, `peft`
and transformers as the references.

What each test proves:
* config: what LoRA cannot serve yet (MoE, pipeline stages, colocation, broadcast, sequence or context
  parallelism, the distributed optimizer) is refused at --check, and SGLang is started with its LoRA flags;
* TP parity, frozen base, reference by disabling: one RL step with adapters gives the same loss, grad norm and
  adapters at TP=2 as at TP=1; the base weights come back bit for bit and only the adapters are in the optimizer
  (count checked by hand); the KL reference is the base model (transformers' logprobs) though no copy is kept;
* recomputation (recompute=full) trains the same adapters as without it;
* the critic (advantage: gae) trains its own adapters and value head on a frozen trunk;
* sync equality: after a step, a sync moves only adapter bytes and the CPU engine, generating with the new adapter,
  gives the trainer's logprobs; the base stays served beside it; unload waits for nothing and then refuses the name;
* PEFT round trip: the exported adapter directory, loaded by `peft` onto the HF base, and the merged HF export both
  reproduce the trainer's logprobs; the CPU engine loads the same directory from disk (/load_lora_adapter);
* the same with lora_train_norm: the final norm's gain trains and moves as a base weight beside the adapter (so the
  engine's adapter-less requests see it), the KL reference has the base's gain, peft applies the gain exported as
  modules_to_save, and the CPU engine refuses that directory naming the tensor (SGLang would drop it silently);
* the CPU engine takes SGLang's adapter payload (a flattened bucket, or a {name: tensor} dict) with the weight
  updates' reader and refuses any other, a bad checksum or SGLang's expected_checksums that do not match;
* the CPU engine refuses what SGLang refuses (LoRA off, a name twice, a rank above --max-lora-rank, an unknown
  adapter), and AgentFlow's pool names the current adapter, stamps its version and unloads the one it replaced.
"""
import asyncio

import httpx
import pytest
import torch

import config
import cpu_engine
import data
import lora
import rollout
import transfermesh
from config import Config
from test_trainer import Ranks, max_diff  # the trainer ranks as one Ray world, and the logprob comparison
from test_transfermesh import _EngineProcess as EngineProcess  # a CPU engine in a process of its own
from test_trainer import make_cfg as trainer_cfg

pytestmark = pytest.mark.timeout(900)
R, ALPHA = 4, 8.0


def make_cfg(**over) -> Config:
    """test_trainer's (8 samples in 2 mini-batches, a large lr and adam_eps so one step moves the adapters smoothly,
    a KL term so the reference by disabling runs) with LoRA on every projection."""
    return trainer_cfg(**{"lora_rank": R, "lora_alpha": ALPHA, **over})


def make_batch(tok, n_groups=4, per_group=2, seed=0) -> list[dict]:
    """Arithmetic prompts with fixed random answers (their tokens), rewards 0/1 alternating within each group."""
    import random
    rng = random.Random(seed)
    batch = []
    for g, s in enumerate(data.arith_samples(n_groups, seed)):
        prompt = data.prompt_ids(tok, s)
        for k in range(per_group):
            resp = tok.encode(str(rng.randrange(20)), add_special_tokens=False) + [rng.randrange(10, 300)]
            batch.append(dict(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * len(resp),
                              rollout_logprobs=[-3.0] * len(resp), weight_versions=[0] * len(resp),
                              reward=float((g + k) % 2), status="ok", group_id=g, sample_index=k))
    return batch


def hf_logprobs(model, batch) -> list[torch.Tensor]:
    out = []
    for s in batch:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        with torch.no_grad():
            logits = model(ids).logits.float()
        logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(logp[len(s["prompt_ids"]) - 1:])
    return out


def adapter_params_by_hand(hf: dict) -> int:
    """A (r, in) + B (out, r) for q/k/v/o/gate/up/down of every layer of the tiny test model."""
    H, F, d = hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
    per_layer = sum(R * n_in + n_out * R for n_in, n_out in
                    ((H, q), (H, kv), (H, kv), (q, H), (H, F), (H, F), (F, H)))
    return per_layer * hf["num_hidden_layers"]


# ----------------------------------------------------------------------------------------------
# config: what LoRA refuses, SGLang's flags


@pytest.mark.parametrize("over, needle", [
    (["lora_targets=[q_proj, w_proj]"], "'w_proj' is not a projection; did you mean 'v_proj'"),
    (["colocate=true"], "colocate=true"),
    (["pipeline_parallel=2", "trainer_workers=2"], "pipeline_parallel=2"),
    (["transfer=broadcast"], "loads adapters from tensors"),
    (["tiny_model.num_experts=4"], "MoE experts"),
    (["lora_alpha=0"], "lora_alpha=0"),
    (["lora_rank=0", "lora_train_norm=true"], "lora_train_norm=true needs lora_rank > 0"),
    (['teachers={"t": "tiny"}', "gkd_ratio=0.5"], "teacher_eval=true"),
    (["tensor_parallel=2", "trainer_workers=2", "sequence_parallel=true"], "sequence_parallel=true with lora_rank"),
    (["device=cuda", "dtype=bfloat16", "use_distributed_optimizer=true"], "use_distributed_optimizer=true with lora"),
    (["device=cuda", "dtype=bfloat16", "context_parallel=2", "trainer_workers=2"],  # LoRA builds the local spec
     "context_parallel=2 needs Transformer Engine's attention, and the local spec is built (layer_spec='auto' with "
     "lora_rank=8)"),
])
def test_lora_config_refuses_what_it_cannot_serve(over, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        config.load_config(None, ["lora_rank=8", *over])


def test_adapter_transports_follow_the_engines_place():
    """Local engines get the adapter from memory (shm / CUDA IPC, as full weights do); a remote one gets a PEFT
    directory under `auto`, since SGLang cannot receive an adapter by broadcast."""
    local, remote = "http://127.0.0.1:30000", "http://10.255.255.1:30000"
    assert transfermesh.adapter_transport(local, "auto") == transfermesh.pick_transport(local, "auto")
    assert transfermesh.adapter_transport(remote, "auto") == "disk"
    assert transfermesh.adapter_transport(local, "auto", remote=True) == "disk"  # on another Ray node
    assert transfermesh.adapter_transport(remote, "disk") == "disk"


def test_sglang_is_started_with_its_lora_flags():
    cfg = config.load_config(None, ["lora_rank=16", "lora_targets=[q_proj, v_proj]"])
    cmd = rollout.sglang_command(cfg, "127.0.0.1", 30000, 0)
    assert "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"
    i = cmd.index("--lora-target-modules")
    assert cmd[i + 1:i + 3] == ["q_proj", "v_proj"]
    assert "--enable-lora" not in rollout.sglang_command(config.load_config(None, []), "127.0.0.1", 30000, 0)


# ----------------------------------------------------------------------------------------------
# the trainer: TP parity, frozen base, reference by disabling, the critic


@pytest.mark.slow
def test_tp2_equals_tp1_base_frozen_reference_is_the_base(ray_session, tiny_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    import convert
    hf_cfg = convert.read_hf_config(tiny_model_dir)
    tok = data.load_tokenizer(tiny_model_dir)
    batch = make_batch(tok)
    base_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base_lp = hf_logprobs(base_model, batch)
    base_state = load_file(f"{tiny_model_dir}/model.safetensors")
    results = {}
    # both worlds start at once (an actor's start-up is one core's work: they overlap); neither's sums depend on the
    # other's
    started = {tp: Ranks(make_cfg(tensor_parallel=tp, trainer_workers=tp, weight_decay=0.1), tp) for tp in (1, 2)}
    try:
        for tp, ranks in started.items():
            info = ranks.call("load_hf", tiny_model_dir)[0]
            lp0 = ranks.call("compute_logprobs", batch)[0]
            m = ranks.call("train_step", batch, 0)[0]
            lp1, ref1 = ranks.call("compute_logprobs", batch)[0], ranks.call("compute_logprobs", batch, True)[0]
            exported = dict(ranks.call("export_hf_weights")[0])
            adapters = ranks.call("export_adapters")
            results[tp] = (info, m, lp1, adapters[0])
            assert all(a == {} for a in adapters[1:])  # rank 0 alone returns them
            # step 0 is the base model (B = 0), and the reference is the base, adapters off, with no copy of it kept
            assert max_diff(lp0, base_lp) <= 1e-4 and max_diff(ref1, base_lp) <= 1e-4
            assert not info["reference"] and info["reference_by_disabling_adapters"]
            assert max_diff(lp1, base_lp) > 1e-3  # the adapters moved the policy
            assert m["train/kl"] > 0  # the second mini-batch sees a policy that left the reference
            # the base came back bit for bit: frozen, never stepped (weight decay would move it too)
            assert set(exported) == set(base_state) and all(torch.equal(exported[n], t) for n, t in base_state.items())
    finally:
        for ranks in started.values():
            ranks.close()
    info1, m1, lp_1, a1 = results[1]
    info2, m2, lp_2, a2 = results[2]
    expected = adapter_params_by_hand(hf_cfg)
    assert info1["trained_params_this_rank"] == info1["optimizer_params_this_rank"] == expected
    # TP=2: each rank holds half of every split adapter matrix, all of the others
    assert info2["optimizer_params_this_rank"] < expected
    for key in ("train/loss", "train/grad_norm", "train/kl"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    assert set(a1) == set(a2) and len(a1) == 2 * 7 * hf_cfg["num_hidden_layers"]
    for name in a1:
        torch.testing.assert_close(a2[name], a1[name], rtol=0, atol=2e-6, msg=name)
    assert max_diff(lp_2, lp_1) <= 1e-5
    assert any(float(t.abs().max()) > 0 for n, t in a1.items() if ".lora_B." in n)  # B left zero: a real update


@pytest.mark.slow
def test_recomputation_trains_the_same_adapters(ray_session, tiny_model_dir):
    """recompute=full (what the GPU recipe sets) reruns each layer's forward, adapter hooks included, in the
    backward pass: one RL step gives the same loss, grad norm and adapters as without it."""
    batch = make_batch(data.load_tokenizer(tiny_model_dir))
    results = {}
    started = {recompute: Ranks(make_cfg(recompute=recompute), 1) for recompute in ("none", "full")}  # side by side
    try:
        for recompute, ranks in started.items():
            ranks.call("load_hf", tiny_model_dir)
            results[recompute] = (ranks.call("train_step", batch, 0)[0], ranks.call("export_adapters")[0])
    finally:
        for ranks in started.values():
            ranks.close()
    (m0, a0), (m1, a1) = results["none"], results["full"]
    for key in ("train/loss", "train/grad_norm", "train/kl"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key
    assert set(a0) == set(a1) and any(float(t.abs().max()) > 0 for n, t in a1.items() if ".lora_B." in n)
    for name in a0:
        torch.testing.assert_close(a1[name], a0[name], rtol=0, atol=1e-6, msg=name)


def test_critic_and_distillation_train_adapters_on_a_frozen_base(ray_session, tiny_model_dir):
    """advantage: gae with a GKD term: the critic trains its own adapters and value head on a frozen trunk, and the
    student's top-k distillation loss reaches the adapters. The teacher targets are fixed per-token top-k
    distributions (the teacher side is tests/test_teacher.py's); the base weights come back bit for bit."""
    from safetensors.torch import load_file
    tok = data.load_tokenizer(tiny_model_dir)
    batch = make_batch(tok)
    g = torch.Generator().manual_seed(0)
    K = 4
    targets = []
    for s in batch:
        n = len(s["response_ids"])
        ids = torch.randint(10, 300, (n, K), generator=g)
        ids[:, 0] = torch.tensor(s["response_ids"])  # the sampled token among the teacher's top k
        topk = torch.log_softmax(torch.randn(n, K, generator=g), -1)  # (n, K) the teacher's top-k logprobs
        targets.append({"teacher_logp": topk[:, 0].clone(), "teacher_mask": torch.ones(n),
                        "teacher_topk_logp": topk, "teacher_topk_ids": ids})
    ranks = Ranks(make_cfg(advantage="gae", kl_coef=0.0, gkd_ratio=0.5, distill_type="topk_kl", teacher_topk=K), 1)
    try:
        info = ranks.call("load_hf", tiny_model_dir)[0]
        m = ranks.call("train_step", batch, 0, targets)[0]
        v = ranks.call("compute_values", batch)[0]
        exported = dict(ranks.call("export_hf_weights")[0])
        [adapters] = ranks.call("export_adapters")
    finally:
        ranks.close()
    assert info["critic"] and not info["reference"]
    assert m["critic/grad_norm"] > 0 and all(torch.isfinite(x).all() for x in v)
    assert any(float(x.abs().max()) > 0 for x in v)  # the value head (zero at start) moved
    assert m["train/opd_loss"] > 0 and m["train/opd_tokens"] > 0 and m["train/grad_norm"] > 0
    assert any(float(t.abs().max()) > 0 for n, t in adapters.items() if ".lora_B." in n)
    base_state = load_file(f"{tiny_model_dir}/model.safetensors")
    assert all(torch.equal(exported[n], t) for n, t in base_state.items())


# ----------------------------------------------------------------------------------------------
# sync into the CPU engine, and the exports


def _generate(url, prompt, lora_path=None, **kw):
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, **kw}}
    if lora_path:
        body["lora_path"] = lora_path
    return httpx.post(url + "/generate", json=body, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("train_norm", [False, True])
def test_sync_sends_adapters_only_engine_matches_trainer_and_peft_round_trip(ray_session, tiny_model_dir, tmp_path,
                                                                            train_norm):
    """train_norm (lora_train_norm): the final norm's gain trains too and travels as a base weight beside the adapter,
    so the engine's adapter-less requests see it as well; the KL reference still has the base's gain."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    import peft
    cfg = make_cfg(output_dir=str(tmp_path), kl_coef=0.01 if train_norm else 0.0, prompts_per_step=2,
                   samples_per_prompt=4, global_batch_size=8, micro_batch_size=8, lora_train_norm=train_norm)
    # the engine in a process of its own, as in a run: this process maps the trainer's shared memory here and
    # writes its own in other tests, which torch's shm manager table cannot do after the trainer exits
    handle = EngineProcess(tiny_model_dir, 3, ["--enable-lora", "--max-lora-rank", "8",
                                               "--enable-deterministic-inference"])  # sampling_seed is honoured
    url = handle.url
    ranks = Ranks(cfg, 1)
    try:
        ranks.call("load_hf", tiny_model_dir)
        tok = data.load_tokenizer(tiny_model_dir)
        prompts = [data.prompt_ids(tok, s) for s in data.arith_samples(2, 0)]
        batch = []
        for g, p in enumerate(prompts):
            for i in range(4):  # a seed each: under deterministic inference unseeded samples of a prompt are equal
                r = _generate(url, p, sampling_seed=4 * g + i, ignore_eos=True).json()
                n = len(r["output_ids"])
                batch.append({"prompt_ids": p, "response_ids": r["output_ids"], "loss_mask": [1] * n,
                              "rollout_logprobs": [x[0] for x in r["meta_info"]["output_token_logprobs"]],
                              "weight_versions": [0] * n, "reward": float(i % 2), "status": "ok", "group_id": g,
                              "sample_index": i})
        ranks.call("train_step", batch, 0)
        [stats] = ranks.call("sync_weights", [url], 1)
        [adapters] = ranks.call("export_adapters")
        adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
        norm = dict(ranks.call("export_hf_weights")[0])[lora.NORM]
        base_norm = load_file(f"{tiny_model_dir}/model.safetensors")[lora.NORM]
        assert (float((norm - base_norm).abs().max()) > 1e-4) == train_norm  # the gain trained, or stayed frozen
        norm_bytes = norm.numel() * norm.element_size() if train_norm else 0
        # adapters alone moved (and the gain, when it trains)
        assert stats["weights/bytes"] == adapter_bytes + norm_bytes < stats["weights/full_bytes"] / 5
        info = httpx.get(url + "/get_server_info").json()["internal_states"][0]
        assert info["loaded_adapters"] == [lora.adapter_name(1)] and info["weight_version"] == "1"

        # the engine with the new adapter gives the trainer's logprobs; without it, still the base model's
        fresh, plain = [], []
        for t in batch:
            r = _generate(url, t["prompt_ids"], lora.adapter_name(1), ignore_eos=True).json()  # t's 6 tokens long
            fresh.append({**t, "response_ids": r["output_ids"], "loss_mask": [1] * len(r["output_ids"]),
                          "rollout_logprobs": [x[0] for x in r["meta_info"]["output_token_logprobs"]]})
            r = _generate(url, t["prompt_ids"], ignore_eos=True).json()
            plain.append({**t, "response_ids": r["output_ids"], "loss_mask": [1] * len(r["output_ids"]),
                          "rollout_logprobs": [x[0] for x in r["meta_info"]["output_token_logprobs"]]})
        base_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        if train_norm:  # the reference: adapters off and the base's gain, restored after (the next check)
            assert max_diff(ranks.call("compute_logprobs", fresh, True)[0], hf_logprobs(base_model, fresh)) <= 1e-4
        [trainer_lp] = ranks.call("compute_logprobs", fresh)
        diffs = [abs(a - b) for t, lp in zip(fresh, trainer_lp) for a, b in zip(lp, t["rollout_logprobs"])]
        assert len(diffs) == sum(len(t["response_ids"]) for t in fresh) and max(diffs) < 1e-5
        # the engine's base: the HF base's, or with the trained gain the base's no longer
        assert (max_diff(hf_logprobs(base_model, plain), [t["rollout_logprobs"] for t in plain]) < 1e-5) != train_norm
        assert max_diff(trainer_lp, hf_logprobs(base_model, fresh)) > 1e-3  # the adapter really changed the policy

        # exports: the PEFT directory through peft, and the merged HF model, give the trainer's logprobs
        ranks.call("save_hf", str(tmp_path / "merged"), str(tmp_path / "adapter"))
        peft_model = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), str(tmp_path / "adapter")).eval()
        assert max_diff(hf_logprobs(peft_model, fresh), trainer_lp) <= 1e-5
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
        assert max_diff(hf_logprobs(merged, fresh), trainer_lp) <= 1e-4
        # ... and the engine loads the PEFT directory from disk (the disk transport's endpoint)
        r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "from-disk", "lora_path": str(tmp_path / "adapter")})
        if train_norm:  # peft applies the gain (modules_to_save, above); an engine's adapter cannot: it is refused
            assert r.status_code == 400 and f"'base_model.model.{lora.NORM}'" in r.text, r.text
        else:
            assert r.status_code == 200 and r.json()["success"], r.text
            t = fresh[0]
            # each adapter asked twice; the second answers come through their own first answer's prefix-cache entry,
            # so both take the same path (a prompt prefilled whole rounds apart from a cached one on AVX2's kernels:
            # docs/CPU.md) and must agree to the bit
            same, other = ([_generate(url, t["prompt_ids"], a, sampling_seed=7).json() for _ in range(2)][1]
                           for a in ("from-disk", lora.adapter_name(1)))
            assert same["meta_info"]["cached_tokens"] == other["meta_info"]["cached_tokens"] > 0
            assert same["output_ids"] == other["output_ids"]
            assert [x[0] for x in same["meta_info"]["output_token_logprobs"]] == \
                [x[0] for x in other["meta_info"]["output_token_logprobs"]]

        # a second sync is a second adapter (SGLang never reloads a name); the first unloads, then is refused
        ranks.call("sync_weights", [url], 2)
        for name in [lora.adapter_name(1)] + ([] if train_norm else ["from-disk"]):
            assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": name}).json()["success"]
        assert httpx.get(url + "/get_server_info").json()["internal_states"][0]["loaded_adapters"] == \
            [lora.adapter_name(2)]
        gone = _generate(url, batch[0]["prompt_ids"], lora.adapter_name(1))
        assert gone.status_code == 400 and "never been loaded" in gone.text
    finally:
        ranks.close()
        handle.shutdown()


# ----------------------------------------------------------------------------------------------
# the CPU engine's LoRA contract, and AgentFlow's pool


def _peft_tensors(hf_cfg: dict, layers=(0,), r=R, scale_b=0.05, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, d = hf_cfg["hidden_size"], hf_cfg["head_dim"]
    q = hf_cfg["num_attention_heads"] * d
    out = {}
    for L in layers:
        out[lora.peft_name(L, "q_proj", "A")] = torch.randn(r, H, generator=g) * 0.1
        out[lora.peft_name(L, "q_proj", "B")] = torch.randn(q, r, generator=g) * scale_b
    return out


def _lps(answer) -> list[float]:
    return [x[0] for x in answer["meta_info"]["output_token_logprobs"]]


def _load(url, name, tensors, r=R, **fields):
    """/load_lora_adapter_from_tensors with SGLang's payload as transfermesh.push_adapter sends it by shm, with
    LoongSage's per-bucket checksum (which the engine also verifies) where push_adapter sends expected_checksums."""
    cfg = {"r": r, "lora_alpha": ALPHA, "target_modules": ["q_proj"]}
    flat, metas, sums = transfermesh.write_shm_bucket(sorted(tensors.items()))
    return httpx.post(url + "/load_lora_adapter_from_tensors", json={
        "lora_name": name, "config_dict": cfg, "serialized_named_tensors": transfermesh.tensor_payloads(flat, metas, 1),
        "load_format": "flattened_bucket", "checksum": sums, **fields})


def test_engine_refuses_what_sglang_refuses_and_the_pool_names_and_retires_adapters(tiny_model_dir):
    import convert
    import agentflow
    hf_cfg = convert.read_hf_config(tiny_model_dir)
    off_url, off = cpu_engine.serve(tiny_model_dir, max_batch=4, max_len=64)
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=4, max_len=64,
                                   lora=dict(max_lora_rank=R, lora_target_modules=["q_proj", "v_proj"]))
    prompt = [5, 6, 7, 8]
    try:
        r = _load(off_url, "a", _peft_tensors(hf_cfg))
        assert r.status_code == 400 and "LoRA is not enabled" in r.json()["error_message"]
        r = _generate(off_url, prompt, "a")
        assert r.status_code == 400 and "LoRA is not enabled" in r.text
        assert _load(url, "a", _peft_tensors(hf_cfg)).json()["loaded_adapters"] == {"a": "__tensor__"}
        r = _load(url, "a", _peft_tensors(hf_cfg))
        assert r.status_code == 400 and "already loaded" in r.json()["error_message"]
        r = _load(url, "big", _peft_tensors(hf_cfg, r=2 * R), r=2 * R)
        assert r.status_code == 400 and "--max-lora-rank" in r.json()["error_message"]
        assert _generate(url, prompt, "nope").status_code == 400
        # an adapter changes the logprobs; the base and another adapter in the same batch keep their own
        greedy = dict(temperature=0.0)
        base = _generate(url, prompt, **greedy).json()
        with_a = _generate(url, prompt, "a", **greedy).json()
        assert base["meta_info"]["output_token_logprobs"][0][0] != with_a["meta_info"]["output_token_logprobs"][0][0]
        # the prefix cache is the adapter's own (SGLang keys its radix cache by lora_id): the base's K/V of this
        # prompt does not serve adapter "a", a's own does
        again = _generate(url, prompt, "a", **greedy).json()
        assert (with_a["meta_info"]["cached_tokens"], again["meta_info"]["cached_tokens"]) == (0, len(prompt) - 1)
        assert again["output_ids"] == with_a["output_ids"] and _lps(again) == pytest.approx(_lps(with_a), abs=1e-5)
        both = httpx.post(url + "/generate", json={"input_ids": [prompt, prompt], "lora_path": [None, "a"],
                                                   "return_logprob": True, "sampling_params": {
                                                       "temperature": 0.0, "max_new_tokens": 6}}, timeout=60).json()
        for got, alone in zip(both, (base, with_a)):
            assert got["output_ids"] == alone["output_ids"] and _lps(got) == pytest.approx(_lps(alone), abs=1e-5)

        async def pool_run():
            pool = rollout.EnginePool([url], check_every_s=0)
            try:
                _, plain = await pool.generate(prompt, {"max_new_tokens": 4, "temperature": 0.0}, "r0")
                assert _lps(plain) == pytest.approx(_lps(base)[:4], abs=1e-5)
                pool.use_adapter("a", 7)
                _, out = await pool.generate(prompt, {"max_new_tokens": 4, "temperature": 0.0}, "r1")
                assert out["meta_info"]["weight_versions"] == [{"version": "7", "start": 0, "end": 4}]
                assert _lps(out) == pytest.approx(_lps(with_a)[:4], abs=1e-5)
                assert _load(url, "b", _peft_tensors(hf_cfg, seed=1)).status_code == 200
                pool.use_adapter("b", 8)  # "a" has no request left: unloaded from the engine in the background
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    loaded = httpx.get(url + "/get_server_info").json()["internal_states"][0]["loaded_adapters"]
                    if loaded == ["b"]:
                        break
                assert loaded == ["b"]
            finally:
                await pool.close()
        asyncio.run(pool_run())
    finally:
        handle.shutdown()
        off.shutdown()


def test_adapter_payload_is_sglangs_and_anything_else_is_refused(tiny_model_dir):
    """/load_lora_adapter_from_tensors reads SGLang 0.5.23's payload with the weight updates' reader: a flattened
    bucket in shared memory, or with load_format null a {name: tensor} dict (what SGLang's handler iterates), both
    serving the same adapter; a list of pairs with load_format null, a payload that is not base64, an unknown
    load_format, a LoongSage checksum or SGLang expected_checksums (sha256 per tensor) that do not match are refused
    with 400 and load nothing."""
    import base64
    import hashlib
    import json
    import convert
    hf_cfg = convert.read_hf_config(tiny_model_dir)
    url, handle = cpu_engine.serve(tiny_model_dir, max_batch=4, max_len=64,
                                   lora=dict(max_lora_rank=R, lora_target_modules=["q_proj"]))
    cfg = {"r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj"]}
    tensors = _peft_tensors(hf_cfg)
    sha = {n: hashlib.sha256(t.contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
           for n, t in tensors.items()}

    def post(name, entry, load_format, **fields):
        return httpx.post(url + "/load_lora_adapter_from_tensors", json={
            "lora_name": name, "config_dict": cfg, "serialized_named_tensors": [entry], "load_format": load_format,
            **fields})

    def loaded():
        return httpx.get(url + "/get_server_info").json()["internal_states"][0]["loaded_adapters"]
    try:
        assert _load(url, "flat", tensors, expected_checksums=sha).status_code == 200
        def as_dict():  # CPU tensors as shared-memory handles; each dump is read once (torch's fd sharing)
            return transfermesh.cuda_ipc_payloads(dict(sorted(tensors.items())), 1)[0]
        assert post("dict", as_dict(), None).json()["success"] is True
        greedy = [_lps(_generate(url, [5, 6, 7, 8], n, temperature=0.0).json()) for n in ("flat", "dict")]
        assert greedy[0] == pytest.approx(greedy[1], abs=0) and greedy[0] != pytest.approx(
            _lps(_generate(url, [5, 6, 7, 8], temperature=0.0).json()), abs=1e-4)
        pairs = transfermesh.cuda_ipc_payloads(sorted(tensors.items()), 1)[0]
        refusals = [(post("pairs", pairs, None), "{name: tensor} dict"),
                    (post("b64", base64.b64encode(json.dumps({"name": "x"}).encode()).decode()[:-2] + "!!",
                          "flattened_bucket"), "base64"),
                    (post("direct", as_dict(), "direct"), "load_format 'direct'"),
                    (_load(url, "sum", tensors, checksum=[1]), "checksum mismatch"),
                    (_load(url, "sha", tensors, expected_checksums={**sha, next(iter(sha)): "0" * 64}),
                     "1 value-diff"),
                    (_load(url, "extra", tensors, expected_checksums=dict(list(sha.items())[:1])), "1 extra")]
        for r, needle in refusals:
            assert r.status_code == 400 and r.json()["success"] is False and needle in r.json()["error_message"], (
                needle, r.text)
        assert sorted(loaded()) == ["dict", "flat"]
    finally:
        handle.shutdown()


# ----------------------------------------------------------------------------------------------
# a whole run


@pytest.mark.slow
def test_async_lora_run_versions_gap_and_bytes(tmp_path, monkeypatch, ray_session):
    """The CPU recipe, shrunk, in async mode with a KL term: after the warm start the base goes once (version 0),
    then every sync moves only adapter bytes; requests in flight across a sync finish on their own adapter and
    their tokens keep its version (lag <= 1 with max_version_lag 1, versions within the window), tokens sampled by
    the trainer's own adapter give a ~0 train-inference gap, and the run ends with a merged HF model and a PEFT
    adapter. Only the base's sync pauses the engines (retract) and flushes: an adapter's needs neither."""
    import json
    import loongsage
    import rollout
    posted, post = [], rollout.post
    monkeypatch.setattr(rollout, "post", lambda url, path, *a, **kw: (posted.append(path), post(url, path, *a, **kw))[1])
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("LOONGSAGE_CACHE", str(tmp_path / "cache"))
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128)
    cfg = config.load_config(str(root / "recipes/arith_lora_cpu.yaml"), [
        f"output_dir={tmp_path}/run", "num_steps=3", "prompts_per_step=4", "samples_per_prompt=4",
        "global_batch_size=8", "micro_batch_size=4", "max_new_tokens=6", "eval_every=0", "warmstart_steps=2",
        "warmstart_batch_size=8", "lr=1e-2", "kl_coef=0.01", "reward=tests.rewards.text_hash", "mode=async",
        "stale_steps=1", "max_version_lag=1", f"tiny_model={json.dumps(tiny)}"])
    steps = [h for h in loongsage.train(cfg) if "train/loss" in h]
    assert len(steps) == 3
    for i, h in enumerate(steps):
        assert i - 1 <= h["rollout/weight_version_min"] <= h["rollout/weight_version_max"] <= i, (i, h)
        assert h["rollout/lag_max"] <= 1 and h["weights/version"] == i + 1
        assert h["weights/bytes"] < h["weights/full_bytes"] / 5 and h["train/kl"] >= 0
        if "train/gap_k3" in h:
            assert h["train/gap_k3"] < 1e-6 and h["train/gap_max"] < 1e-4, (i, h)
    assert any("train/gap_k3" in h for h in steps)
    assert posted.count("/pause_generation") == posted.count("/flush_cache") == 1, posted
    run = tmp_path / "run"
    assert (run / "final_adapter" / lora.PEFT_WEIGHTS).exists() and (run / "final_hf" / "model.safetensors").exists()
