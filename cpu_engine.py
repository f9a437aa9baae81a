"""The CPU engine: LoongSage's stand-in for SGLang 0.5.23 where there is no CUDA, serving SGLang's native HTTP API.

It must be as strict as SGLang: a request SGLang refuses is refused here too, and an SGLang option the engine does not
implement is refused with a 400 naming it, never ignored, so the laptop runs and the test suite exercise the very
calls a GPU run makes. The contract both engines serve (fields, logprob semantics, weight versions, pause modes,
memory tags, routed experts) is written down once, in docs/ENGINES.md; this file is how the CPU engine meets it.

Reading order: requests (`SamplingParams`, `parse_sampling_params`, `Req`, `response`); `LoraRegistry`; `PrefixCache`;
`CpuEngine` (the scheduler); the HTTP server (`build_app`, `serve`); below them, as in SGLang, cpu_model.ModelRunner.

* `CpuEngine`: continuous batching, one scheduler thread owning all engine state; weight loads, pauses and memory
  release run between two steps. `PrefixCache`: SGLang's radix cache, one entry per KV slot (`--disable-radix-cache`).
* Weight updates as SGLang 0.5.23 takes them: tensor and distributed updates only inside a begin/end session;
  `serialized_named_tensors[0]` read as SGLang's payload (`transfermesh.read_tensor_payload`; else a 400); broadcasts
  through SGLang's own rendezvous (`transfermesh.new_sglang_group`, gloo); a bad bucket checksum is a 400, weights kept.
* LoRA adapters as SGLang 0.5.23 serves them (`lora={...}`: its --enable-lora and two flags): loaded from a PEFT
  directory or a weight update's payload (`expected_checksums` verified), unloaded once no request uses them, named by
  `/generate`'s `lora_path` (kept to the end); an adapter adds scale * (x A^T) B^T beside each projection, unmerged.
* Constrained decoding as SGLang's xgrammar backend does it: `sampling_params.json_schema` / `regex` / `ebnf` /
  `structural_tag` compiled when the request arrives (`compile_grammar`: SGLang's 400 text for one that does not
  compile, and for the schema keywords SGLang refuses because xgrammar would ignore them), one xgrammar matcher per
  request, its token bitmask applied to the logits before sampling (`mask_by_grammar`), so the logprob returned is
  that of the masked distribution, as SGLang's (docs/ENGINES.md); a grammar that completes finishes it as a stop.

Determinism. Each request draws from its own `torch.Generator`, seeded by its `sampling_seed` under deterministic
inference (SGLang's 42 without one), else by the engine seed and its arrival index, whatever else is in the batch.

Run: `python cpu_engine.py --model-path DIR --port 30000`. Test: `pytest tests/test_cpu_engine.py` (against
transformers, over real HTTP), `tests/test_conformance.py` (SGLANG_BEHAVIOURS), test_moe, test_deepseek, test_colocate,
test_lora, test_token_stream.

Left out: text stop strings, penalties, `n > 1` (send a batch of input_ids instead), LoRA on MoE experts, MLA,
embeddings or the LM head, multimodal input, a deferred `/flush_cache?timeout=`, `--incremental-streaming-output`
(chunks are cumulative, SGLang's default), SGLang's reasoning-aware grammars (here a grammar holds from the first
token), `--constrained-json-disable-any-whitespace` (any whitespace, SGLang's default), a grammar compiled off the
scheduler's path (SGLang compiles in a thread pool; here before the request is queued). A
stream=true request that SGLang's schema admits but its checks refuse (a negative temperature, a prompt past the
context) gets a 400 before the stream here, where SGLang answers 200 and an error event. A dropped HTTP connection
aborts a streamed request but not a plain one (call /abort_request).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import dataclasses
import difflib
import glob
import json
import mmap
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import uuid

import torch
import uvicorn
from fastapi import Depends, FastAPI, Request  # Request at module level: FastAPI resolves annotations by name
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from safetensors.torch import load_file
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

import lora
import transfermesh
from cpu_model import BadRequest, LoraAdapter, ModelRunner, mask_by_grammar, sample


class FlushRefused(BadRequest):
    """A weight update loaded, but its flush_cache found the engine busy: SGLang's answer is success false."""


