"""Data for LoongSage: datasets, synthetic tasks, rewards, and the tiny tokenizer/model builder.

Nothing here can be downloaded on an offline laptop, so the tiny recipes build their own pieces:

* `build_tiny_tokenizer(dir, chat_format=...)`: a byte-level BPE tokenizer in HF format, trained deterministically
  on a synthetic corpus, a few hundred tokens, digits always single tokens (so arithmetic is learnable); the family
  (chat.FAMILIES: chatml, qwen3, llama3, mistral, deepseek_v3) gives its special tokens and chat template.
* `build_tiny_model(dir, ...)`: a randomly initialised Qwen3-architecture causal LM on that tokenizer, cached by
  its settings (`num_experts > 0`: a Qwen3-MoE; `model_type="deepseek_v3"`: MLA, dense first layers, then routed
  + shared experts; `norm_std > 0` randomises the norms too, as the test models do).
* `arith_samples(n, seed)`: the synthetic arithmetic task of the default CPU recipe.
* `sft_trajectory`, `reply_ids`, `turn_end`: warm-start examples in any chat format (the model's turn as the
  tokenizer's template renders it, through its end-of-turn token).
* rewards: plain functions `reward(response_text, sample) -> float` named in recipes by dotted path; for
  `reward: judge`, the judge's prompt (`judge_prompt`) and how its verdict is read (`judge_parser`).
* `load_dataset(spec)`: jsonl / parquet files, `synthetic:<task>:<n>:<seed>`, or `reasoning_gym:<task>:<n>:<seed>`
  (a family of the reasoning-gym package, generated here; reward `data.reasoning_gym_score`, its own scorer).
* `import_object(dotted)`: the one resolver of every extension point (`mod.fn` or `mod:fn`,
  docs/EXTENDING.md).

Run `python data.py /tmp/tiny` to build the tiny model and print its size. Tested by tests/test_data.py.
Left out: streaming datasets and on-the-fly packing; datasets here are lists of dicts held in memory.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

import chat
# transformers is imported inside the functions that use it: its model classes pull in torch._dynamo and
# torch.distributed.tensor (~2-3 s per process on 2 cores), and every process that imports loongsage or trainer
# (Ray actors, `loongsage.py --check`) imports this module, mostly without building a model.

# Qwen2-style pre-tokenizer split: digits one at a time, words with an optional leading space.
_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


# ----------------------------------------------------------------------------------------------
# synthetic tasks


def arith_problem(rng: random.Random, max_operand: int = 99, ops: str = "+-") -> dict:
    """One arithmetic question as a chat sample: {"messages": [...], "answer": "42"}."""
    a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
    if op == "-" and b > a:
        a, b = b, a
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"messages": [{"role": "user", "content": f"{a}{op}{b}"}], "answer": str(answer)}


def arith_samples(n: int, seed: int, max_operand: int = 99, ops: str = "+-") -> list[dict]:
    rng = random.Random(seed)
    return [arith_problem(rng, max_operand, ops) for _ in range(n)]


def calc_samples(n: int, seed: int) -> list[dict]:
    """Multi-step arithmetic questions meant to be solved with a calculator tool (tool-use recipes)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
        out.append({"messages": [{"role": "user", "content": f"({a}+{b})*{c}"}], "answer": str((a + b) * c)})
    return out


def reasoning_gym_samples(task: str, n: int, seed: int, settings: dict) -> list[dict]:
    """n items of the reasoning-gym family `task` (its generator at `settings`, its defaults elsewhere) as chat
    samples; `reasoning_gym` holds what the family's own score_answer needs (reasoning_gym_score). reasoning-gym
    draws item i from Random(seed + i): the items are seeds seed .. seed+n-1, so a held-out eval set of the same
    family needs a seed range apart from training's (eval seed >= train seed + n); load_data reports the overlap."""
    import reasoning_gym  # here: ~100 generators and their dependencies load only for runs that use them
    try:
        items = list(reasoning_gym.create_dataset(task, size=n, seed=seed, **settings))
    except (ValueError, TypeError, AssertionError) as e:
        raise ValueError(f"reasoning_gym:{task} with settings {settings}: {e!r}. Tasks: "
                         f"{sorted(reasoning_gym.factory.DATASETS)}; settings are the fields of the task's config "
                         "class (reasoning_gym.factory.DATASETS[task][1])") from None
    return [{"messages": [{"role": "user", "content": e["question"]}], "answer": e["answer"],
             "reasoning_gym": {"task": task, "settings": settings, "entry": e}} for e in items]


