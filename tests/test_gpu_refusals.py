"""GPU configurations that would break or silently diverge: refused at --check (and again where a trainer builds its
model) with the reason and the setting to change, or built right; and every GPU recipe passes --check without
Transformer Engine. Checked on CPU against Megatron-Core's real layer specs and classes (TE's own classes cannot
import here: its spec is read with Megatron's placeholders for them; where CUDA would be needed, the meta device).

What each test proves:
* LoRA: Megatron's TE spec applies the RMSNorm inside exactly the layers LoRA adapts as column-parallel (linear_qkv,
  linear_fc1), so their adapters would read un-normalised input: lora_rank with layer_spec te is refused, and
  `auto` builds the local spec for a LoRA run where TE imports (and TE's for the same run without LoRA);
* DeepSeek-V3 / MLA: on the local spec, as a CUDA trainer builds it (no CPU shims), the Moonlight-shaped model builds
  from Megatron's classes, its core attention taking MLA's q/k and v head sizes, and every parameter has an HF name;
  on TE's spec, every norm it fuses into a linear layer (the q / kv latents' norms among them) is in the
  conversion's name map, so the weights load;
* fp32 on SGLang (FlashAttention-3 on Hopper, no fp32 kernels) is refused with dtype=bfloat16 named; bf16 reaches
  SGLang's command line; the CPU's fp32 default stands;
* without TE, sequence parallelism, layer_spec te, context parallelism and packed sequences are refused on CUDA at
  --check with what to do; every GPU recipe says dtype bfloat16 and passes --check and the trainer-start check.
"""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import config
import convert
import loongsage
import lora
import rollout
from test_deepseek import DS, MOONLIGHT

ROOT = Path(__file__).resolve().parents[1]
GPU_RECIPES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("*.yaml")
                     if yaml.safe_load(p.read_text()).get("device") == "cuda")
NO_TE = "ModuleNotFoundError: No module named 'transformer_engine'"
QWEN3 = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, vocab_size=256)
DEEPSEEK = dict(DS, n_routed_experts=DS["num_experts"], num_key_value_heads=4, vocab_size=256, rope_interleave=True,
                scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)


def _cuda_cfg(*over: str) -> config.Config:
    return config.load_config(None, ["device=cuda", "dtype=bfloat16", *over])


# ----------------------------------------------------------------------------------------------
# the layer specs: what TE's fuses, against LoRA and the name map


def _walk(spec, path: str = ""):
    """(dotted path, module class) of every submodule a Megatron layer spec names, depth first."""
    sub = getattr(spec, "submodules", None)
    if sub is None or not dataclasses.is_dataclass(sub):
        return
    for f in dataclasses.fields(sub):
        value = getattr(sub, f.name)
        yield path + f.name, getattr(value, "module", value)
        yield from _walk(value, path + f.name + ".")


def _layers(spec) -> list:
    return list(getattr(spec, "layer_specs", [spec]))  # a DeepSeek-V3 block spec, or one layer's spec


@pytest.fixture
def te_spec(monkeypatch):
    """Megatron's TE layer spec without TE: gpt_layer_specs names TE's provider only where TE imports, so it is
    given the provider Megatron ships (its TE classes are Megatron's placeholders, distinct per class)."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", te.TENorm, raising=False)
    monkeypatch.setattr(provider, "is_te_min_version", lambda *a, **k: True)
    return te


def _fused(te, hf: dict) -> list[tuple[set, set]]:
    """Per layer of `hf`'s model: (the linear layers TE's spec fuses a norm into, the norms the local spec has where
    TE's has none)."""
    tcfg, _ = convert.megatron_config(hf, config.Config(device="cuda", layer_spec="local", dtype="bfloat16"), cpu=False)
    out = []
    for local, fused in zip(_layers(convert._layer_spec_module(tcfg, "local")),
                            _layers(convert._layer_spec_module(tcfg, "te"))):
        norms = {p for p, m in _walk(local) if "Norm" in getattr(m, "__name__", "")}
        gone = {p for p, m in _walk(fused) if getattr(m, "__name__", "") == "IdentityOp"}
        out.append(({p for p, m in _walk(fused) if m is te.TELayerNormColumnParallelLinear}, norms & gone))
    return out