# Where SGLang 0.5.23 refuses, blocks, ignores or dies, so does the CPU engine: behaviour -> (what both do, where SGLang
# does it, under sglang/srt/). A run that survives these here survives them on a GPU. tests/test_conformance.py holds
# one test per key, named test_<key>.
SGLANG_BEHAVIOURS = {
    "health_generates": (
        "GET /health and /health_generate submit a one-token generation, then every second look whether the engine "
        "answered anything since: 200 when it has, 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s). A paused or "
        "released engine answers nothing, so it gets its 503 20 s late",
        "entrypoints/http_server.py health_generate"),
    "health_without_generation": (
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false (false/0/no/n, any case; anything else keeps the default, "
        "true) makes /health answer 200 at once; /health_generate still generates",
        "environ.py EnvBool; entrypoints/http_server.py health_generate"),
    "server_info_while_paused": (
        "/server_info (and the deprecated /get_server_info) is answered by the scheduler between two steps, paused "
        "or with its memory released too: the liveness probe that reads a paused engine right",
        "managers/scheduler.py event_loop_normal (ingest_requests before the pause check), get_internal_state"),
    "resume_of_an_unreleased_tag_kills_the_server": (
        "/resume_memory_occupation of a tag that is not released (no tags = kv_cache, weights and cuda_graph) raises "
        "KeyError in the scheduler, and a scheduler exception ends the whole server",
        "managers/scheduler_components/weight_updater.py resume_memory_occupation (offload_tags.remove); "
        "managers/scheduler.py run_scheduler_process"),
    "release_while_busy_kills_the_server": (
        "/release_memory_occupation while a request runs (or waits, unless paused) fails the scheduler's idle "
        "assertion, and the server ends",
        "managers/scheduler_components/weight_updater.py release_memory_occupation"),
    "memory_calls_answer_null": (
        "/release_memory_occupation and /resume_memory_occupation answer a JSON null",
        "entrypoints/http_server.py release_memory_occupation, resume_memory_occupation"),
    "updates_need_a_session": (
        "tensor and distributed weight updates outside /begin_weight_update ... /end_weight_update answer "
        "success false (400)",
        "managers/scheduler_components/weight_updater.py update_weights_from_tensor, "
        "update_weights_from_distributed"),
    "unknown_sampling_params_are_refused": (
        "an unknown sampling_params key is a 400 naming it and the keys SGLang knows; unknown top-level keys of "
        "/generate are ignored",
        "entrypoints/api_contract.py generate_contract_error; ../api/v1/api_types.py SamplingParams"),
    "sampling_seed_needs_deterministic_inference": (
        "sampling_params.sampling_seed seeds a request only under --enable-deterministic-inference (a request "
        "without one then uses 42); otherwise it is ignored",
        "sampling/sampling_batch_info.py SamplingBatchInfo.from_schedule_batch"),
    "prefix_cache_outlives_a_weight_update": (
        "a finished or retracted request leaves its prefix K/V for later requests under the same LoRA adapter "
        "(meta_info.cached_tokens; tests/test_lora.py for the adapter); an "
        "update with flush_cache false keeps it, so new requests run over K/V the old weights computed, until "
        "/flush_cache, an update with flush_cache true (the default) or a kv_cache release drops it",
        "mem_cache/radix_cache.py; managers/schedule_batch.py Req (lora_id in extra_key); "
        "managers/scheduler_components/weight_updater.py "
        "flush_cache_after_weight_update, release_memory_occupation"),
    "flush_is_refused_while_busy": (
        "/flush_cache answers 400 while a request runs (or waits, unless paused); an update with flush_cache true "
        "then loads the weights and answers success false (400)",
        "managers/scheduler.py flush_cache; managers/scheduler_components/weight_updater.py "
        "flush_cache_after_weight_update"),
    "weight_update_group_names_are_unique": (
        "/init_weights_update_group with a group name already in use fails (torch refuses a second group of one "
        "name); /destroy_weights_update_group of an unknown name fails",
        "model_executor/model_runner_components/weight_updater.py init_weights_update_group, "
        "destroy_weights_update_group; utils/common.py init_custom_process_group"),
}


# ----------------------------------------------------------------------------------------------
# requests, sampling, and SGLang's memory tags and weight-version spans


@dataclasses.dataclass
class SamplingParams:
    """The subset of SGLang's sampling parameters the CPU engine implements (same names and defaults)."""
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # nucleus mass kept, (0, 1]
    top_k: int = -1                   # -1 (or 0) = no top-k
    min_p: float = 0.0                # drop tokens with prob < min_p * max prob
    max_new_tokens: int = 128
    stop_token_ids: list = dataclasses.field(default_factory=list)  # finish when one is sampled (kept in output)
    ignore_eos: bool = False          # when False the model's eos token(s) also stop
    skip_special_tokens: bool = True  # for the returned text only
    no_stop_trim: bool = False        # keep the matched stop token in the returned text
    sampling_seed: int | None = None  # per-request seed, honoured under enable_deterministic_inference only
    stream_interval: int | None = None  # stream=true: a chunk every this many tokens (None: the server's, 1)
    # constrained decoding, at most one (SGLang's fields, compiled by xgrammar as its default backend does): a JSON
    # schema as a JSON string, a regex, an EBNF grammar (xgrammar's GBNF), an xgrammar structural tag as JSON
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None


# Every key SGLang 0.5.23's /generate schema knows in sampling_params, in its order (api/v1/api_types.py
# SamplingParams, "unknown keys rejected"): any other key is a 400.
SGLANG_SAMPLING_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                        "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
                        "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
# SGLang parameters the CPU engine accepts only at their neutral value (anything else is a 400 saying so).
_NEUTRAL_PARAMS = {"n": 1, "stop": None, "stop_regex": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                   "repetition_penalty": 1.0, "min_new_tokens": 0, "logit_bias": None, "custom_params": None,
                   "spaces_between_special_tokens": True, "beam_width": None, "watermark": None, "choice": None}


def parse_sampling_params(raw, vocab_size: int) -> SamplingParams:
    """Validate a JSON sampling_params dict into SamplingParams; raises BadRequest naming the bad key and value."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be a JSON object, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    out = SamplingParams()
    for key, value in raw.items():
        if key in _NEUTRAL_PARAMS:
            if value not in (_NEUTRAL_PARAMS[key], None, [], "", {}):
                raise BadRequest(f"sampling_params.{key}={value!r} is not implemented by the CPU engine; leave it "
                                 f"at {_NEUTRAL_PARAMS[key]!r} (or use engine=sglang)")
            continue
        if key not in fields:  # SGLang's schema error text, then the closest key
            close = difflib.get_close_matches(key, SGLANG_SAMPLING_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise BadRequest(f"sampling_params: unknown field `{key}`, expected one of "
                             f"{', '.join(f'`{k}`' for k in SGLANG_SAMPLING_KEYS)}{hint}")
        if value is not None:
            setattr(out, key, value)
    try:
        out.temperature, out.top_p, out.min_p = float(out.temperature), float(out.top_p), float(out.min_p)
        out.top_k, out.max_new_tokens = int(out.top_k), int(out.max_new_tokens)
        out.stop_token_ids = [int(t) for t in (out.stop_token_ids or [])]
        out.sampling_seed = None if out.sampling_seed is None else int(out.sampling_seed)
        out.stream_interval = None if out.stream_interval is None else int(out.stream_interval)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"sampling_params has a value of the wrong type: {e}") from None
    for key in GRAMMAR_KEYS:
        value = getattr(out, key)
        if value is not None and not isinstance(value, str):  # SGLang's contract check, its words
            raise BadRequest(f"sampling_params.{key}: invalid type: {type(value).__name__} {value!r:.80}, "
                             "expected a string")
        setattr(out, key, value or None)  # SGLang normalizes "" to unset
    if sum(getattr(out, k) is not None for k in GRAMMAR_KEYS) > 1:
        raise BadRequest("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    if out.temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0 (0 = greedy), got {out.temperature}")
    if not 0 < out.top_p <= 1:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {out.top_p}")
    if not 0 <= out.min_p <= 1:
        raise BadRequest(f"sampling_params.min_p must be in [0, 1], got {out.min_p}")
    out.top_k = -1 if out.top_k == 0 else out.top_k
    if out.top_k < -1:
        raise BadRequest(f"sampling_params.top_k must be -1 (off) or >= 1, got {out.top_k}")
    if out.max_new_tokens < 0:
        raise BadRequest(f"sampling_params.max_new_tokens must be >= 0, got {out.max_new_tokens}")
    bad = [t for t in out.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"sampling_params.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    return out


GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")  # the constraints the CPU engine compiles

# What SGLang 0.5.23's xgrammar backend refuses in a JSON schema before compiling it, because xgrammar 0.2.x would
# accept it and not enforce it (constrained/json_schema_validation.py): these keywords anywhere in the schema, a string
# `format` outside the formats xgrammar implements, and two of format / pattern / min-maxLength on one string.
_XGRAMMAR_IGNORED_KEYWORDS = frozenset({"contains", "dependentRequired", "dependentSchemas", "else", "if",
                                        "maxContains", "minContains", "multipleOf", "not", "then", "uniqueItems"})
_XGRAMMAR_STRING_FORMATS = frozenset({"date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6",
                                      "json-pointer", "relative-json-pointer", "time", "uri", "uri-reference",
                                      "uri-template", "uuid"})


def _subschemas(schema, pointer: str = "#"):
    """(subschema, JSON pointer) of every schema-valued keyword, depth first (not `enum`/`const` values)."""
    if not isinstance(schema, dict):
        return
    yield schema, pointer
    for key, child in schema.items():
        if key in ("items", "additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if",
                   "not", "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties"):
            children = enumerate(child) if key == "items" and isinstance(child, list) else [(None, child)]
        elif key in ("allOf", "anyOf", "oneOf", "prefixItems") and isinstance(child, list):
            children = enumerate(child)
        elif key in ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties",
                     "dependencies") and isinstance(child, dict):
            children = ((k.replace("~", "~0").replace("/", "~1"), v) for k, v in child.items())
        else:
            continue
        for name, sub in children:
            yield from _subschemas(sub, f"{pointer}/{key}" + ("" if name is None else f"/{name}"))


def _check_schema_for_xgrammar(schema) -> None:
    for sub, pointer in _subschemas(schema):
        ignored = sorted(_XGRAMMAR_IGNORED_KEYWORDS & set(sub))
        if ignored:
            raise ValueError(f"JSON Schema at {pointer} is not supported by xgrammar: keyword(s) "
                             f"{', '.join(ignored)} would be ignored")
        kind = sub.get("type")
        if not (kind is None or kind == "string" or isinstance(kind, list) and "string" in kind):
            continue
        if "format" in sub and sub["format"] not in _XGRAMMAR_STRING_FORMATS:
            raise ValueError(f"JSON Schema at {pointer} is not supported by xgrammar: string format "
                             f"{sub['format']!r} is not implemented")
        groups = [g for g, keys in (("format", ("format",)), ("pattern", ("pattern",)),
                                    ("minLength/maxLength", ("minLength", "maxLength"))) if set(keys) & set(sub)]
        if len(groups) > 1:
            raise ValueError(f"JSON Schema at {pointer} is not supported by xgrammar: constraints "
                             f"{', '.join(groups)} cannot be enforced together")


def _holds_nul(v) -> bool:
    if isinstance(v, str):
        return "\x00" in v
    items = [*v.keys(), *v.values()] if isinstance(v, dict) else v if isinstance(v, list) else []
    return any(_holds_nul(x) for x in items)


def compile_grammar(compiler, params: SamplingParams):
    """The request's grammar compiled by xgrammar (`compiler`: an xgrammar.GrammarCompiler over the engine's
    tokenizer), or None when it asks for none. A grammar that does not compile is a 400 with SGLang's message
    ("Failed to compile json grammar: ..."): SGLang finishes such a request with an abort of status 400, which its
    /generate answers as a 400."""
    for key, kind in (("json_schema", "json"), ("regex", "regex"), ("ebnf", "ebnf"),
                      ("structural_tag", "structural_tag")):
        source = getattr(params, key)
        if source is None:
            continue
        if "\x00" in source:  # xgrammar's converters crash on a NUL; SGLang refuses it first
            raise BadRequest(f"Failed to compile {kind} grammar: Invalid {kind}: NUL bytes (\\u0000) are not allowed")
        try:
            if kind == "json":
                schema = json.loads(source)
                if _holds_nul(schema):
                    raise BadRequest(f"Failed to compile json grammar: Invalid json: NUL bytes (\\u0000) are not "
                                     "allowed")
                _check_schema_for_xgrammar(schema)
                return compiler.compile_json_schema(source, any_whitespace=True)
            if kind == "structural_tag":
                return _compile_structural_tag(compiler, source)
            return compiler.compile_regex(source) if kind == "regex" else compiler.compile_grammar(source)
        except BadRequest:
            raise
        except (RuntimeError, ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise BadRequest(f"Failed to compile {kind} grammar: {e}") from None
    return None


def _compile_structural_tag(compiler, source: str):
    """A `structural_tag` as SGLang's xgrammar backend compiles it: the legacy form ({"structures": [{begin, schema,
    end}], "triggers", "at_least_one"}) converted to xgrammar's StructuralTag, any other form ({"type":
    "structural_tag", "format": ...}) handed to xgrammar as JSON, a missing json_schema being the empty schema."""
    import xgrammar  # here: only a constrained request needs it

    tag = json.loads(source)
    if not isinstance(tag, dict) or not (tag.get("structures") is not None or tag.get("format") is not None):
        raise ValueError(f"a structural_tag needs 'structures' and 'triggers' (legacy) or 'format', got "
                         f"{source!r:.200}")
    if tag.get("structures") is not None:
        if tag.get("triggers") is None:
            raise ValueError("a legacy structural_tag with 'structures' needs 'triggers'")
        items = [xgrammar.StructuralTagItem(begin=x["begin"], schema=json.dumps(x.get("schema") or {}), end=x["end"])
                 for x in tag["structures"]]
        new = xgrammar.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
        new.format.at_least_one = bool(tag.get("at_least_one", False))
        return compiler.compile_structural_tag(new)

    def empty_schemas(f):
        if isinstance(f, dict):
            if f.get("type") == "json_schema" and f.get("json_schema") is None:
                f["json_schema"] = {}
            for key in ("content", "elements", "tags"):
                for sub in (f.get(key) if isinstance(f.get(key), list) else [f.get(key)]):
                    empty_schemas(sub)
    empty_schemas(tag["format"])
    return compiler.compile_structural_tag(json.dumps(tag))


MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES, in its order (constants.py)


def _memory_tags(tags) -> list[str]:
    """SGLang's `tags` field: None or [] means all three; each must be one of MEMORY_TAGS (SGLang takes any name
    without a word; a misspelt one is refused here). cuda_graph holds no memory in the CPU engine but is tracked like
    the others, so a resume of it has the same fate as on SGLang."""
    if tags is None or tags == []:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
        raise BadRequest(f"tags must be a list of {list(MEMORY_TAGS)} (or none for all), got {tags!r}")
    return tags


def weight_version_spans(versions: list[str], current: str) -> list[dict]:
    """Per-token versions as SGLang's spans: [{"version", "start", "end"}, ...], end exclusive, one span per run of
    equal versions; no tokens yet -> one empty span of the current version (as SGLang reports it)."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