@functools.lru_cache(maxsize=64)
def _rg_scorer(task: str, settings_json: str):
    """A family's score_answer, from a generator built with the samples' settings (one per task and settings)."""
    import reasoning_gym  # late: as in reasoning_gym_samples
    return reasoning_gym.create_dataset(task, size=1, seed=0, **json.loads(settings_json)).score_answer


def _corpus(seed: int = 0) -> list[str]:
    """Deterministic text the tiny tokenizer is trained on: the tasks, chat turns and tool traffic."""
    rng = random.Random(seed)
    words = ("the a is of to and what answer question tool call result sum difference number compute "
             "please use calculator python think step first then final error output input run test code "
             "def return print file line fix bug patch value true false none you i we it this that").split()
    lines = [f"{s['messages'][0]['content']}={s['answer']}" for s in (arith_problem(rng) for _ in range(3000))]
    lines += [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + rng.choice([".", "?", "!", ":"])
              for _ in range(1000)]
    for _ in range(300):
        expr = f"({rng.randint(10, 99)}+{rng.randint(10, 99)})*{rng.randint(2, 9)}"
        lines.append(json.dumps({"name": "calculator", "arguments": {"expression": expr}}))
        lines.append(json.dumps({"type": "function", "function": {"name": "calculator", "description":
                                 "evaluate an arithmetic expression", "parameters": {"type": "object"}}}))
    lines += ["system user assistant tool Tools:", "# Tools\nCall a tool with"]
    return lines


# ----------------------------------------------------------------------------------------------
# the tiny tokenizer and model


def build_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 384, chat_format: str = "chatml") -> None:
    """Train a byte-level BPE tokenizer on `_corpus()` and save it in HF format with the chat template of family
    `chat_format` (chat.FAMILIES: its special tokens, bos/eos/pad and template; the template's fixed prose joins
    the corpus so it costs few tokens)."""
    from transformers import PreTrainedTokenizerFast  # late: see the note at the top

    if chat_format not in chat.FAMILIES:
        raise ValueError(f"chat_format={chat_format!r}: the tiny tokenizer is built in one of {sorted(chat.FAMILIES)}")
    fam = chat.FAMILIES[chat_format]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=fam["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus() + fam["corpus"] * 50, trainer=trainer)
    names = {k: fam[k] for k in ("bos", "eos", "pad") if fam[k]}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{k}_token": v for k, v in names.items()},
                                 additional_special_tokens=fam["special"][1:], clean_up_tokenization_spaces=False)
    hf.chat_template = fam["template"]
    hf.save_pretrained(str(out_dir))


TINY_DEFAULTS = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, intermediate_size=384, max_position_embeddings=512, vocab_multiple=64,
                     tie_word_embeddings=False, seed=0, tokenizer_vocab=384, norm_std=0.0,
                     num_experts=0, num_experts_per_tok=2, moe_intermediate_size=96,
                     model_type="qwen3",  # "qwen3" (Qwen3-MoE with num_experts > 0) or "deepseek_v3"
                     chat_format="chatml",  # the tokenizer's family (chat.FAMILIES): chatml, qwen3, llama3, ...
                     # deepseek_v3 only (num_key_value_heads and head_dim do not apply to it; q_lora_rank 0: no q
                     # compression, one q_proj): latent ranks and head sizes of multi-latent attention, the MoE
                     q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=1.0)
# MoE settings count only when num_experts > 0, DeepSeek-V3's only for model_type deepseek_v3, chat_format only when
# it is not chatml: a dense Qwen3's cache stamp (and so every cached dense model and its SFT warm start) stays what it
# was before these keys existed.
TINY_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
TINY_DEEPSEEK_KEYS = ("model_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                      "v_head_dim", "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
                      "routed_scaling_factor")