def test_te_spec_fuses_the_norms_lora_adapts_behind(te_spec):
    column = {lora.LAYOUT[t][0] for t in lora.TARGETS if lora.LAYOUT[t][1] == "column"}
    for linears, norms in _fused(te_spec, QWEN3):
        assert linears == column == {"self_attention.linear_qkv", "mlp.linear_fc1"}  # q/k/v and gate/up behind a norm
        assert norms == {"input_layernorm", "pre_mlp_layernorm"}


def test_every_norm_the_te_spec_fuses_is_in_the_conversion_map(te_spec):
    seen = set()
    for hf in (QWEN3, DEEPSEEK, {**DEEPSEEK, "q_lora_rank": None}):
        for L, (linears, norms) in enumerate(_fused(te_spec, hf)):
            names = [f"decoder.layers.{L}.{p}.layer_norm_weight" for p in linears]
            # the local-spec norms trainer.Model finds a fused parameter for: every norm the spec fused, no other
            assert sorted(convert.fused_norm_names(names)) == sorted(f"decoder.layers.{L}.{n}.weight" for n in norms)
            seen |= {p + ".layer_norm_weight" for p in linears}
    assert {"self_attention.linear_q_up_proj.layer_norm_weight",
            "self_attention.linear_kv_up_proj.layer_norm_weight"} <= seen  # MLA: the q / kv latents' norms
    assert seen == set(convert.TE_FUSED_NORMS)


# ----------------------------------------------------------------------------------------------
# 1. LoRA under TE's spec


def test_lora_refuses_the_te_spec_and_auto_builds_the_local_one(monkeypatch):
    with pytest.raises(ValueError, match="lora_rank=8 with layer_spec='te': TE's linear_qkv and linear_fc1 apply the "
                                         "RMSNorm inside the layer.*set layer_spec=auto or local"):
        _cuda_cfg("lora_rank=8", "layer_spec=te")
    monkeypatch.setattr(convert, "_te_import_error", lambda: None)  # as on a trainer where TE imports
    assert convert.layer_spec(_cuda_cfg(), on_cpu=False) == "te"
    assert convert.layer_spec(_cuda_cfg("lora_rank=8"), on_cpu=False) == "local"
    recipe = config.load_config(str(ROOT / "recipes/qwen3_8b_lora_gpu.yaml"))
    assert recipe.lora_rank and recipe.layer_spec == "auto" and convert.layer_spec(recipe, on_cpu=False) == "local"
    assert config.fast_paths(recipe).startswith("layer spec auto -> local here")


# ----------------------------------------------------------------------------------------------
# 2. DeepSeek-V3 / MLA on CUDA

BUILD = """
import dataclasses, json, sys
import torch
import config, convert
torch.cuda.current_device = lambda: torch.device("meta")  # where Megatron would allocate on the GPU
torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
convert._te_import_error = lambda: "ModuleNotFoundError: No module named 'transformer_engine'"
recipe = config.load_config("recipes/moonlight_16b_gpu.yaml")
cfg = dataclasses.replace(recipe, expert_parallel=1, trainer_workers=1,  # one rank; parameters on the CPU path's init
                          megatron={**recipe.megatron, "use_cpu_initialization": True})
hf = json.loads(sys.argv[1])
tcfg, kwargs = convert.megatron_config(hf, cfg, cpu=False)  # the spec and classes a CUDA trainer builds
with torch.device("meta"):
    model = convert.build_gpt_model(tcfg, kwargs, torch.device("meta"))
print(json.dumps({"attention": sorted({type(l.self_attention.core_attention).__name__ for l in model.decoder.layers}),
                  "hf": sorted(h for n, p in model.named_parameters()
                               for h, _ in convert.megatron_to_hf_tensor(n, p, hf)),
                  "params": sum(p.numel() for p in model.parameters())}))
"""