@dataclasses.dataclass(eq=False)
class Req:
    """One generation request as the scheduler tracks it."""
    rid: str
    prompt_ids: list                      # token ids of the prompt
    params: SamplingParams
    return_logprob: bool
    future: concurrent.futures.Future     # resolved with the SGLang-shaped response dict
    max_new: int                          # max_new_tokens clipped to the context the engine holds
    stop_ids: frozenset                   # stop_token_ids plus eos unless ignore_eos
    uniforms: torch.Tensor                # (max_new,) this request's random numbers, one per sampled token
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    return_text_in_logprobs: bool = False
    output_ids: list = dataclasses.field(default_factory=list)
    output_logprobs: list = dataclasses.field(default_factory=list)
    output_versions: list = dataclasses.field(default_factory=list)  # weight version that produced each token
    return_routed_experts: bool = False   # answer with meta_info.routed_experts (MoE models)
    routed_experts_start_len: int = 0     # first position whose routing is returned (SGLang's field)
    routed: list = dataclasses.field(default_factory=list)  # (n, layers, top_k) int32 per forward chunk, in order
    slot: int = -1                        # KV-cache slot while running, -1 while waiting
    kv_len: int = 0                       # tokens whose K/V sit in the slot
    cached_tokens: int = 0                # context tokens whose K/V another request's prefill made (SGLang's field)
    adapter: "LoraAdapter | None" = None  # the LoRA adapter its lora_path named when it arrived; None = the base
    stream: object = None                 # stream=true: fn(n), sends the first n output tokens (scheduler thread)
    sent: int = 0                         # output tokens already streamed (SGLang's send_token_offset)
    grammar: object = None                # xgrammar.GrammarMatcher of a constrained request (json_schema/regex/ebnf)


def response(req: Req, finish_reason: dict | None, tokenizer, weight_version: str, runner: "ModelRunner",
             n: int | None = None) -> dict:
    """SGLang's answer to a finished request: {"text", "output_ids", "meta_info"}. `tokenizer`: None for ids only
    (text ""); `weight_version`: the engine's now; `runner`: the layout of routed experts when none were kept.

    With `finish_reason` None: a stream=true chunk of a request still running, over its first `n` output tokens.
    As SGLang streams by default (incremental_streaming_output off), text, output_ids and
    meta_info.output_token_logprobs / weight_versions are cumulative, from the first output token; the text holds
    back an incomplete UTF-8 character (SGLang's detokenizer does), e2e_latency and routed_experts come with the
    finished answer only. Called on the HTTP thread: the scheduler only appends to the lists read here, and has
    appended all three before it hands out n."""
    ids = req.output_ids if n is None else req.output_ids[:n]
    text = ""
    if tokenizer is not None and finish_reason is None:
        text = tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens).rstrip("\ufffd")
    elif tokenizer is not None:
        trim = finish_reason.get("type") == "stop" and not req.params.no_stop_trim
        text = tokenizer.decode(ids[:-1] if trim else ids, skip_special_tokens=req.params.skip_special_tokens)
    meta = {"id": req.rid, "finish_reason": finish_reason, "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(ids), "cached_tokens": req.cached_tokens,
            "weight_version": weight_version,
            "weight_versions": weight_version_spans(req.output_versions[:len(ids)], weight_version)}
    if req.return_logprob:
        with_text = req.return_text_in_logprobs and tokenizer is not None
        meta["output_token_logprobs"] = [[lp, t, tokenizer.decode([t]) if with_text else None]
                                         for lp, t in zip(req.output_logprobs, ids)]
    if finish_reason is None:
        return {"text": text, "output_ids": list(ids), "meta_info": meta}
    meta["e2e_latency"] = time.perf_counter() - req.arrival
    if req.return_routed_experts:
        # SGLang's layout: rows [start_len, prompt + output - 1), i.e. every position the model ran on; a request
        # cut short before running at all (aborted while waiting) has none
        rows = torch.cat(req.routed) if req.routed else torch.zeros(0, runner.model.config.num_hidden_layers,
                                                                    runner.topk, dtype=torch.int32)
        rows = rows[req.routed_experts_start_len:len(req.prompt_ids) + len(ids) - 1]   # (n, L, top_k) int32
        meta["routed_experts"] = base64.b64encode(rows.contiguous().numpy().astype("<i4").tobytes()).decode()
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