def build_tiny_model(out_dir: str | os.PathLike, **settings) -> str:
    """Build (or reuse) a random Qwen3 causal LM + tokenizer in HF format at `out_dir` (a Qwen3-MoE with
    `num_experts` experts of width `moe_intermediate_size`, top-`num_experts_per_tok` routing, when num_experts > 0).

    The directory holds `loongsage_tiny.json` with the settings it was built from; a directory built
    from other settings is rebuilt. Returns the path as a string.
    """

    s = {**TINY_DEFAULTS, **settings}
    unknown = set(settings) - set(TINY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny-model setting(s) {sorted(unknown)}; valid: {sorted(TINY_DEFAULTS)}")
    if s["model_type"] not in ("qwen3", "deepseek_v3"):
        raise ValueError(f"model_type={s['model_type']!r}: the tiny builder makes 'qwen3' or 'deepseek_v3' models")
    deepseek, moe = s["model_type"] == "deepseek_v3", int(s["num_experts"]) > 0
    if deepseek and not moe:
        raise ValueError("model_type='deepseek_v3' needs num_experts > 0 (its layers after first_k_dense_replace "
                         "route over experts)")
    if moe and not 1 <= s["num_experts_per_tok"] <= s["num_experts"]:
        raise ValueError(f"num_experts_per_tok={s['num_experts_per_tok']} must be in [1, num_experts="
                         f"{s['num_experts']}]")
    s = {k: v for k, v in s.items() if (moe or k not in TINY_MOE_KEYS) and (deepseek or k not in TINY_DEEPSEEK_KEYS)}
    if s["chat_format"] == "chatml":
        del s["chat_format"]
    out = Path(out_dir)
    stamp = out / "loongsage_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == s and (out / "model.safetensors").exists():
        return str(out)
    # late, and only to build: see the note at the top (transformers' model classes cost seconds to import)
    from transformers import (AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_tiny_tokenizer(out, s["tokenizer_vocab"], s.get("chat_format", "chatml"))
    tok = AutoTokenizer.from_pretrained(str(out))
    m = s["vocab_multiple"]
    common = dict(
        vocab_size=(len(tok) + m - 1) // m * m, hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_hidden_layers"],
        num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"],
        head_dim=s["head_dim"], max_position_embeddings=s["max_position_embeddings"], rms_norm_eps=1e-6,
        tie_word_embeddings=s["tie_word_embeddings"], bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if deepseek:  # every head its own k and v (MLA): no key-value groups, no head_dim; no multi-token prediction
        common = {k: v for k, v in common.items() if k not in ("num_key_value_heads", "head_dim")}
        config = DeepseekV3Config(
            **common, n_routed_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
            moe_intermediate_size=s["moe_intermediate_size"], n_shared_experts=s["n_shared_experts"],
            n_group=s["n_group"], topk_group=s["topk_group"], first_k_dense_replace=s["first_k_dense_replace"],
            routed_scaling_factor=s["routed_scaling_factor"], norm_topk_prob=True, q_lora_rank=s["q_lora_rank"] or None,
            kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=s["qk_nope_head_dim"],
            qk_rope_head_dim=s["qk_rope_head_dim"], v_head_dim=s["v_head_dim"], num_nextn_predict_layers=0,
            architectures=["DeepseekV3ForCausalLM"])
        cls = DeepseekV3ForCausalLM
    elif moe:  # every layer sparse (mlp_only_layers=[]), top-k probabilities renormalised as Qwen3-MoE ships
        config = Qwen3MoeConfig(**common, num_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
                                moe_intermediate_size=s["moe_intermediate_size"], norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])
        cls = Qwen3MoeForCausalLM
    else:
        config, cls = Qwen3Config(**common, architectures=["Qwen3ForCausalLM"]), Qwen3ForCausalLM
    torch.manual_seed(s["seed"])
    model = cls(config).to(torch.float32)
    if s["norm_std"]:
        # Tests: norm weights (RMSNorm, q_norm/k_norm) initialise to exactly 1, so a conversion or engine that
        # dropped or swapped one would give the same outputs. Drawing them as 1 + norm_std * N(0, 1) makes
        # every parameter of the test models random, and such a bug visible. DeepSeek-V3's score-correction
        # biases start at 0 for the same effect: they get norm_std/4 * N(0, 1), about the spread of the
        # routers' sigmoid scores, so they change which experts win.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(s["norm_std"] * torch.randn_like(p))
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.add_(s["norm_std"] / 4 * torch.randn_like(b))
    # every token that ends a generation, as the family's published generation_config.json lists them
    stop = chat.FAMILIES[s.get("chat_format", "chatml")]["stop"]
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(stop)
    model.save_pretrained(str(out))  # safetensors
    stamp.write_text(json.dumps(s))
    return str(out)


def default_cache_dir() -> Path:
    return Path(os.environ.get("LOONGSAGE_CACHE", Path.home() / ".cache" / "loongsage"))


def settings_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer  # late: see the note at the top
    return AutoTokenizer.from_pretrained(path)


# ----------------------------------------------------------------------------------------------
# datasets


def load_dataset(spec: str) -> list[dict]:
    """A list of samples from `path.jsonl`, `path.parquet`, `synthetic:<arith|add|sub|calc>:<n>:<seed>[:<max_operand>]`
    or `reasoning_gym:<task>:<n>:<seed>[:<key>=<value>,...]` (reasoning_gym_samples; values read as JSON), or
    `module.fn:<arg>:...` (fn(*args) -> samples, the args as strings, e.g. recipes.repair.tasks:train:512:1). Each
    sample is a dict; chat samples hold `messages` (or `prompt`, wrapped as one user turn) and usually `answer`."""
    if spec.startswith("reasoning_gym:"):
        parts = spec.split(":", 4)
        if len(parts) not in (4, 5) or not parts[2].isdigit() or not parts[3].isdigit():
            raise ValueError(f"reasoning-gym dataset spec {spec!r} must look like 'reasoning_gym:<task>:<n>:<seed>' "
                             "or 'reasoning_gym:<task>:<n>:<seed>:<key>=<value>,...' (the task's config fields)")
        settings = {}
        for kv in filter(None, parts[4].split(",") if len(parts) == 5 else []):
            key, eq, value = kv.partition("=")
            if not eq:
                raise ValueError(f"{spec!r}: setting {kv!r} is not <key>=<value>")
            try:
                settings[key] = json.loads(value)
            except json.JSONDecodeError:
                settings[key] = value  # a bare word is a string
        return reasoning_gym_samples(parts[1], int(parts[2]), int(parts[3]), settings)
    if spec.startswith("synthetic:"):
        parts = spec.split(":")
        if (len(parts) not in (4, 5) or parts[1] not in ("arith", "add", "sub", "calc")
                or not all(p.isdigit() for p in parts[2:])):
            raise ValueError(f"synthetic dataset spec {spec!r} must look like "
                             "'synthetic:arith:<n>:<seed>[:<max_operand>]' (or add / sub for one operation), or "
                             "'synthetic:calc:<n>:<seed>'")
        n, seed = int(parts[2]), int(parts[3])
        if parts[1] == "calc":
            return calc_samples(n, seed)
        ops = {"arith": "+-", "add": "+", "sub": "-"}[parts[1]]  # add / sub: one sub-task each (mopd recipe)
        return arith_samples(n, seed, max_operand=int(parts[4]) if len(parts) == 5 else 99, ops=ops)
    head, _, args = spec.partition(":")
    if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", head) and head.rsplit(".", 1)[1] not in ("jsonl", "parquet"):
        return import_object(head)(*filter(None, args.split(":")))  # a generator: module.fn:<arg>:<arg>...
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"dataset {spec!r} does not exist; give a .jsonl/.parquet path, 'synthetic:arith:"
                                "<n>:<seed>', 'reasoning_gym:<task>:<n>:<seed>' or a generator 'module.fn:<arg>:...'")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # late: the lent GPU machine (scripts/gpu_check.py) has no pyarrow
        # a column some rows lack reads back as None in those rows: drop it, as if the key were absent (jsonl)
        rows = [{k: v for k, v in r.items() if v is not None} for r in pq.read_table(path).to_pylist()]
    elif path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{spec} line {n} is not JSON ({e}); a .jsonl file holds one JSON object "
                                     "per line") from None
    else:
        raise ValueError(f"dataset {spec!r}: unknown format {path.suffix!r}; give a .jsonl or .parquet file "
                         "or 'synthetic:arith:<n>:<seed>'")
    for i, r in enumerate(rows):
        if "messages" not in r:
            if "prompt" not in r:
                raise ValueError(f"{spec} row {i} has neither 'messages' nor 'prompt' (keys: {sorted(r)})")
            r["messages"] = [{"role": "user", "content": r["prompt"]}]
    return rows