@pytest.mark.slow
def test_mla_builds_on_the_local_spec_as_a_cuda_trainer_builds_it():
    hf = {**MOONLIGHT, "num_hidden_layers": 2, "n_routed_experts": 8}  # Moonlight's shapes, two layers, 8 experts
    r = subprocess.run([sys.executable, "-c", BUILD, json.dumps(hf)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["attention"] == ["SDPACoreAttention"]  # Megatron's DotProductAttention refuses k_channels
    assert "model.layers.1.self_attn.kv_a_layernorm.weight" in out["hf"] and "lm_head.weight" in out["hf"]
    # every weight once: embedding, final norm, head; the dense layer's attention (7) and MLP (3); the MoE layer's
    # attention, router + score-correction bias, 8 experts and the shared one
    assert len(out["hf"]) == len(set(out["hf"])) == 3 + (7 + 3) + (7 + 2 + 8 * 3 + 3)
    assert out["params"] > 1e9 * 0.5  # the real widths: 2 * 163840 * 2048 embedding + head alone are 0.67e9


# ----------------------------------------------------------------------------------------------
# 3. fp32 on SGLang


def test_fp32_on_sglang_is_refused_and_bf16_reaches_its_command_line():
    with pytest.raises(ValueError, match="dtype=float32 with engine=sglang.*FlashAttention-3.*set dtype=bfloat16"):
        config.load_config(None, ["device=cuda"])  # the default dtype on a GPU
    cmd = rollout.sglang_command(_cuda_cfg(), "127.0.0.1", 30000, 0)
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and "--enable-deterministic-inference" in cmd
    cpu_run = config.load_config(None)  # CPU runs keep fp32, on the CPU engine
    assert (cpu_run.device, cpu_run.engine, cpu_run.dtype) == ("cpu", "cpu", "float32")
    assert config.load_config(None, ["device=cuda", "engine=cpu"]).dtype == "float32"  # only SGLang lacks the kernels


# ----------------------------------------------------------------------------------------------
# 4. what needs Transformer Engine, without it; every GPU recipe


@pytest.mark.parametrize("over, message", [
    (["tensor_parallel=2", "trainer_workers=2", "sequence_parallel=true"], "sequence_parallel=true needs Transformer "
     "Engine's layer spec on CUDA, and the local one is built (transformer_engine does not import here"),
    (["layer_spec=te"], "layer_spec='te' but transformer_engine does not import here"),
    (["context_parallel=2", "trainer_workers=2"], "context_parallel=2 needs Transformer Engine's attention"),
    (["max_tokens_per_micro_batch=512"], "attention takes no packed (THD) sequences"),
])
def test_what_needs_te_is_refused_without_it(monkeypatch, over, message):
    monkeypatch.setattr(convert, "_te_import_error", lambda: NO_TE)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        _cuda_cfg(*over)
    assert "docs/GPU.md" in str(e.value)  # where to read how to install it


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_every_gpu_recipe_checks_and_starts_without_te(monkeypatch, capsys, recipe):
    monkeypatch.setattr(convert, "_te_import_error", lambda: NO_TE)
    assert yaml.safe_load((ROOT / recipe).read_text())["dtype"] == "bfloat16"
    assert loongsage.main([str(ROOT / recipe), "--check"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("megatron fast paths: "))
    assert line.startswith("megatron fast paths: layer spec auto -> local here; "), line
    assert convert.layer_spec(config.load_config(str(ROOT / recipe)), on_cpu=False) == "local"  # the trainers' check


def test_the_gpu_recipes_are_all_found():
    assert {"recipes/qwen3_4b_gsm8k.yaml", "recipes/code_repair_gpu.yaml", "recipes/mopd_qwen3_gpu.yaml",
            "recipes/moonlight_16b_gpu.yaml", "recipes/qwen3_8b_lora_gpu.yaml"} <= set(GPU_RECIPES)