class LoraRegistry:
    """The LoRA adapters the engine serves, by name (SGLang's LoRARegistry), and the limits the server was started
    with (SGLang's --enable-lora, --max-lora-rank, --lora-target-modules). Adapters are added and removed on the
    scheduler thread (CpuEngine.load_adapter, unload_adapter); a request resolves its lora_path once, on arrival."""

    def __init__(self, lora: dict | None):
        """`lora`: {"max_lora_rank": r, "lora_target_modules": [...]}; None: LoRA is off, every adapter refused."""
        self.lora = dict(lora) if lora else None
        self.adapters: dict[str, LoraAdapter] = {}  # loaded LoRA adapters by name

    def resolve(self, lora_path: str) -> LoraAdapter:
        """The loaded adapter a request's lora_path names; BadRequest with SGLang's reasons when there is none."""
        if self.lora is None:
            raise BadRequest(f"LoRA adapter '{lora_path}' was requested, but LoRA is not enabled. Please launch "
                             "the server with --enable-lora flag and preload adapters using --lora-paths or "
                             "/load_lora_adapter endpoint.")
        adapter = self.adapters.get(lora_path)
        if adapter is None:
            raise BadRequest(f"Got LoRA adapter that has never been loaded: {lora_path}\n"
                             f"All loaded adapters: {sorted(self.adapters)}.")
        return adapter

    def add(self, runner: "ModelRunner", name: str, path: str, config: dict, named: list) -> dict:
        """Load adapter `name` (runner.make_adapter); raises BadRequest with SGLang's reasons (LoRA off, a name
        already loaded, a rank or targets the server was not started for). Returns `loaded()`."""
        if self.lora is None:
            raise BadRequest("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name in self.adapters:
            raise BadRequest(f"Failed to load LoRA adapter {name} because it is already loaded")
        self.adapters[name] = runner.make_adapter(name, path, config, named, int(self.lora["max_lora_rank"]),
                                                  list(self.lora["lora_target_modules"]))
        return self.loaded()

    def remove(self, name: str) -> LoraAdapter:
        """Take adapter `name` out of the registry (new requests can no longer name it) and return it."""
        if self.lora is None:
            raise BadRequest("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name not in self.adapters:
            raise BadRequest(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.adapters)}")
        return self.adapters.pop(name)

    def loaded(self) -> dict[str, str]:
        """{name: path} of every loaded adapter (SGLang's loaded_adapters)."""
        return {n: a.path for n, a in self.adapters.items()}


# ----------------------------------------------------------------------------------------------
# the KV slots and the prefix cache


class PrefixCache:
    """Which KV slot of the runner's cache is free, and what finished requests left in the others: SGLang's radix
    cache, one entry per slot. A finished (or retracted) request leaves its K/V in its slot for later requests that
    start with the same tokens under the same LoRA adapter; a slot comes from the free ones, else from the least
    recently used entry. Disabled (--disable-radix-cache), a finished request's slot is freed at once. It runs on the
    scheduler thread, as everything CpuEngine owns does."""

    def __init__(self, slots: int, max_len: int, enabled: bool):
        self.enabled = enabled
        self.free = list(range(slots))
        # slot -> (routed experts of its cached rows or None, their LoRA adapter or None), least recently used first;
        # the token ids whose K/V a cached slot holds are row `slot` of `ids`, -1 past them (no token id matches -1)
        self.entries: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self.ids = torch.full((slots, max_len), -1, dtype=torch.long)  # (slots, max_len)

    def match(self, context: list[int], routed: bool, adapter) -> tuple[int | None, int]:
        """(cached slot, n): the slot whose K/V rows [0, n) were computed for context[:n], n the longest such (at
        most len(context) - 1: the last token is always run, for its logits); (None, 0) when none. `routed`: the
        request returns routed experts, so only slots that kept theirs can serve it. Only rows computed under the
        request's LoRA adapter (or none) match: SGLang keys its radix cache by the adapter (schedule_batch.py Req,
        lora_id in extra_key)."""
        slots = [s for s, (r, a) in self.entries.items() if a is adapter and (r is not None or not routed)]
        n = len(context) - 1
        if not slots or n < 1:
            return None, 0
        slots_t = torch.tensor(slots)
        same = self.ids[slots_t, :n] == torch.tensor(context[:n])                       # (E, n)
        hits = same.cumprod(dim=1).sum(dim=1)                                           # (E,) common prefix lengths
        best = int(hits.argmax())
        return (slots[best], int(hits[best])) if int(hits[best]) > 0 else (None, 0)

    def take_slot(self, keep: int | None = None) -> int:
        """A free slot, else the least recently used cached one other than `keep` (dropped from the cache); -1 when
        every slot runs a request or is `keep`."""
        if self.free:
            return self.free.pop(0)
        victim = next((s for s in self.entries if s != keep), None)
        if victim is None:
            return -1
        del self.entries[victim]
        return victim

    def free_slot(self, slot: int) -> None:
        if slot >= 0:
            self.free.append(slot)
            self.free.sort()  # lowest slots first keeps the running set contiguous (cache read as a view)

    def keep(self, req: Req) -> None:
        """req's slot, rows [0, kv_len), becomes a prefix-cache entry (SGLang inserts a finished request's tokens
        into its radix tree); without the cache the slot is freed."""
        if not self.enabled or req.kv_len == 0:
            self.free_slot(req.slot)
            return
        self.ids[req.slot] = -1
        self.ids[req.slot, :req.kv_len] = torch.tensor((req.prompt_ids + req.output_ids)[:req.kv_len])
        # (routed experts (kv_len, L, K) or None, the adapter that computed the rows)
        self.entries[req.slot] = (torch.cat(req.routed)[:req.kv_len] if req.routed else None, req.adapter)

    def flush(self) -> None:
        """Drop every entry; their slots are free again (the caller checks that nothing runs)."""
        for slot in list(self.entries):
            self.free_slot(slot)
        self.entries.clear()


# ----------------------------------------------------------------------------------------------
# the scheduler


class CpuEngine:
    """Continuous-batching generation: the scheduler that admits, steps, samples and finishes requests, each in a
    KV slot of its `runner` (ModelRunner), and answers them in SGLang's shape.

    One scheduler thread owns every piece of mutable state, the runner's included. Other threads (HTTP handlers,
    in-process callers) talk to it only through `self._inbox`: new requests, and control calls (abort, pause, weight
    loads, memory release) that run between two forward steps.
    """

    def __init__(self, model_path: str, **opts):
        """`opts`: the keyword arguments of `_build` (max_batch, max_len, seed, dtype, ...).

        The model is loaded and packed (`_build`) on a thread of its own that ends before this returns, so that the
        scheduler thread is the only one in the process to keep an OpenMP thread pool: with a second pool a 2-thread
        engine generated about half as fast (docs/CPU.md, OpenMP thread pools)."""
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cpu-engine-build") as pool:
            pool.submit(self._build, model_path, **opts).result()  # the pool's thread has ended when `with` exits

    def _build(self, model_path: str, *, max_batch: int = 64, max_len: int | None = None, seed: int = 0,
               dtype: str = "float32", max_prefill_tokens: int = 8192, weight_version: str = "0",
               fp32_lm_head: bool = False, busy_flag: tuple[str, int] | None = None, lora: dict | None = None,
               enable_deterministic_inference: bool = False, disable_radix_cache: bool = False,
               stream_interval: int = 1, rank: int = 0) -> None:
        """`busy_flag` (file, i): keep byte i of that file at 1 while there are requests to compute, 0 otherwise, for
        trainer ranks that borrow this engine's cores while it idles (cpu.lent_cores). `lora`: serve LoRA adapters,
        {"max_lora_rank": r, "lora_target_modules": [...]} (SGLang's --enable-lora and its two flags); None: refuse
        them, as SGLang without --enable-lora does. `rank`: this engine's index in the run, which drills name
        (LOONGSAGE_FAULT, trainer.fault).
        `enable_deterministic_inference`, `disable_radix_cache`, `stream_interval`: SGLang's server flags of those
        names (the module docstring's Determinism; the prefix cache; tokens per stream=true chunk, 1 = every step)."""
        hf_logging.disable_progress_bar()
        self.model_path = str(model_path)
        self.runner = ModelRunner(self.model_path, max_batch=max_batch, max_len=max_len, dtype=dtype,
                                  fp32_lm_head=fp32_lm_head)
        has_tokenizer = any(os.path.exists(os.path.join(self.model_path, f))
                            for f in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path) if has_tokenizer else None  # None: ids only
        self.max_batch, self.max_len = self.runner.max_batch, self.runner.max_len
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.seed, self.rank = int(seed), int(rank)
        self.weight_version = str(weight_version)
        self.uniforms = torch.zeros(self.max_batch, self.max_len)  # (slots, max_len) running requests' draws
        self.deterministic = bool(enable_deterministic_inference)
        self.stream_interval = int(stream_interval)
        self.cache = PrefixCache(self.max_batch, self.max_len, enabled=not disable_radix_cache)  # the KV slots
        self.offload_tags: set[str] = set()  # SGLang's name: the memory tags released and not yet resumed
        self.weight_update_groups: dict = {}  # group_name -> the gloo group of /init_weights_update_group
        self.last_answer = time.monotonic()  # when the scheduler last answered anything (what /health waits for)
        self.died: str | None = None  # why the scheduler ended the server, as SGLang's does on an exception
        self.on_death = None  # called once the scheduler has died (serve: stop the HTTP server)
        self.lora_registry = LoraRegistry(lora)
        self._grammar_compiler = None  # xgrammar.GrammarCompiler, built at the first constrained request

        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[Req] = collections.deque()
        self._running: list[Req] = []
        self._paused = False
        self._arrivals = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._busy_flag = None  # [shared mapping, byte index, the value last written], see busy_flag above
        if busy_flag:
            with open(busy_flag[0], "r+b") as f:
                self._busy_flag = [mmap.mmap(f.fileno(), 0), int(busy_flag[1]), None]
        self.stats = {"steps": 0, "max_running": 0, "generated_tokens": 0, "finished": 0,
                      "busy_s": 0.0}  # busy_s: seconds spent in forward steps (the controller's engine idle fraction)

    # --- public API (any thread)

    def start(self) -> "CpuEngine":
        self._thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Abort whatever is in flight, then end the scheduler thread."""
        if self._thread is None:
            return
        if not self.died:
            self.call(self._abort, None, True, "engine shutting down").result(timeout=60)
        self._stopping = True
        self._inbox.put(("wake",))
        self._thread.join(timeout=60)
        self._thread = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the scheduler thread between two steps; returns a Future with its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.died:
            fut.set_exception(RuntimeError(f"the engine died: {self.died}"))
            return fut
        if not self.alive():  # not started (e.g. a bench or a unit test driving the engine directly)
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                fut.set_exception(e)
            return fut
        self._inbox.put(("call", fn, args, fut))
        return fut

    def make_request(self, input_ids, sampling_params: dict | None = None, *, rid: str | None = None,
                     return_logprob: bool = True, return_text_in_logprobs: bool = False,
                     return_routed_experts: bool = False, routed_experts_start_len: int = 0,
                     seed: int | None = None, lora_path: str | None = None) -> Req:
        """Validate one prompt into a Req (raises BadRequest); `submit` it to run it. `seed`: for the engine's own
        requests (the health check), which take no arrival index. `lora_path`: the name of a loaded LoRA adapter to
        generate with (SGLang's field), None for the base model."""
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest(f"input_ids must be a non-empty list of token ids, got {str(input_ids)[:80]}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise BadRequest(f"input_ids must hold integers only, got {str(input_ids)[:80]}")
        bad = [t for t in input_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise BadRequest(f"input_ids {bad[:8]} are outside the vocabulary [0, {self.runner.vocab_size})")
        if len(input_ids) >= self.max_len:  # what passes fits: the KV cache holds --max-len tokens a slot
            raise BadRequest(f"the prompt has {len(input_ids)} tokens, and the engine's context (--max-len, prompt + "
                             f"output) is {self.max_len}: send a shorter prompt, or start the engine with a larger "
                             f"--max-len (its KV cache, allocated at start, holds --max-batch x --max-len tokens)")
        params = parse_sampling_params(sampling_params, self.runner.vocab_size)
        if return_routed_experts and not self.runner.moe:
            raise BadRequest(f"return_routed_experts=true but {self.model_path} is a dense "
                             f"{self.runner.model.config.model_type} model with no router; ask for it with MoE models "
                             "only")
        if not isinstance(routed_experts_start_len, int) or not 0 <= routed_experts_start_len <= len(input_ids):
            raise BadRequest(f"routed_experts_start_len={routed_experts_start_len!r} must be an integer in "
                             f"[0, {len(input_ids)}] (the number of input tokens)")
        adapter = self.lora_registry.resolve(lora_path) if lora_path is not None else None
        grammar = self._grammar_matcher(params)
        max_new = min(params.max_new_tokens, self.max_len - len(input_ids))
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.runner.eos_ids)
        if seed is None and self.deterministic:  # SGLang: the request's sampling_seed, else 42 (sampling_batch_info.py)
            seed = 42 if params.sampling_seed is None else params.sampling_seed
        elif seed is None:  # SGLang ignores sampling_seed here; the arrival order is the order of make_request calls
            self._arrivals += 1
            seed = self.seed * 1_000_003 + self._arrivals
        gen = torch.Generator().manual_seed(seed)
        uniforms = torch.rand(max_new, generator=gen)  # (max_new,) one draw per token, whatever the batch holds
        return Req(rid=rid or uuid.uuid4().hex, prompt_ids=list(input_ids),
                   params=params, return_logprob=bool(return_logprob), future=concurrent.futures.Future(),
                   max_new=max_new, stop_ids=stop_ids, uniforms=uniforms,
                   return_text_in_logprobs=bool(return_text_in_logprobs),
                   return_routed_experts=bool(return_routed_experts), routed_experts_start_len=routed_experts_start_len,
                   adapter=adapter, grammar=grammar)

    def _grammar_matcher(self, params: SamplingParams):
        """A fresh xgrammar matcher for a constrained request, None for the others. The compiler is built at the first
        such request, over the engine's tokenizer with the model's eos ids as the grammar's end (SGLang's xgrammar
        backend: TokenizerInfo.from_huggingface(tokenizer, vocab_size, stop_token_ids=model eos)); xgrammar caches
        compiled grammars, as SGLang's backend does."""
        if all(getattr(params, k) is None for k in GRAMMAR_KEYS):
            return None
        if self.tokenizer is None:
            raise BadRequest(f"json_schema / regex / ebnf / structural_tag need the tokenizer, and {self.model_path} "
                             "has none")
        import xgrammar  # here: only a constrained request needs it
        if self._grammar_compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.runner.vocab_size,
                                                           stop_token_ids=sorted(self.runner.eos_ids))
            self._grammar_compiler = xgrammar.GrammarCompiler(info)
        return xgrammar.GrammarMatcher(compile_grammar(self._grammar_compiler, params))

    def submit(self, *reqs: Req) -> list[concurrent.futures.Future]:
        """Queue requests (one message, so a batch is admitted together); returns their futures."""
        if not self.alive():
            raise RuntimeError("the CPU engine is not running; call start() first")
        self._inbox.put(("reqs", reqs))
        return [r.future for r in reqs]

    def generate(self, input_ids: list[list[int]], sampling_params: dict | None = None, **kw) -> list[dict]:
        """Blocking convenience for in-process callers: generate for a batch of prompts, in order."""
        reqs = [self.make_request(ids, sampling_params, **kw) for ids in input_ids]
        return [f.result() for f in self.submit(*reqs)]

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort by rid (or everything); the aborted requests answer with what they generated so far."""
        return self.call(self._abort, rid, abort_all, "aborted by request").result()

    def pause(self, mode: str = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"pause_generation mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        self.call(self._pause, mode).result()

    def resume(self) -> None:
        self.call(self._resume).result()

    def load_weights(self, named_tensors, version=None, flush_cache: bool = False) -> int:
        """Copy (hf_name, tensor) pairs into the model between two steps; set weight_version if given; then, with
        `flush_cache`, drop the prefix cache (FlushRefused unless idle: the weights are loaded all the same, as in
        SGLang). Returns the number of tensors loaded. Requests in flight keep their KV cache."""
        return self.call(self._load_weights, list(named_tensors), version, flush_cache).result()

    def flush_cache(self) -> bool:
        """SGLang's /flush_cache: drop the prefix cache; False (nothing dropped) unless the engine is idle."""
        return self.call(self._flush_cache).result()

    def load_adapter(self, name: str, path: str, config: dict, named: list) -> dict:
        """SGLang's /load_lora_adapter(_from_tensors): add LoRA adapter `name` (PEFT-named tensors + its
        adapter_config) between two steps; raises BadRequest with SGLang's reasons (LoRA off, a name already loaded,
        a rank or targets the server was not started for). Returns {name: path} of every loaded adapter."""
        return self.call(self.lora_registry.add, self.runner, name, path, config, named).result()

    def unload_adapter(self, name: str) -> dict:
        """SGLang's /unload_lora_adapter: new requests can no longer name it at once; it is dropped when no request
        that named it is running or waiting (this call waits for that, as SGLang's does). Returns the loaded ones."""
        adapter = self.call(self.lora_registry.remove, name).result()
        while self.call(lambda: any(r.adapter is adapter for r in self._running + list(self._waiting))).result():
            time.sleep(0.05)
        return self.call(self.lora_registry.loaded).result()

    def release_memory(self, tags: list[str] | None) -> None:
        """SGLang's /release_memory_occupation: hand the memory of `tags` back (see ModelRunner.release)."""
        self.call(self._release_memory, _memory_tags(tags)).result()

    def resume_memory(self, tags: list[str] | None) -> None:
        """SGLang's /resume_memory_occupation: take the memory of `tags` again (see ModelRunner.resume)."""
        self.call(self._resume_memory, _memory_tags(tags)).result()

    def set_weight_version(self, version: str, abort_all: bool = False) -> None:
        def _set():
            if abort_all:
                self._abort(None, True, "aborted by update_weight_version")
            self.weight_version = str(version)
        self.call(_set).result()

    def state(self) -> dict:
        """A snapshot of the scheduler's state (for /get_server_info and tests)."""
        def _snap():
            return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting),
                    "paused": self._paused, "weight_version": self.weight_version, **self.stats,
                    "loaded_adapters": sorted(self.lora_registry.adapters),
                    "released": sorted(self.offload_tags), "cached_slots": len(self.cache.entries),
                    "weight_update_groups": sorted(self.weight_update_groups),
                    "running": [{"rid": r.rid, "completion_tokens": len(r.output_ids)} for r in self._running]}
        return self.call(_snap).result()

    # --- scheduler thread

    def _loop(self) -> None:
        # inference mode, not just no_grad: no version counters or view tracking on any tensor the steps make (6-15%
        # of a decode step at 1-64 rows here); in-place updates of the weights and caches inside it stay allowed
        with torch.inference_mode():
            while not self._stopping:
                busy = bool(self._running or self._waiting) and not self._paused and not self.runner.released
                if self._busy_flag and self._busy_flag[2] != busy:  # read by a borrowing trainer at every layer;
                    self._busy_flag[0][self._busy_flag[1]] = self._busy_flag[2] = busy  # written on a change only
                try:
                    self._handle(self._inbox.get(block=not busy, timeout=None if busy else 0.5))
                    while True:  # drain everything that arrived during the last step
                        self._handle(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                if self._stopping or self._paused or self.runner.released or not (self._running or self._waiting):
                    continue  # released memory: requests wait until resume_memory_occupation brings it back
                try:
                    t0 = time.perf_counter()
                    self._step()
                    self.stats["busy_s"] += time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                    traceback.print_exc()
                    self._abort(None, True, f"engine step failed: {type(e).__name__}: {e}")

    def _handle(self, msg) -> None:
        if self.died:  # what reached the scheduler after it died goes unanswered on SGLang: fail it here
            for fut in ([r.future for r in msg[1]] if msg[0] == "reqs" else [msg[3]] if msg[0] == "call" else []):
                fut.set_exception(RuntimeError(f"the engine died: {self.died}"))
            return
        if msg[0] == "reqs":
            self._waiting.extend(msg[1])
        elif msg[0] == "call":
            _, fn, args, fut = msg
            try:
                fut.set_result(fn(*args))
            except BadRequest as e:  # the caller's error: SGLang answers it and goes on
                fut.set_exception(e)
            except Exception as e:  # noqa: BLE001 - SGLang's scheduler has no handler around a control call
                fut.set_exception(e)
                self._die(e)
            self.last_answer = time.monotonic()

    def _die(self, error: Exception) -> None:
        """End the server as an exception in SGLang's scheduler does (scheduler.py run_scheduler_process: it logs the
        traceback and signals its parent, which takes every process of the server down): requests in flight fail
        (their connections drop with the server), the scheduler stops, `on_death` stops the HTTP server."""
        traceback.print_exception(error)
        self.died = f"{type(error).__name__}: {error}"
        print(f"cpu engine {self.model_path}: the scheduler hit an exception ({self.died}); the server exits, as "
              f"SGLang's does", file=sys.stderr, flush=True)
        for req in list(self._running) + list(self._waiting):
            if not req.future.done():
                req.future.set_exception(RuntimeError(f"the engine died: {self.died}"))
        self._running.clear()
        self._waiting.clear()
        self._stopping = True
        if self.on_death is not None:
            self.on_death()

    def _step(self) -> None:
        """One scheduler iteration: admit waiting requests (prefill), then one decode step for the rest."""
        decoding = list(self._running)
        admitted = self._admit()
        self.stats["max_running"] = max(self.stats["max_running"], len(self._running))
        if admitted:
            self._prefill(admitted)
        if decoding:
            self._sample(decoding, self._forward(decoding, [[r.output_ids[-1]] for r in decoding]))
        self.stats["steps"] += 1
        self.last_answer = time.monotonic()  # tokens went out: SGLang's detokenizer would have sent them on

    def _admit(self) -> list[Req]:
        """Move waiting requests into KV slots, oldest first, within the prefill token budget. A request whose
        context starts with tokens a cached slot holds gets those K/V rows (`PrefixCache.match`) and prefills only the
        rest. A slot comes from the free ones, else from the prefix cache's least recently used entry."""
        admitted, budget = [], self.max_prefill_tokens
        while self._waiting:
            req = self._waiting[0]
            context = req.prompt_ids + req.output_ids
            source, hit = self.cache.match(context, req.return_routed_experts, req.adapter)
            n = len(context) - hit
            if admitted and n > budget:
                break
            if req.max_new == 0:  # nothing to generate (max_new_tokens=0)
                self._waiting.popleft()
                self._finish(req, {"type": "length", "length": 0})
                continue
            slot = self.cache.take_slot(keep=source)
            if slot < 0 and source is None:
                break  # every slot runs a request
            self._waiting.popleft()
            routed = self.cache.entries[source][0] if source is not None else None
            if slot < 0:  # the source is the only slot left: take it over, its rows [0, hit) stay in place
                slot = source
                del self.cache.entries[source]
            elif hit:
                self.runner.copy_kv(source, slot, hit)
                self.cache.entries.move_to_end(source)  # used: the last to be given up
            req.slot, req.kv_len, req.cached_tokens = slot, hit, req.cached_tokens + hit
            # a retracted request is prefilled again: its routing is recomputed with it (the cached rows' kept)
            req.routed = [routed[:hit]] if hit and routed is not None else []
            self.uniforms[req.slot, :req.max_new] = req.uniforms
            admitted.append(req)
            self._running.append(req)
            budget -= n
        return admitted

    def _prefill(self, reqs: list[Req]) -> None:
        """Feed the admitted requests their context past the cached rows and sample each one's next token. Requests
        with the same context (the N samples of one prompt group arrive together) share one prefill: the first one's
        K/V is computed and copied into the others' slots, and each samples from its logits with its own draw."""
        contexts = [r.prompt_ids + r.output_ids for r in reqs]
        first: dict[tuple, int] = {}
        # request whose prefill i shares: the same context under the same adapter (LoRA changes every K/V)
        src = [first.setdefault((tuple(c), id(r.adapter)), i) for i, (c, r) in enumerate(zip(contexts, reqs))]
        own = sorted(first.values())
        logits = self._forward([reqs[i] for i in own], [contexts[i][reqs[i].kv_len:] for i in own])  # (U, V)
        for r, j in zip(reqs, src):
            s = reqs[j]
            if s is not r:  # K/V rows [0, kv_len) of the source's slot
                self.runner.copy_kv(s.slot, r.slot, s.kv_len)
                r.cached_tokens += s.kv_len - r.kv_len
                r.kv_len, r.routed = s.kv_len, list(s.routed)
        row = {i: k for k, i in enumerate(own)}
        self._sample(reqs, logits[[row[j] for j in src]] if len(own) < len(reqs) else logits)

    def _flush_cache(self) -> bool:
        """SGLang's flush_cache: only when nothing runs and nothing waits (waiting requests do not count while
        paused); returns whether it flushed."""
        if self._running or (self._waiting and not self._paused):
            return False
        self.cache.flush()
        return True

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Sample one token per request from its logits (B, V) (at its context's last position) and append it."""
        n_out = torch.tensor([len(r.output_ids) for r in reqs])
        u = self.uniforms[torch.tensor([r.slot for r in reqs]), n_out]                   # (B,)
        if any(r.grammar is not None for r in reqs):
            logits = mask_by_grammar(logits, [r.grammar for r in reqs])                # (B, V) -inf where refused
        tokens, logp = sample(logits, [r.params for r in reqs], u)                      # (B,), (B,)
        for req, tok, lp in zip(reqs, tokens.tolist(), logp.tolist()):
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            req.output_versions.append(self.weight_version)
            self.stats["generated_tokens"] += 1
            if req.grammar is not None:
                req.grammar.accept_token(tok)  # the mask allowed only tokens it accepts
            if tok in req.stop_ids or req.grammar is not None and req.grammar.is_terminated():
                # SGLang: a terminated grammar finishes the request as a matched stop token (schedule_batch.py)
                self._finish(req, {"type": "stop", "matched": tok})
            elif len(req.output_ids) >= req.max_new:
                self._finish(req, {"type": "length", "length": len(req.output_ids)})
            elif req.stream is not None:
                self._stream(req)

    def _stream(self, req: Req) -> None:
        """SGLang's output streamer (output_streamer.py accept) for a stream=true request still running: the first
        token goes out at once, then a chunk whenever stream_interval tokens are unsent (the request's, else the
        server's); the finished answer goes out through the request's future, whatever the interval."""
        interval = req.params.stream_interval or self.stream_interval
        unsent = len(req.output_ids) - req.sent
        if interval == 1 or unsent >= interval or (req.sent == 0 and unsent > 0):
            req.sent = len(req.output_ids)
            req.stream(req.sent)

    def _forward(self, reqs: list[Req], chunks: list[list[int]]) -> torch.Tensor:
        """The runner's forward over each request's slot; advances kv_len and keeps the routing it was asked for."""
        logits, routed = self.runner.forward([r.slot for r in reqs], [r.kv_len for r in reqs], chunks,
                                             any(r.return_routed_experts for r in reqs), [r.adapter for r in reqs])
        for i, (req, chunk) in enumerate(zip(reqs, chunks)):
            req.kv_len += len(chunk)
            if routed is not None and req.return_routed_experts:
                req.routed.append(routed[i])
        return logits

    def _finish(self, req: Req, finish_reason: dict) -> None:
        if req in self._running:
            self._running.remove(req)
        if req.slot >= 0:
            self.cache.keep(req)
            req.slot = -1
        self.stats["finished"] += 1
        if not req.future.done():
            req.future.set_result(response(req, finish_reason, self.tokenizer, self.weight_version, self.runner))

    # --- control calls (run on the scheduler thread via `call`)

    def _abort(self, rid: str | None, abort_all: bool, message: str) -> int:
        victims = [r for r in list(self._running) + list(self._waiting) if abort_all or r.rid == rid]
        for req in victims:
            if req in self._waiting:
                self._waiting.remove(req)
            self._finish(req, {"type": "abort", "message": message})
        return len(victims)

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(None, True, "aborted by pause_generation")
        elif mode == "retract":  # give back the KV slots (to the prefix cache); re-prefill on continue
            for req in reversed(self._running):
                self.cache.keep(req)
                req.slot, req.kv_len = -1, 0
                self._waiting.appendleft(req)
            self._running.clear()
        self._paused = True

    def _resume(self) -> None:
        self._paused = False

    def _release_memory(self, tags: list[str]) -> None:
        """ModelRunner.release, as SGLang's scheduler does it: idle or die (pause with mode "retract" or "abort"
        first: retracted requests wait and are re-prefilled after the resume); a kv_cache release flushes the prefix
        cache."""
        if self._running or (self._waiting and not self._paused):
            raise AssertionError(f"release_memory_occupation should be called only when server is idle "
                                 f"({len(self._running)} request(s) running, {len(self._waiting)} waiting; pause with "
                                 f"mode 'retract' or 'abort' first)")
        self.offload_tags.update(tags)
        if "kv_cache" in tags:
            self._flush_cache()
        self.runner.release(tags)

    def _resume_memory(self, tags: list[str]) -> None:
        for tag in tags:  # SGLang: offload_tags.remove(tag), a KeyError for a tag it never released
            self.offload_tags.remove(tag)
        self.runner.resume(tags)

    def _load_weights(self, named_tensors: list, version, flush_cache: bool) -> int:
        n = self.runner.load_weights(named_tensors)
        if version is not None:
            self.weight_version = str(version)
        if flush_cache and not self._flush_cache():
            raise FlushRefused("Weights were updated, but the cache was not flushed because requests are still "
                               "running or queued. Retract or finish them, then call /flush_cache.")
        return n


# ----------------------------------------------------------------------------------------------
# the HTTP server (SGLang's native endpoints and field names)


def _env_bool(name: str, default: bool) -> bool:
    """An environment flag read as SGLang's EnvBool reads it (environ.py): true/1/yes/y or false/0/no/n in any case;
    unset, or anything else (with a warning), is `default`."""
    value = os.getenv(name)
    if value is not None and value.lower() in ("true", "1", "yes", "y", "false", "0", "no", "n"):
        return value.lower() in ("true", "1", "yes", "y")
    if value is not None:
        print(f"Invalid value for {name}: {value!r} is not a valid boolean value, using default {default}",
              file=sys.stderr)
    return default


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


BODY = Depends(_json_body)  # FastAPI hands a handler `body`: the request's JSON object ({} for an empty body)


def _per_item(value, n: int, name: str) -> list:
    """SGLang lets batch fields be one value for all items or a list with one per item."""
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for a batch of {n} prompts")
        return value
    return [value] * n


def read_safetensors_dir(path: str) -> list:
    """All (hf_name, tensor) pairs of the *.safetensors files in an HF directory."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise BadRequest(f"no *.safetensors files in {path!r}; give an HF model directory")
    return [pair for f in files for pair in load_file(f).items()]


async def _update_weights(engine: CpuEngine, named_tensors, body: dict):
    """Load a weight update between two steps and answer as SGLang does (`abort_all_requests` first when asked;
    success false, 400, when its flush_cache found the engine busy)."""
    if body.get("abort_all_requests"):
        await asyncio.to_thread(engine.abort, None, True)
    before = engine.weight_version
    try:  # flush_cache defaults to true, as in SGLang's update requests
        n = await asyncio.to_thread(engine.load_weights, named_tensors, body.get("weight_version"),
                                    bool(body.get("flush_cache", True)))
    except FlushRefused as e:
        return JSONResponse({"success": False, "message": str(e)}, status_code=400)
    version = body.get("weight_version")
    if os.environ.get("LOONGSAGE_FAULT") and version is None and before.isdigit():
        import trainer  # late: drills only (trainer.fault: `sync` and `stall` strike here, inside a weight sync)
        for point in ("sync", "stall"):
            trainer.fault(point, int(before) + 1, engine.rank, f"engine {engine.rank} loaded a bucket of the update "
                          f"from version {before}, not its last (the version-carrying one), and has not answered")
    return {"success": True, "message": f"Loaded {n} tensors." + (
        "" if version is None else f" Weight version updated to {version}.")}


async def _own_payload(body: dict, endpoint: str, adapter: bool = False) -> list:
    """The tensors of `serialized_named_tensors` (one entry per TP rank) that this engine reads: entry 0, as
    SGLang's TP rank 0 does (the CPU engine is one rank), in SGLang's payload (transfermesh.read_tensor_payload;
    `adapter`: a LoRA adapter's, a dict where load_format is null). Views of the sender's shared memory: the
    caller copies them out. A bad payload or checksum is a BadRequest, and nothing is loaded."""
    items = body.get("serialized_named_tensors")
    if not isinstance(items, list) or not items:
        raise BadRequest(f"{endpoint} needs serialized_named_tensors (a non-empty list, one entry per TP rank)")
    try:  # checksum: a LoongSage addition
        return await asyncio.to_thread(transfermesh.read_tensor_payload, items[0], body.get("load_format"),
                                       body.get("checksum"), adapter)
    except ValueError as e:  # a bad payload or checksum: refuse it, keep what is loaded
        raise BadRequest(str(e)) from None


def _refuse_outside_session(session: dict, endpoint: str):
    """SGLang's answer to a tensor or distributed update sent outside a weight-update session; None inside one."""
    if not session["open"]:
        return JSONResponse({"success": False, "message": f"{endpoint} must run between begin_weight_update() "
                             f"and end_weight_update()"}, status_code=400)
    return None


def _add_info_routes(app, engine: CpuEngine) -> None:
    """Health, model and server information (SGLang's probes and the controller's)."""

    # read once, as SGLang reads it when http_server.py is imported
    health_check_timeout = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))

    @app.get("/health")
    @app.get("/health_generate")
    async def health_generate(request: Request):
        """SGLang's probe (SGLANG_BEHAVIOURS: health_generates, health_without_generation)."""
        if not engine.alive():
            return PlainTextResponse("", status_code=503)
        if request.url.path == "/health" and not _env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True):
            return PlainTextResponse("", status_code=200)
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        tic = time.monotonic()
        engine.submit(engine.make_request([0], {"max_new_tokens": 1, "temperature": 0.0}, rid=rid, seed=0))
        try:
            while time.monotonic() < tic + health_check_timeout:
                await asyncio.sleep(1)
                if engine.last_answer > tic:
                    return PlainTextResponse("", status_code=200)
                if not engine.alive():
                    break
            return PlainTextResponse("", status_code=503)
        finally:  # SGLang drops the probe's request either way (a paused engine never ran it)
            engine.call(engine._abort, rid, False, "health check done")

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": engine.model_path, "tokenizer_path": engine.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.weight_version}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        """Answered by the scheduler between two steps, paused or released too (SGLANG_BEHAVIOURS:
        server_info_while_paused). internal_states[0] adds LoongSage's counters, `rss_bytes` among them (this
        process's resident memory: the colocated hand-off's memory/ metrics)."""
        state = await asyncio.to_thread(engine.state)
        return {"model_path": engine.model_path, "max_running_requests": engine.max_batch,
                "context_len": engine.max_len, "random_seed": engine.seed,
                "enable_deterministic_inference": engine.deterministic, "disable_radix_cache": not engine.cache.enabled,
                "internal_states": [{**state, "rss_bytes": transfermesh.rss_bytes()}]}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _stream_chunks(engine: CpuEngine, reqs: list[Req], batched: bool):
    """/generate with stream=true, as SGLang 0.5.23 answers it (http_server.py generate_request, tokenizer_manager.py
    _wait_one_response): Server-Sent Events `data: {json}`, one per chunk the scheduler hands out (`CpuEngine._stream`)
    while the request runs, then its finished answer, then `data: [DONE]`. Each chunk is the cumulative answer so far
    (`response` with n); a batch's chunks interleave, each with its prompt's "index". When chunks pile up behind a
    slow reader, only the newest of each request goes out, as SGLang's tokenizer manager drains its queue. A request
    the engine cannot answer (it died) gets SGLang's in-stream error event. A client that leaves before the end aborts
    what it asked for (SGLang's abort task on the streaming response)."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue = asyncio.Queue()  # (index, n tokens to send | None once finished), in the engine's order

    def push(item):  # on the scheduler thread
        try:
            loop.call_soon_threadsafe(updates.put_nowait, item)
        except RuntimeError:  # the server's loop has closed (shutdown): nobody reads this stream any more
            pass
    for i, req in enumerate(reqs):
        req.stream = lambda n, i=i: push((i, n))
        req.future.add_done_callback(lambda _, i=i: push((i, None)))
    engine.submit(*reqs)
    left = set(range(len(reqs)))
    try:
        while left:
            latest = dict([await updates.get()])
            while not updates.empty():  # the newest state of each request; a finished one stays finished
                i, n = updates.get_nowait()
                latest[i] = n if latest.get(i, 0) is not None else None
            for i, n in latest.items():
                if n is None:
                    left.discard(i)
                    try:
                        out = reqs[i].future.result()
                    except Exception as e:  # noqa: BLE001 - the engine died: SGLang's error event
                        yield _sse({"error": {"message": str(e), "type": "invalid_request_error", "code": 500,
                                              "retryable": False}})
                        continue
                else:
                    out = response(reqs[i], None, engine.tokenizer, engine.weight_version, engine.runner, n)
                if batched:
                    out["index"] = i
                yield _sse(out)
    finally:
        for i in left:  # the client went away (the generator is closed): abort what is still running
            engine.call(engine._abort, reqs[i].rid, False, "the client closed the stream")
    yield b"data: [DONE]\n\n"


def _add_generate_routes(app, engine: CpuEngine) -> None:
    """Generation and what stops or resumes it: /generate, abort, pause, continue, /flush_cache."""

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate_endpoint(body: dict = BODY):
        input_ids, text = body.get("input_ids"), body.get("text")
        if input_ids is None and text is not None:
            if engine.tokenizer is None:
                raise BadRequest(f"{engine.model_path} has no tokenizer; send input_ids instead of text")
            input_ids = ([engine.tokenizer.encode(t, add_special_tokens=False) for t in text]
                         if isinstance(text, list) else engine.tokenizer.encode(text, add_special_tokens=False))
        if input_ids is None:
            raise BadRequest("the request has no input_ids (a list of token ids, or a list of such lists)")
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest(f"input_ids must be a non-empty list, got {str(input_ids)[:80]}")
        batched = isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        n = len(prompts)
        rid = body.get("rid")
        if not batched:
            if rid is not None and not isinstance(rid, str):
                raise BadRequest(f"rid must be a string for a single prompt, got {rid!r}")
            rids = [rid]
        elif isinstance(rid, str):  # SGLang: one string for a batch is a prefix, item i gets f"{rid}_{i}"
            rids = [f"{rid}_{i}" for i in range(n)]
        else:
            rids = _per_item(rid, n, "rid")
        sps = _per_item(body.get("sampling_params"), n, "sampling_params")
        lps = _per_item(body.get("return_logprob", False), n, "return_logprob")
        # one value for the whole batch, as SGLang's GenerateReqInput holds them
        routed = (bool(body.get("return_routed_experts", False)), body.get("routed_experts_start_len", 0))
        loras = _per_item(body.get("lora_path"), n, "lora_path")  # an adapter name per prompt, or one for all
        reqs = [engine.make_request(p, sp, rid=r, return_logprob=bool(lp),
                                    return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                                    return_routed_experts=routed[0], routed_experts_start_len=routed[1],
                                    lora_path=lp_name)
                for p, sp, r, lp, lp_name in zip(prompts, sps, rids, lps, loras)]
        if body.get("stream"):
            return StreamingResponse(_stream_chunks(engine, reqs, batched), media_type="text/event-stream")
        outs = await asyncio.gather(*(asyncio.wrap_future(f) for f in engine.submit(*reqs)))
        return outs if batched else outs[0]

    @app.post("/abort_request")
    async def abort_request(body: dict = BODY):
        await asyncio.to_thread(engine.abort, body.get("rid") or None, bool(body.get("abort_all", False)))
        return PlainTextResponse("", status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(body: dict = BODY):
        await asyncio.to_thread(engine.pause, body.get("mode", "abort"))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        await asyncio.to_thread(engine.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0):
        if timeout > 0:
            raise BadRequest(f"flush_cache timeout={timeout} (a deferred flush) is not implemented by the CPU engine; "
                             "call it without a timeout once the engine is idle or paused with nothing running")
        if await asyncio.to_thread(engine.flush_cache):
            return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are "
                                     "running or waiting requests, the operation will not be performed.)\n")
        return PlainTextResponse("Flush cache failed.\n", status_code=400)


def _add_memory_routes(app, engine: CpuEngine) -> None:
    """Colocated memory hand-off (SGLang's names and `tags` field; the answer is JSON null, as SGLang's). The
    released tags and this process's memory are in /server_info's internal_states."""

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(body: dict = BODY):
        await asyncio.to_thread(engine.release_memory, body.get("tags"))
        return None

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(body: dict = BODY):
        await asyncio.to_thread(engine.resume_memory, body.get("tags"))
        return None


def _add_weight_routes(app, engine: CpuEngine, session: dict) -> None:
    """Weight updates from disk and from tensors, the weight-update session around them, the weight version."""

    @app.post("/update_weight_version")
    async def update_weight_version(body: dict = BODY):
        if "new_version" not in body:
            raise BadRequest("update_weight_version needs new_version (a string)")
        await asyncio.to_thread(engine.set_weight_version, str(body["new_version"]),
                                bool(body.get("abort_all_requests", True)))
        return {"success": True, "message": f"Weight version updated to {body['new_version']}",
                "new_version": str(body["new_version"])}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: dict = BODY):
        path = body.get("model_path")
        if not path:
            raise BadRequest("update_weights_from_disk needs model_path (an HF directory with *.safetensors)")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {body['load_format']!r} is not supported by the CPU engine; use null")
        named = await asyncio.to_thread(read_safetensors_dir, path)
        answer = await _update_weights(engine, named, body)
        return {**answer, "num_paused_requests": 0} if isinstance(answer, dict) else answer

    @app.post("/begin_weight_update")
    async def begin_weight_update(body: dict = BODY):
        if body.get("selector", "all") not in ("all", "target", "draft"):
            raise BadRequest(f"selector must be 'all', 'target' or 'draft', got {body['selector']!r}")
        session["open"] = True
        return {"success": True, "message": "Weight update session begun."}

    @app.post("/end_weight_update")
    async def end_weight_update():
        session["open"] = False
        return {"success": True, "message": "Weight update session ended."}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: dict = BODY):
        if (refused := _refuse_outside_session(session, "update_weights_from_tensor")) is not None:
            return refused
        return await _update_weights(engine, await _own_payload(body, "update_weights_from_tensor"), body)