def prompt_ids(tok, sample: dict, tools: list | None = None) -> list[int]:
    """The chat-template token ids of a sample's messages, ending with the assistant header."""
    text = tok.apply_chat_template(sample["messages"], tools=tools, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


_TURN_ENDS: dict[int, tuple] = {}  # id(tokenizer) -> (tokenizer, its end-of-turn token): one probe render each; the
#                                    reference held keeps the id from being reused by another tokenizer


def turn_end(tok) -> str:
    """The token a tokenizer's chat template closes an assistant turn with (<|eot_id|> for Llama 3, </s>, ...): the
    special token its assistant suffix starts with."""
    if id(tok) not in _TURN_ENDS:
        suffix = chat.assistant_suffix(lambda m: tok.apply_chat_template(m, tokenize=False))
        _TURN_ENDS[id(tok)] = (tok, chat.turn_end(suffix, tok.all_special_tokens))
    return _TURN_ENDS[id(tok)][1]


def reply_ids(tok, messages: list[dict], reply: dict, tools: list | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids): the chat's generation prompt, and what the model writes for `reply` in the chat
    template's format through its end-of-turn token (thinking block, tool-call syntax and all)."""
    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
    prompt, text = chat.reply_text(render, messages, reply, turn_end(tok))
    return tok.encode(prompt, add_special_tokens=False), tok.encode(text, add_special_tokens=False)


def sft_trajectory(tok, sample: dict, rng: random.Random | None = None, label_noise: float = 0.0) -> dict:
    """A supervised example in trajectory form: the answer as the model's turn (the chat template's rendering of it,
    its end-of-turn token included: "42<|eot_id|>" for Llama 3), all of it in the loss.

    With probability `label_noise` the answer is replaced by a near miss (the right number plus or
    minus one). The tiny recipes warm-start on such labels on purpose: the policy then knows the
    format and is right only part of the time, and RL with the exact reward has to find the rest.
    """
    answer = str(sample["answer"])
    if label_noise and rng is not None and rng.random() < label_noise and answer.lstrip("-").isdigit():
        answer = str(int(answer) + rng.choice((-1, 1)))
    p, r = reply_ids(tok, sample["messages"], {"role": "assistant", "content": answer})
    return {"prompt_ids": p, "response_ids": r, "loss_mask": [1] * len(r), "rollout_logprobs": [0.0] * len(r),
            "weight_versions": [-1] * len(r), "reward": 0.0, "status": "ok", "group_id": 0, "sample_index": 0}


# ----------------------------------------------------------------------------------------------
# rewards: reward(response_text, sample) -> float


def exact_match(response: str, sample: dict) -> float:
    """1.0 when the response, stripped, equals the answer exactly; else 0.0."""
    return float(response.strip() == str(sample["answer"]).strip())


def char_match(response: str, sample: dict) -> float:
    """Partial credit: the fraction of the answer's characters the response has in the same place,
    scaled down by extra characters. Dense where exact_match is sparse (e.g. an untrained model)."""
    got, want = response.strip(), str(sample["answer"]).strip()
    hits = sum(a == b for a, b in zip(got, want))
    return hits / max(len(want), len(got), 1)


def last_number_match(response: str, sample: dict) -> float:
    """1.0 when the last number in the response equals the answer numerically."""
    nums = re.findall(r"-?\d+(?:\.\d+)?", response.replace(",", ""))
    try:
        return float(bool(nums) and float(nums[-1]) == float(sample["answer"]))
    except ValueError:
        return 0.0


def math_verify(response: str, sample: dict) -> float:
    """Math answer equivalence with math-verify (LaTeX / boxed / plain numbers), 1.0 or 0.0."""
    from math_verify import parse, verify  # here: it loads sympy (~1-2 s), paid only by runs using this reward
    gold = parse(str(sample["answer"]))
    pred = parse(response)
    return float(bool(gold) and bool(pred) and verify(gold, pred))


def reasoning_gym_score(response: str, sample: dict) -> float:
    """The sample's reasoning-gym family scores the response with its own score_answer, on the text of the last
    <answer>...</answer> when there is one (reasoning-gym's prompts ask for it), else on the whole response."""
    from reasoning_gym.utils import extract_answer  # late: as in reasoning_gym_samples
    rg = sample["reasoning_gym"]
    answer = extract_answer(response) if "<answer>" in response else response.strip()
    return float(_rg_scorer(rg["task"], json.dumps(rg["settings"], sort_keys=True))(answer, rg["entry"]))


# ----------------------------------------------------------------------------------------------
# extension points


def task_text(sample: dict) -> str:
    """A sample's task as one text, its last user message: what a black-box agent gets, a judge's {prompt}."""
    users = [m.get("content", "") for m in sample.get("messages", []) if m.get("role") == "user"]
    return str(users[-1] if users else sample.get("prompt", ""))


def judge_prompt(template: str, sample: dict, response: str) -> str:
    """The text a judge model reads (`reward: judge`, agentflow.AgentFlow._judge): `template` with {prompt} (the
    sample's last user message), {response} (what is judged) and {answer} (the sample's reference, "" if none)."""
    return template.format(prompt=task_text(sample), response=response, answer=sample.get("answer", ""))


def judge_parser(parse: str):
    """A judge's `parse` as fn(verdict text) -> float. A dotted path (word characters, dots, a colon) is imported;
    anything else is a regex, whose first group (the whole match, without groups) is read as the number: a verdict it
    does not match raises, and that trajectory fails. A regex that looks like a dotted path needs escaping (a\\.b)."""
    if is_dotted(parse) and re.fullmatch(r"[\w.:]+", parse):
        try:
            return import_object(parse)
        except ValueError as e:
            raise ValueError(f"judge.parse: {e}") from None
    try:
        pattern = re.compile(parse)
    except re.error as e:
        raise ValueError(f"judge.parse={parse!r} is neither a dotted path to fn(text) -> float nor a valid regex "
                         f"({e}); e.g. parse: 'Score: ([0-9.]+)'") from None
    if pattern.groups > 1:
        raise ValueError(f"judge.parse={parse!r} has {pattern.groups} groups; use at most one, around the number")

    def parse_with_regex(text: str) -> float:
        m = pattern.search(text)
        if m is None:
            raise ValueError(f"the judge's verdict {text[:200]!r} does not match judge.parse={parse!r}")
        return float(m.group(1 if pattern.groups else 0))
    return parse_with_regex


def is_dotted(name) -> bool:
    """True for a string naming user code ("pkg.mod.fn" or "pkg.mod:fn"); built-in variant names have no '.' or ':'."""
    return isinstance(name, str) and ("." in name or ":" in name)


def import_object(dotted: str):
    """`"recipes.calc.agent"` or `"mypkg.mod:agent"` -> the object. The one resolver of every extension point
    (docs/EXTENDING.md): the module may live anywhere on sys.path / PYTHONPATH, outside this repo too.
    After a ':' the rest is an attribute path (`mod:Class.method`)."""
    module, _, name = dotted.partition(":") if ":" in dotted else dotted.rpartition(".")
    if not module or not name:
        raise ValueError(f"{dotted!r} is not a dotted path like 'data.exact_match' or 'mypkg.rewards:score'")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {dotted!r}: {e}. Give 'module.function' (or 'module:function') importable "
                         "from the repo root or from a directory on PYTHONPATH") from e


if __name__ == "__main__":
    from transformers import AutoConfig  # late: see the note at the top
    path = build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else default_cache_dir() / "tiny-test")
    print(path, AutoConfig.from_pretrained(path))