def _add_weight_group_routes(app, engine: CpuEngine, session: dict) -> None:
    """Weight updates by broadcast: the weight-update groups (gloo) an engine joins, reads from, destroys."""
    groups = engine.weight_update_groups  # group_name -> the gloo group /update_weights_from_distributed reads

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: dict = BODY):
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            raise BadRequest(f"init_weights_update_group is missing {missing}")
        if body.get("backend", "gloo") not in ("gloo", "nccl"):
            raise BadRequest(f"backend {body['backend']!r}: the CPU engine joins with gloo")
        name = body.get("group_name", "weight_update_group")
        if name in groups:  # torch refuses a second process group of one name (SGLANG_BEHAVIOURS)
            return JSONResponse({"success": False, "message": "Failed to initialize custom process group: The "
                                 "specified group name has already been created, please use a different group "
                                 "name."}, status_code=400)
        # Blocks until the trainer joins the rendezvous, so it runs off the event loop (and off the scheduler).
        # The CPU engine is TP rank 0 of itself: it joins at rank_offset + 0.
        groups[name] = await asyncio.to_thread(
            transfermesh.new_sglang_group, body["master_address"], int(body["master_port"]),
            int(body["rank_offset"]), int(body["world_size"]), name, "gloo")
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: dict = BODY):
        if (refused := _refuse_outside_session(session, "update_weights_from_distributed")) is not None:
            return refused
        name = body.get("group_name", "weight_update_group")
        if name not in groups:
            raise BadRequest(f"no weight update group {name!r}; call /init_weights_update_group first "
                             f"(known: {sorted(groups)})")
        if not all(isinstance(body.get(k), list) for k in ("names", "dtypes", "shapes")):
            raise BadRequest("update_weights_from_distributed needs lists names, dtypes and shapes")
        # Receive while generation goes on; only the copy into the model waits for a step boundary.
        try:
            named = await asyncio.to_thread(transfermesh.recv_broadcast, groups[name], body["names"], body["dtypes"],
                                            body["shapes"], body.get("load_format"),
                                            body.get("checksum"))  # checksum: a LoongSage addition
        except ValueError as e:  # checksum or layout: refuse the bucket, keep the old weights
            raise BadRequest(str(e)) from None
        return await _update_weights(engine, named, body)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: dict = BODY):
        # Registered by name with torch.distributed (as SGLang's is): destroyed there too, so the name can be reused
        pg = groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            return JSONResponse({"success": False, "message": "The group to be destroyed does not exist."},
                                status_code=400)
        await asyncio.to_thread(torch.distributed.destroy_process_group, pg)
        return {"success": True, "message": "Succeeded to destroy custom process group."}


def _add_lora_routes(app, engine: CpuEngine) -> None:
    """LoRA adapters, as SGLang 0.5.23 answers them: LoRAUpdateOutput {success, error_message, loaded_adapters},
    HTTP 400 with success false when refused. No weight-update session: SGLang loads adapters outside one."""

    async def lora_answer(work):
        """`work`: a coroutine that loads or unloads and returns the loaded adapters."""
        try:
            return {"success": True, "error_message": None, "loaded_adapters": await work}
        except ValueError as e:  # a BadRequest, or a payload or checksum refused
            return JSONResponse({"success": False, "error_message": str(e), "loaded_adapters": None}, status_code=400)

    def lora_name(body: dict) -> str:
        if not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
            raise BadRequest(f"lora_name must be a non-empty string, got {body.get('lora_name')!r}")
        return body["lora_name"]

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: dict = BODY):
        name, path = lora_name(body), body.get("lora_path")
        if not isinstance(path, str) or not os.path.isfile(os.path.join(path, lora.PEFT_CONFIG)):
            raise BadRequest(f"lora_path {path!r} is not a PEFT adapter directory (with {lora.PEFT_CONFIG} and "
                             f"{lora.PEFT_WEIGHTS})")
        config = json.loads(open(os.path.join(path, lora.PEFT_CONFIG)).read())
        named = await asyncio.to_thread(read_safetensors_dir, path)
        return await lora_answer(asyncio.to_thread(engine.load_adapter, name, path, config, named))

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(body: dict = BODY):
        name, config = lora_name(body), body.get("config_dict")
        if not isinstance(config, dict):
            raise BadRequest("load_lora_adapter_from_tensors needs config_dict, the adapter's adapter_config.json")

        async def read_and_load():  # the weight updates' reader; load_adapter copies the tensors out
            named = await _own_payload(body, "load_lora_adapter_from_tensors", adapter=True)
            # expected_checksums: SGLang's own field (a mismatch refuses the adapter there too)
            await asyncio.to_thread(transfermesh.verify_adapter_sha256, named, body.get("expected_checksums"))
            return await asyncio.to_thread(engine.load_adapter, name, "__tensor__", config, named)
        return await lora_answer(read_and_load())

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: dict = BODY):
        return await lora_answer(asyncio.to_thread(engine.unload_adapter, lora_name(body)))


def build_app(engine: CpuEngine):
    """The FastAPI app serving `engine` under SGLang's native endpoint names, one group of routes at a time."""
    app = FastAPI(title="LoongSage CPU rollout engine")

    @app.exception_handler(BadRequest)
    async def _bad_request(request, exc: BadRequest):
        return JSONResponse({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}}, status_code=400)

    @app.exception_handler(Exception)
    async def _server_error(request, exc: Exception):
        traceback.print_exception(exc)
        return JSONResponse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "InternalServerError",
                                       "code": 500}}, status_code=500)

    _add_info_routes(app, engine)
    _add_generate_routes(app, engine)
    _add_memory_routes(app, engine)
    # SGLang 0.5.23: tensor and distributed updates must sit inside a begin/end weight-update session.
    session = {"open": False}
    _add_weight_routes(app, engine, session)
    _add_weight_group_routes(app, engine, session)
    _add_lora_routes(app, engine)
    return app


@dataclasses.dataclass
class ServerHandle:
    """A running CPU engine + HTTP server; `shutdown()` stops both."""
    url: str
    engine: CpuEngine
    server: object
    thread: threading.Thread

    def shutdown(self) -> None:
        self.engine.stop()  # first: in-flight requests answer (aborted), so the server can close cleanly
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve(model_path: str, host: str = "127.0.0.1", port: int = 0, **engine_opts) -> tuple[str, ServerHandle]:
    """Start a CPU engine and its HTTP server on a background thread; returns (url, handle).
    port=0 picks a free port. engine_opts go to CpuEngine (max_batch, max_len, seed, dtype, ...)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # TCP_NODELAY (inherited by accepted connections): a JSON answer goes out as two writes, headers then body, and
    # with Nagle's algorithm the body waited for the client's delayed ACK, ~40 ms on every call
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))  # first, so a taken port fails before the model loads
        engine = CpuEngine(model_path, **engine_opts).start()
    except BaseException:
        sock.close()
        raise
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning", lifespan="off",
                                           timeout_keep_alive=60))
    engine.on_death = lambda: setattr(server, "should_exit", True)  # a dead scheduler takes the server with it
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="cpu-engine-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            engine.stop()
            raise RuntimeError(f"the HTTP server for {model_path} did not start on {url}")
        time.sleep(0.01)
    return url, ServerHandle(url, engine, server, thread)


def main() -> None:
    p = argparse.ArgumentParser(description="Serve the LoongSage CPU rollout engine (SGLang's native HTTP API).")
    p.add_argument("--model-path", required=True, help="HF model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-batch", type=int, default=64, help="KV-cache slots = requests running at once")
    p.add_argument("--max-len", type=int, default=None, help="context per request (prompt + output)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="honour sampling_params.sampling_seed (SGLang's flag; without it the seed is ignored)")
    p.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache (SGLang's flag)")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per stream=true chunk (SGLang's flag)")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (SGLang's flag)")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--lora-target-modules", nargs="*", default=list(lora.TARGETS))
    a = p.parse_args()
    url, handle = serve(a.model_path, a.host, a.port, max_batch=a.max_batch, max_len=a.max_len, seed=a.seed,
                        dtype=a.dtype, enable_deterministic_inference=a.enable_deterministic_inference,
                        disable_radix_cache=a.disable_radix_cache, stream_interval=a.stream_interval,
                        lora=dict(max_lora_rank=a.max_lora_rank, lora_target_modules=a.lora_target_modules)
                        if a.enable_lora else None)
    print(f"CPU rollout engine for {a.model_path} serving at {url} (Ctrl-C to stop)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a clean shutdown on `kill` too
    try:
        while handle.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        handle.shutdown()
    if handle.engine.died:  # as SGLang's server, which exits when its scheduler dies
        sys.exit(f"the scheduler died: {handle.engine.died}")


if __name__ == "__main__":
    main()
