"""Wire formats: the OpenAI Chat Completions, Anthropic Messages and OpenAI Responses APIs as the router speaks them.

The router (agentflow.py) calls this module at its edges only: a request body comes in, is checked against what
the API accepts and becomes one internal chat (`ChatRequest`: messages {role, content: str, tool_calls?,
tool_call_id?, reasoning_content?}, function tools in the OpenAI shape the chat template renders, sampling
overrides, template variables); a generated `Turn` goes out as the API's response, and a turn being generated as the
API's stream events (`*_stream`, which read the router's reasoning and content deltas as they settle, then the Turn).

A thinking model's thinking (split off by its reasoning parser, chat.py) goes out as each API shows it: Chat
Completions `reasoning_content` (SGLang's field; in the stream, delta chunks before the content), Messages
`thinking` blocks (the request's `thinking` switches it via the template, as SGLang maps it), Responses `reasoning`
items. Thinking sent back in a history (those same fields) becomes the turn's `reasoning_content`.

Nothing here holds state or talks to an engine, so each function can be read, and tested, on its own.

Reading order: error bodies; request parsing (`openai_request`, `anthropic_request`, and below them
`*_messages`, `*_tools`, the field checks); response shapes (`openai_response` / `openai_stream`,
`anthropic_response` / `anthropic_stream`); the Responses API (`responses_request` with `responses_messages`
and `responses_tools`, then `responses_output`, `responses_response`, `responses_stream`).

What an API refuses gets an `ApiError` (HTTP status, message naming the field and the value seen), rendered in
that API's error shape by the router. Options the engine cannot honour are refused rather than ignored, so the
trainer never sees a sample drawn from a different distribution than the agent asked for (the field tables and
`_check_fields` say how each top-level field is taken).
`chat_template_kwargs` (SGLang's extension) sets template variables such as Qwen3's `enable_thinking`, which a
reasoning effort or the Messages `thinking` also switches (`_effort`). Structured output (Responses `text.format`,
Chat Completions `response_format`) becomes SGLang's `json_schema` sampling parameter (`_output_format`); Responses
custom tools are functions of one string parameter (`responses_tools`).

Test: `.venv/bin/pytest tests/test_agentflow.py tests/test_responses.py` (through the router, with the official
openai and anthropic clients); streaming in tests/test_token_stream.py. Left out: images/audio parts, built-in
Responses tools, custom tools with a grammar format, n > 1, top_logprobs, tool-call argument deltas while a call is
generated (a function or custom tool call streams whole), `strict` function arguments under tool_choice "auto" in
templates without a per-call marker (a forced tool_choice is enforced, `strict` schemas included, and "auto" strict
calls in Hermes-style templates: chat.ChatFormat.tool_grammar), tools' defer_loading / async / programmatic
callers / output_schema, `text.verbosity` (inert: the template has no such variable), Responses `truncation: auto`,
`background`, stored `prompt`s and `conversation`s.
"""
from __future__ import annotations

import base64
import difflib
import json
import re
import time
import uuid
from dataclasses import dataclass, field


# ----------------------------------------------------------------------------------------------
# errors that reach an API client: each renders as an OpenAI- or Anthropic-style error body


class ApiError(Exception):
    """A request the router refuses; `status` is the HTTP code, `code` a machine-readable reason."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


_OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                       503: "server_error"}
_ANTHROPIC_ERROR_TYPES = {**_OPENAI_ERROR_TYPES, 503: "overloaded_error"}


def openai_error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": _OPENAI_ERROR_TYPES.get(e.status, "server_error"),
                      "param": e.param, "code": e.code}}


def anthropic_error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


# ----------------------------------------------------------------------------------------------
# request normalisation: OpenAI and Anthropic chat formats -> one internal message list


_TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")  # both APIs' tool-name rule


def _text_of(content, where: str, *, parts: tuple[str, ...] = ("text",)) -> str:
    """A message content (str, None, or a list of text parts/blocks) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            if kind not in parts or not isinstance(p.get(kind), str):
                raise ApiError(400, f"{where}.content[{j}] has type {kind!r}; this router takes only text parts "
                               f"({', '.join(parts)}) with a string '{parts[0]}'", param=f"{where}.content")
        return "".join(p[p["type"]] for p in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts, got {type(content).__name__}",
                   param=f"{where}.content")


def _tool_call(name, args, call_id, where: str) -> dict:
    if not isinstance(call_id, str) or not call_id:
        raise ApiError(400, f"{where}: a tool call needs a string 'id' (the tool result answers it), got "
                       f"{call_id!r}", param=where)
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where}: tool call needs a function name, got {name!r}", param=where)
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ApiError(400, f"{where}: tool call arguments are not valid JSON ({e}): {args[:200]!r}",
                           param=where) from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}: tool call arguments must be a JSON object, got {type(args).__name__}",
                       param=where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _check_tool_answers(out: list[dict], api: str) -> None:
    """Each tool result answers a call the assistant made just before it, and each such call is answered
    before the conversation goes on (both APIs refuse otherwise; the template would render an orphan
    tool result, or a call with no result, into a context the model never sees in practice)."""
    open_ids: list[str] = []  # calls of the last assistant turn not answered yet
    for m in out:
        if m["role"] == "tool":
            if m["tool_call_id"] not in open_ids:
                raise ApiError(400, f"{m['where']}: {'tool_use_id' if api == 'anthropic' else 'tool_call_id'} "
                               f"{m['tool_call_id']!r} answers no tool call of the preceding assistant message "
                               f"(unanswered calls there: {open_ids})", param=m["where"])
            open_ids.remove(m["tool_call_id"])
            continue
        if open_ids:
            raise ApiError(400, f"{m['where']}: the assistant message before it made tool calls {open_ids} that "
                           "were not answered; send a tool result for each call id first", param=m["where"])
        open_ids = [c["id"] for c in m.get("tool_calls") or ()]
    for m in out:
        m.pop("where")


def openai_messages(raw) -> list[dict]:
    """OpenAI chat `messages` -> internal messages {role, content: str, tool_calls?} (400 on anything else)."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list of chat messages", param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object, got {type(m).__name__}", param=where)
        role = {"developer": "system"}.get(m.get("role"), m.get("role"))
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"{where}.role is {role!r}; expected one of system, developer, user, assistant, tool",
                           param=f"{where}.role")
        if role == "system" and i != 0:
            # The chat template renders a system message only in first position; elsewhere it would vanish.
            raise ApiError(400, f"{where}: a system message is only allowed as the first message", param=where)
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise ApiError(400, f"{where}.name must be a string, got {m['name']!r:.100}", param=f"{where}.name")
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
            raise ApiError(400, f"{where}: a {m.get('role')} message needs 'content'" +
                           (" (or 'tool_calls')" if role == "assistant" else ""), param=f"{where}.content")
        if m.get("content") == []:
            raise ApiError(400, f"{where}.content is an empty array; give a string or at least one part",
                           param=f"{where}.content")
        parts = ("text", "refusal") if role == "assistant" else ("text",)
        msg = {"role": role, "content": _text_of(m.get("content"), where, parts=parts), "where": where}
        if role == "assistant" and m.get("reasoning_content") is not None:  # SGLang's field for a turn's thinking
            if not isinstance(m["reasoning_content"], str):
                raise ApiError(400, f"{where}.reasoning_content must be a string, got {m['reasoning_content']!r:.100}",
                               param=f"{where}.reasoning_content")
            if m["reasoning_content"]:
                msg["reasoning_content"] = m["reasoning_content"]
        if role == "assistant" and m.get("tool_calls") is not None:
            if not isinstance(m["tool_calls"], list):
                raise ApiError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or tc.get("type", "function") != "function":
                    raise ApiError(400, f"{where}.tool_calls[{j}] needs type 'function' and a 'function' object",
                                   param=f"{where}.tool_calls")
                if not isinstance(fn.get("arguments"), str):  # OpenAI sends and takes them as a JSON string
                    raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments must be a JSON string, got "
                                   f"{type(fn.get('arguments')).__name__}", param=f"{where}.tool_calls")
                calls.append(_tool_call(fn.get("name"), fn["arguments"], tc.get("id"), f"{where}.tool_calls[{j}]"))
            if calls:
                msg["tool_calls"] = calls
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(400, f"{where}: a tool message needs the string 'tool_call_id' of the call it "
                               f"answers, got {m.get('tool_call_id')!r:.100}", param=f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    _check_tool_answers(out, "openai")
    return out


def openai_tools(raw) -> list[dict] | None:
    """Validate OpenAI `tools` ([{"type": "function", "function": {name, description?, parameters?}}])."""
    tools = []
    for i, t in enumerate(_tool_list(raw)):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ApiError(400, f"invalid tool schema at tools[{i}]: expected "
                           "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}} (only function "
                           "tools are supported)", param=f"tools[{i}]")
        tools.append(_function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools[{i}]"))
    return _unique_tools(tools)


def _tool_list(raw) -> list:
    """A request's `tools`, a list ([] when absent); what each tool may be is its API's to check."""
    if raw is not None and not isinstance(raw, list):
        raise ApiError(400, f"'tools' must be a list, got {type(raw).__name__}", param="tools")
    return raw or []


def _unique_tools(tools: list[dict]) -> list[dict] | None:
    names = [t["function"]["name"] for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ApiError(400, f"tool names must be unique; repeated: {dup}", param="tools")
    return tools or None


def _function_tool(name, description, parameters, where: str) -> dict:
    if not isinstance(name, str) or not _TOOL_NAME_RE.match(name):
        raise ApiError(400, f"invalid tool schema at {where}: name {name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$",
                       param=where)
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
        raise ApiError(400, f"invalid tool schema at {where}: parameters must be a JSON-schema object "
                       f"({{'type': 'object', ...}}), got {parameters!r:.200}", param=where)
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"invalid tool schema at {where}: description must be a string", param=where)
    return {"type": "function", "function": {
        "name": name, **({} if description is None else {"description": description}),
        "parameters": parameters if parameters is not None else {"type": "object", "properties": {}}}}


def anthropic_messages(system, raw) -> list[dict]:
    """Anthropic `system` + `messages` (text / tool_use / tool_result blocks) -> internal messages."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
    out = []
    if system:
        out.append({"role": "system", "content": _text_of(system, "system"), "where": "system"})
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system") or \
                m["role"] == "system" and i == 0:
            role = m.get("role") if isinstance(m, dict) else None
            raise ApiError(400, f"{where}.role is {role!r}; Anthropic messages take 'user', 'assistant' or, after the "
                           "first, 'system' (the system prompt goes in the top-level 'system' field)",
                           param=f"{where}.role")
        if m["role"] == "system":  # Claude Code sends its environment as one, after the first user message
            out.append({"role": "system", "content": _text_of(m.get("content"), where), "where": where})
            continue
        if m["role"] == "assistant" and i == len(raw) - 1:
            raise ApiError(400, f"{where}: the conversation ends with an assistant message (prefill); this "
                           "router does not support prefill: end with a user message", param=where)
        content = m.get("content")
        if isinstance(content, str):
            if not content:
                raise ApiError(400, f"{where}: all messages must have non-empty content", param=where)
            out.append({"role": m["role"], "content": content, "where": where})
            continue
        if not isinstance(content, list) or not content:
            raise ApiError(400, f"{where}.content must be a non-empty string or a non-empty list of content blocks",
                           param=where)
        texts, calls, thinking = [], [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            bw = f"{where}.content.{j}"
            if kind == "thinking" and m["role"] == "assistant" and isinstance(b.get("thinking"), str):
                thinking.append(b["thinking"])  # an earlier turn's thinking, echoed back: its reasoning_content
            elif kind == "redacted_thinking" and m["role"] == "assistant":
                raise ApiError(400, f"{bw}: redacted_thinking blocks are not supported (this model's thinking is never "
                               "redacted; send its thinking blocks back as they came)", param=bw)
            elif kind == "text" and isinstance(b.get("text"), str):
                if not b["text"]:
                    raise ApiError(400, f"{bw}: text content blocks must be non-empty", param=bw)
                texts.append(b["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("input"), dict):
                    raise ApiError(400, f"{bw}: tool_use.input must be an object", param=bw)
                calls.append(_tool_call(b.get("name"), b["input"], b.get("id"), bw))
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise ApiError(400, f"{bw}: tool_result needs the string 'tool_use_id' of the call it answers",
                                   param=bw)
                # Tool results become tool messages, rendered by the template as <tool_response> blocks.
                out.append({"role": "tool", "content": _text_of(b.get("content"), bw),
                            "tool_call_id": b["tool_use_id"], "where": bw})
            else:
                raise ApiError(400, f"{bw} has unsupported block type {kind!r} for role {m['role']!r} "
                               "(supported: text, tool_use and thinking in assistant turns, tool_result in user turns)",
                               param=bw)
        if texts or calls or thinking:
            msg = {"role": m["role"], "content": "".join(texts), "where": where}
            if thinking and any(thinking):
                msg["reasoning_content"] = "\n".join(t for t in thinking if t)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    _check_tool_answers(out, "anthropic")
    return out


def anthropic_tools(raw) -> list[dict] | None:
    """Anthropic tools ([{name, description?, input_schema}]) -> the OpenAI tool format the template renders."""
    tools = []
    for i, t in enumerate(_tool_list(raw)):
        if isinstance(t, dict) and t.get("defer_loading") is True:
            continue  # a deferred tool is not in the model's context until a tool search loads it (none runs here)
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or \
                not isinstance(t.get("input_schema"), dict):
            raise ApiError(400, f"invalid tool schema at tools.{i}: expected a client tool {{'name', 'description', "
                           "'input_schema': {'type': 'object', ...}}} (server tools are not supported)",
                           param=f"tools.{i}")
        tools.append(_function_tool(t.get("name"), t.get("description"), t["input_schema"], f"tools.{i}"))
    return _unique_tools(tools)


# Top-level request fields: those of the official SDKs' request types and those the agent programs of
# tests/test_real_agents.py send (tests/agent_requests/), in three kinds: honoured (the handlers read them); inert
# (no effect on what is generated), only type-checked; honoured only at their default value, because the engine
# cannot do otherwise. Unknown fields: `_check_fields`.
_OPENAI_HONOURED = {"messages", "model", "max_tokens", "max_completion_tokens", "stop", "stream", "stream_options",
                    "temperature", "top_p", "top_k", "tools", "tool_choice", "logprobs", "response_format",
                    "reasoning_effort", "chat_template_kwargs", "separate_reasoning",  # these two: SGLang's
                    "parallel_tool_calls"}  # enforced with a forced tool_choice; with "auto" the model's calls stand
_OPENAI_INERT = {"metadata": dict, "store": bool, "user": str, "safety_identifier": str, "prompt_cache_key": str,
                 "prompt_cache_options": dict, "prompt_cache_retention": str, "service_tier": str, "seed": int,
                 "verbosity": str, "moderation": dict, "client_metadata": dict}  # Codex's: ids of its thread and turn
_OPENAI_DEFAULT_ONLY = {"n": [1], "top_logprobs": [0], "frequency_penalty": [0], "presence_penalty": [0],
                        "logit_bias": [{}], "modalities": [["text"]],
                        "audio": [], "prediction": [], "web_search_options": [], "functions": [], "function_call": []}
_ANTHROPIC_HONOURED = {"messages", "model", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
                       "top_k", "tools", "tool_choice", "thinking",
                       "output_config", "context_management"}  # Claude Code's: effort (and format), thinking edits
_ANTHROPIC_INERT = {"metadata": dict, "service_tier": str, "cache_control": dict, "inference_geo": str, "speed": str,
                    "diagnostics": dict, "user_profile_id": str, "workspace_id": str, "container": (str, dict),
                    "betas": list}
_ANTHROPIC_DEFAULT_ONLY = {"mcp_servers": [[]]}


# Sampling fields of the three APIs. An unknown field within a small edit distance of one (`temprature`, `max_token`,
# `top-k`) is a typo the router refuses: passing it by would sample with a setting the agent did not ask for.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "max_output_tokens",
                   "stop", "stop_sequences", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty",
                   "logit_bias", "logprobs", "top_logprobs", "n")


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance, '-' and '_' and case alike (`top-k` is `top_k` mistyped, at distance 0)."""
    a, b = a.lower().replace("-", "_"), b.lower().replace("-", "_")
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def sampling_typo(name: str) -> str | None:
    """The sampling field `name` is a typo of: within 1 edit of a name of up to 5 characters, 2 of a longer one."""
    near = sorted((_edit_distance(name, f), f) for f in SAMPLING_FIELDS if len(f) > 1)
    return next((f for d, f in near if d <= (1 if len(f) <= 5 else 2)), None)


def _check_fields(body: dict, honoured: set, inert: dict, default_only: dict, strict: bool, required: tuple) -> tuple:
    """Check the top-level fields, the `required` ones present and `model` a string; returns the unknown ones
    accepted. Agent programs add fields with every release, so an unknown field passes (the router counts, warns and
    records it: agentflow.Router), unless it looks like a mistyped sampling field (`temprature`: 400); `strict`
    refuses every unknown field, naming the closest known one."""
    unknown = []
    for k, v in body.items():
        if k in honoured:
            continue
        if k in inert:
            if v is not None and (not isinstance(v, inert[k]) or isinstance(v, bool) and inert[k] is int):
                raise ApiError(400, f"'{k}' must be of type {getattr(inert[k], '__name__', inert[k])}, got {v!r:.100}",
                               param=k)
        elif k in default_only:
            if v is not None and v not in default_only[k]:
                raise ApiError(400, f"'{k}'={v!r:.200} is not supported by this router (the engine cannot honour it);"
                               f" leave it unset" + (f" or {default_only[k][0]!r}" if default_only[k] else ""), param=k)
        elif sampling_typo(k) or strict:
            close = sampling_typo(k) or (difflib.get_close_matches(k, sorted(honoured | set(inert) | set(default_only)),
                                                                   n=1) or [None])[0]
            raise ApiError(400, f"unrecognized request argument supplied: {k!r}" + (
                " (a sampling setting this API does not take)" if close == k else
                f"; did you mean {close!r}?" if close else ""), param=k)
        else:
            unknown.append(k)
    for name in required:
        if name not in body:
            raise ApiError(400, f"missing required field '{name}'", param=name)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ApiError(400, f"'model' must be a string, got {body['model']!r:.100}", param="model")
    return tuple(unknown)


def _flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {v!r:.100}", param=name)
    return default if v is None else v


def _positive_int(v, name: str) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ApiError(400, f"{name} must be a positive integer, got {v!r}", param=name)
    return v


def _stop_list(v, name: str, allow_str: bool = False) -> list[str] | None:
    if v is None:
        return None
    v = [v] if (allow_str and isinstance(v, str)) else v
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ApiError(400, f"{name} must be a list of non-empty strings{' (or one string)' if allow_str else ''}, "
                       f"got {v!r:.200}", param=name)
    return v


def _sampling_overrides(body: dict, temperature_max: float) -> dict:
    """Client sampling settings, validated. They override the recipe's for this turn: the engine samples with
    them, but the logprobs it returns are still log_softmax of the raw logits (temperature 1, before top-k/top-p;
    see rollout.py), the policy's logprob that the trainer recomputes. So a client temperature changes which
    tokens are drawn (the rollout is then off-policy, which the IS corrections see), not the logprob numbers.
    Ranges are the APIs': temperature [0, 2] (OpenAI) or [0, 1] (Anthropic), top_p [0, 1]."""
    out = {}
    for name, lo, hi in (("temperature", 0.0, temperature_max), ("top_p", 0.0, 1.0)):
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
            raise ApiError(400, f"{name} must be a number in [{lo}, {hi}], got {v!r}", param=name)
        out[name] = float(v)
    if out.get("top_p") == 0.0:  # the engines need a non-empty nucleus; top_p 0 keeps the single best token
        out["top_p"], out["top_k"] = 1.0, 1
    if body.get("top_k") is not None:
        out["top_k"] = _positive_int(body["top_k"], "top_k")
    return out


# apply_chat_template's own parameters: a chat_template_kwargs key of one of these names would change how the chat is
# rendered or tokenized instead of setting a template variable
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                       "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                       "return_assistant_tokens_mask", "tokenizer_kwargs", "add_generation_prompt",
                                       "continue_final_message"})


def _template_kwargs(v) -> dict:
    """SGLang's `chat_template_kwargs`: variables for the chat template (Qwen3's enable_thinking, ...)."""
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise ApiError(400, f"'chat_template_kwargs' must be an object of template variables, got {v!r:.200}",
                       param="chat_template_kwargs")
    reserved = sorted(set(v) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved}: they are arguments of the renderer, not "
                       "template variables", param="chat_template_kwargs")
    return dict(v)


def _output_format(fmt, param: str, nested: bool) -> dict:
    """Structured output -> the sampling params that constrain the engine (SGLang's mapping, serving_chat.py /
    protocol.py): `{"type": "text"}` none; `json_schema` its schema as a JSON string in `json_schema` (whatever
    `strict` says: a plain chat template never shows the schema to the model, so SGLang constrains it always);
    `json_object` the schema '{"type": "object"}'. The engine compiles it (xgrammar) and answers a schema it cannot
    compile with a 400, which the router passes on. `nested`: Chat Completions' shape (`json_schema: {name, schema,
    strict}`) rather than the Responses API's flat one (`name`, `schema`, `strict` beside `type`)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and len(fmt) == 1:
        return {}
    if kind == "json_object" and len(fmt) == 1:
        return {"json_schema": '{"type": "object"}'}
    spec = (fmt.get("json_schema") if nested else fmt) if kind == "json_schema" else None
    where = f"{param}.json_schema" if nested else param
    if not isinstance(spec, dict):
        shape = "'json_schema': {name, schema, strict}" if nested else "name, schema, strict"
        raise ApiError(400, f"{param} {fmt!r:.200} must be {{'type': 'text'}}, {{'type': 'json_object'}} or "
                       f"{{'type': 'json_schema', {shape}}} (grammar and structural_tag formats are not supported)",
                       param=param)
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"} - ({"type"} if not nested else set()))
    if extra or nested and set(fmt) != {"type", "json_schema"}:
        raise ApiError(400, f"{where} has unknown field(s) {extra or sorted(set(fmt) - {'type', 'json_schema'})}; "
                       "it takes name, schema, strict, description", param=where)
    if not isinstance(spec.get("name"), str) or not _TOOL_NAME_RE.match(spec["name"]):
        raise ApiError(400, f"{where}.name {spec.get('name')!r:.100} must match ^[a-zA-Z0-9_-]{{1,64}}$",
                       param=f"{where}.name")
    if not nested and "schema" not in spec:  # required in the Responses API, optional in Chat Completions
        raise ApiError(400, f"{where} needs a 'schema' (a JSON-schema object)", param=f"{where}.schema")
    if not isinstance(spec.get("schema", {}), dict) or spec.get("strict") not in (None, True, False) or \
            not isinstance(spec.get("description", ""), str):
        raise ApiError(400, f"{where}: schema must be a JSON-schema object, strict a boolean, description a string; "
                       f"got schema {spec.get('schema')!r:.100}, strict {spec.get('strict')!r}", param=where)
    return {"json_schema": json.dumps(spec.get("schema", {}))}


def _anthropic_thinking(v) -> bool | None:
    """The Messages `thinking` field -> thinking on (enabled) / off (disabled) / the model's own choice (adaptive, or
    not asked: None, the template's default; Claude Code asks adaptive of any model, thinking or not). Checked
    as the SDK's three variants: enabled needs budget_tokens >= 1024; disabled takes no other field; adaptive no
    budget. The budget is accepted and not enforced (the API calls it a target; max_tokens still caps the turn)."""
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ApiError(400, f"thinking {v!r:.200} must be {{'type': 'enabled', 'budget_tokens': n}}, "
                       "{'type': 'adaptive'} or {'type': 'disabled'}", param="thinking")
    extra = sorted(set(v) - {"type", "budget_tokens", "display"})
    budget = v.get("budget_tokens")
    if extra or (kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024)) or \
            (kind != "enabled" and budget is not None) or (kind == "disabled" and v.get("display") is not None) or \
            v.get("display") not in (None, "summarized", "omitted"):
        raise ApiError(400, f"thinking {v!r:.200}: 'enabled' needs an integer budget_tokens >= 1024, 'adaptive' takes "
                       "no budget_tokens, 'disabled' no other field; display is 'summarized' or 'omitted'",
                       param="thinking")
    return None if kind == "adaptive" else kind == "enabled"


def _anthropic_output_config(v) -> tuple[bool | None, dict]:
    """Messages `output_config` -> (thinking, grammar): `effort` (low ... max) sets thinking on as a reasoning effort
    does (any level; the level itself is not enforced) where `thinking` does not say; `format` {"type":
    "json_schema", "schema"} becomes the engine's json_schema parameter, as Chat Completions' response_format."""
    if v is None:
        return None, {}
    if not isinstance(v, dict) or set(v) - {"effort", "format"} or \
            v.get("effort") not in (None, "low", "medium", "high", "xhigh", "max"):
        raise ApiError(400, f"output_config {v!r:.200} takes effort (low, medium, high, xhigh, max) and format",
                       param="output_config")
    fmt = v.get("format")
    grammar = {} if fmt is None else _output_format({"name": "output", **fmt}, "output_config.format", nested=False)
    return (None if v.get("effort") is None else True), grammar


def _context_edits(v, messages: list[dict], model: str) -> None:
    """Messages `context_management` (Claude Code sends it): `clear_thinking_20251015` is applied (keep "all": no
    change; keep {"type": "thinking_turns", "value": n}: the thinking of all but the last n assistant turns is dropped
    before rendering); `clear_tool_uses_20250919` is refused in the words Claude Code recognises (it then stops
    sending the edit for the rest of its process, and old tool results stay in the prompt, as they are rendered)."""
    edits = v.get("edits") if isinstance(v, dict) and set(v) <= {"edits"} else None
    if not isinstance(edits, list) or not all(isinstance(e, dict) for e in edits):
        raise ApiError(400, f"context_management {v!r:.200} must be {{'edits': [...]}}", param="context_management")
    for e in edits:
        keep = e.get("keep", "all")
        if e.get("type") == "clear_tool_uses_20250919":
            raise ApiError(400, f"{model} does not support the clear_tool_uses_20250919 context management strategy "
                           "(the router renders every tool result; clear tool results in the agent, or start a new "
                           "context)", param="context_management")
        turns = keep.get("value") if isinstance(keep, dict) and keep.get("type") == "thinking_turns" else None
        if e.get("type") != "clear_thinking_20251015" or not (keep == "all" or isinstance(turns, int) and turns >= 0):
            raise ApiError(400, f"context_management edit {e!r:.200}: this router applies clear_thinking_20251015 "
                           "(keep 'all' or {'type': 'thinking_turns', 'value': n}) only", param="context_management")
        if turns is not None:
            said = [m for m in messages if m["role"] == "assistant"]
            for m in said[:len(said) - turns]:
                m.pop("reasoning_content", None)


def _forced(tools: list[dict] | None, name: str | None, every: bool) -> tuple:
    """ChatRequest.forced of any API: the one tool a choice names (`name`), else with `every` (OpenAI's "required",
    Anthropic's "any") all the tools, else none."""
    names = tuple(t["function"]["name"] for t in tools or ())
    if name is not None and name not in names:
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return (name,) if name is not None else names if every else ()


@dataclass
class ChatRequest:
    """A validated chat request, whichever API it came in."""
    messages: list[dict]
    tools: list[dict] | None
    parse_tools: bool              # False for tool_choice "none": tool-call text stays text
    max_tokens: int | None
    overrides: dict                # the client's sampling settings for this turn
    stop: list[str] | None
    stream: bool
    logprobs: bool = False         # OpenAI: return per-token logprobs
    include_usage: bool = False    # OpenAI streaming: a final usage chunk
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs: variables for the chat template
    separate_reasoning: bool = True  # OpenAI (SGLang's field): thinking in reasoning_content, or left in the content
    thinking: bool | None = None   # Anthropic `thinking` / Responses `reasoning`: on, off, or not asked
    custom_tools: frozenset = frozenset()  # Responses: names of the custom tools (rendered as one-string functions)
    structured: str | None = None  # the request field that asked for structured output (its grammar: in overrides)
    forced: tuple = ()             # tool_choice "required" / named: the tools the reply must call (one or more)
    parallel_calls: bool = True    # with `forced`: more than one call allowed (parallel_tool_calls)
    strict: frozenset = frozenset()  # tools whose arguments must follow their schema (`strict`; with `forced`)
    unknown: tuple = ()            # top-level fields no table knows, accepted (_check_fields)


def openai_request(body: dict, strict: bool = False) -> ChatRequest:
    """A Chat Completions body, checked against what the OpenAI API accepts (and what the router can do)."""
    unknown = _check_fields(body, _OPENAI_HONOURED, _OPENAI_INERT, _OPENAI_DEFAULT_ONLY, strict, ("messages",))
    messages, tools = openai_messages(body["messages"]), openai_tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") == "function" and \
        isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)
    if not (named or choice in ("auto", "none", "required")):
        raise ApiError(400, f"tool_choice {choice!r:.200} must be 'auto', 'none', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if "tool_choice" in body and body["tool_choice"] is not None and not tools:
        raise ApiError(400, "'tool_choice' is only allowed when 'tools' are specified", param="tool_choice")
    forced = _forced(tools, choice["function"]["name"] if named else None, choice == "required")
    stream, logprobs = _flag(body, "stream"), _flag(body, "logprobs")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true, as an object",
                       param="stream_options")
    include_usage = _flag(options or {}, "include_usage")
    for name in ("max_tokens", "max_completion_tokens"):
        _positive_int(body.get(name), name)
    stop = _stop_list(body.get("stop"), "stop", allow_str=True)
    if stop is not None and len(stop) > 4:
        raise ApiError(400, f"'stop' takes at most 4 sequences, got {len(stop)}", param="stop")
    grammar = {} if body.get("response_format") is None else \
        _output_format(body["response_format"], "response_format", nested=True)
    return ChatRequest(messages, tools, choice != "none", body.get("max_completion_tokens") or body.get("max_tokens"),
                       {**_sampling_overrides(body, temperature_max=2.0), **grammar}, stop, stream, logprobs,
                       include_usage, _template_kwargs(body.get("chat_template_kwargs")),
                       _flag(body, "separate_reasoning", True),
                       thinking=_effort(body.get("reasoning_effort"), "reasoning_effort"),
                       structured="response_format" if grammar else None, forced=forced,
                       parallel_calls=_flag(body, "parallel_tool_calls", True),
                       strict=frozenset(t["function"]["name"] for t in body.get("tools") or ()
                                        if t["function"].get("strict") is True), unknown=unknown)


def anthropic_request(body: dict, strict: bool = False, model: str = "loongsage") -> ChatRequest:
    """A Messages body, checked against what the Anthropic API accepts (and what the router can do)."""
    unknown = _check_fields(body, _ANTHROPIC_HONOURED, _ANTHROPIC_INERT, _ANTHROPIC_DEFAULT_ONLY, strict,
                            ("messages", "max_tokens"))
    if body["max_tokens"] == 0:
        raise ApiError(400, "max_tokens=0 (prompt-cache pre-warming) is not supported by this router; ask for "
                       ">= 1 token", param="max_tokens")
    if body["max_tokens"] is None:
        raise ApiError(400, "max_tokens must be a positive integer, got None", param="max_tokens")
    msgs, tools = anthropic_messages(body.get("system"), body["messages"]), anthropic_tools(body.get("tools"))
    if body.get("context_management") is not None:
        _context_edits(body["context_management"], msgs, model)
    effort, grammar = _anthropic_output_config(body.get("output_config"))
    thinking = _anthropic_thinking(body.get("thinking"))
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise ApiError(400, f"tool_choice {choice!r:.200} must be {{'type': 'auto' | 'any' | 'tool' | 'none'}}",
                           param="tool_choice")
        if choice.get("disable_parallel_tool_use") not in (None, True, False):
            raise ApiError(400, f"tool_choice.disable_parallel_tool_use must be a boolean, got "
                           f"{choice['disable_parallel_tool_use']!r:.100}", param="tool_choice")
    kind = (choice or {}).get("type")
    forced = _forced(tools, (choice.get("name") or "") if kind == "tool" else None, kind == "any")
    stop = body.get("stop_sequences")
    if stop is not None and not isinstance(stop, list):
        raise ApiError(400, f"'stop_sequences' must be a list of strings, got {stop!r:.100}", param="stop_sequences")
    return ChatRequest(msgs, tools, kind != "none", _positive_int(body["max_tokens"], "max_tokens"),
                       {**_sampling_overrides(body, temperature_max=1.0), **grammar},
                       _stop_list(stop, "stop_sequences"), _flag(body, "stream"),
                       thinking=effort if body.get("thinking") is None else thinking, forced=forced,
                       structured="output_config.format" if grammar else None,
                       parallel_calls=not (choice or {}).get("disable_parallel_tool_use"),
                       strict=frozenset(t["name"] for t in body.get("tools") or () if t.get("strict") is True),
                       unknown=unknown)


# ----------------------------------------------------------------------------------------------
# response shapes: OpenAI chat.completion(.chunk) and Anthropic message (+ stream events)


@dataclass
class Turn:
    """One generated assistant turn, parsed: what a Session (agentflow.py) hands to the response shapes below."""
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]           # weight version per output token
    finish_reason: str            # "stop" | "length" | "abort"
    content: str                  # text without tool-call blocks
    tool_calls: list[dict]
    prompt_tokens: int
    engine: str
    stop_sequence: str | None = None  # the stop string that ended the turn, if one did
    routed_experts: str = ""      # the engine's routing of input + output ids (minus the last), base64; "" if none
    reasoning: str = ""           # the thinking the reasoning parser split off ("" when the model did not think)
    reasoning_tokens: int = 0     # how many output tokens are thinking


def _openai_tool_calls(turn: Turn) -> list[dict]:
    # OpenAI sends arguments as a JSON string; internally they are a dict so histories compare by value.
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in turn.tool_calls]


def _finish_openai(turn: Turn) -> str:
    return "tool_calls" if turn.tool_calls else ("length" if turn.finish_reason == "length" else "stop")


def _finish_anthropic(turn: Turn) -> str:
    return "tool_use" if turn.tool_calls else "stop_sequence" if turn.stop_sequence is not None else \
        "max_tokens" if turn.finish_reason == "length" else "end_turn"


def _openai_logprobs(chat, turn: Turn) -> dict:
    """Per-token logprobs of the sampled tokens (no top_logprobs: the engine returns only the sampled one). `chat`:
    chat.ChatFormat, whose decode gives each token's text (left unannotated: chat.py imports this module)."""
    texts = [chat.decode([tid], skip_special_tokens=False) for tid in turn.output_ids]
    return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                        for text, lp in zip(texts, turn.logprobs)], "refusal": None}


def _openai_usage(turn: Turn) -> dict:
    usage = {"prompt_tokens": turn.prompt_tokens, "completion_tokens": len(turn.output_ids),
             "total_tokens": turn.prompt_tokens + len(turn.output_ids)}
    if turn.reasoning_tokens:
        usage["completion_tokens_details"] = {"reasoning_tokens": turn.reasoning_tokens}
    return usage


def openai_response(chat, turn: Turn, model: str, logprobs: bool) -> dict:
    # reasoning_content: SGLang's field for the thinking (null when the model did not think)
    message = {"role": "assistant", "content": turn.content if (turn.content or not turn.tool_calls) else None,
               "reasoning_content": turn.reasoning or None}
    if turn.tool_calls:
        message["tool_calls"] = _openai_tool_calls(turn)
    return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": _finish_openai(turn),
                                         "logprobs": _openai_logprobs(chat, turn) if logprobs else None}],
            "usage": _openai_usage(turn)}


def _sse(body: dict, event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + "data: " + json.dumps(body) + "\n\n"


async def openai_stream(chat, parts, model: str, logprobs: bool, include_usage: bool):
    """The chunks of a streamed reply as the turn is generated. `parts`: the router's async iterator of ("start",
    prompt_tokens), then ("reasoning", delta) and ("content", delta) as they settle, then ("turn", Turn); it raises
    ApiError when the turn fails. Out: role, reasoning_content deltas, content deltas, then at the end the tool calls
    (each a name chunk and an arguments chunk: a call is parsed whole), the finish chunk (with the logprobs of every
    output token, known only then), [usage], [DONE]; a failure is an error chunk in the API's error shape."""
    base = {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta, finish=None, lp=None):
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}]})

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for kind, value in parts:
            if kind == "reasoning":
                yield chunk({"reasoning_content": value})
            elif kind == "content":
                yield chunk({"content": value})
            elif kind == "turn":
                turn = value
    except ApiError as e:
        yield _sse(openai_error_body(e))
        return
    for i, c in enumerate(_openai_tool_calls(turn)):
        yield chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                     "function": {"name": c["function"]["name"], "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
    yield chunk({}, finish=_finish_openai(turn), lp=_openai_logprobs(chat, turn) if logprobs else None)
    if include_usage:
        yield _sse({**base, "choices": [], "usage": _openai_usage(turn)})
    yield "data: [DONE]\n\n"


def _anthropic_blocks(turn: Turn) -> list[dict]:
    """A thinking block (its signature empty: nothing signs this model's thinking), the text, the tool_use blocks. A
    tool_use id is the call's own id, so it comes back unchanged in tool_result (Mistral's templates render ids)."""
    blocks = [{"type": "thinking", "thinking": turn.reasoning, "signature": ""}] if turn.reasoning else []
    if turn.content or not turn.tool_calls:
        blocks.append({"type": "text", "text": turn.content})
    return blocks + [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                      "input": c["function"]["arguments"]} for c in turn.tool_calls]


def anthropic_response(turn: Turn, model: str) -> dict:
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": model,
            "content": _anthropic_blocks(turn), "stop_reason": _finish_anthropic(turn),
            "stop_sequence": turn.stop_sequence,
            "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": len(turn.output_ids)}}


async def anthropic_stream(parts, model: str):
    """The events of a streamed message as the turn is generated (`parts`: see openai_stream): message_start, a
    thinking block whose thinking_delta events follow the reasoning, a text block whose text_delta events follow the
    content, then at the end the tool_use blocks (each input whole, one input_json_delta), message_delta with the
    stop reason and usage, message_stop; a failure is an `error` event in the API's error shape. The blocks are
    those of the plain answer, in its order."""
    def event(kind, body):
        return _sse({"type": kind, **body}, kind)

    msg = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": model, "content": [],
           "stop_reason": None, "stop_sequence": None}
    index, open_kind = -1, None  # the block being streamed

    def start(block):
        nonlocal index, open_kind
        index, open_kind = index + 1, block["type"]
        return event("content_block_start", {"index": index, "content_block": block})

    try:
        async for kind, value in parts:
            if kind == "start":
                yield event("message_start", {"message": {**msg, "usage": {"input_tokens": value, "output_tokens": 0}}})
            elif kind == "reasoning":
                if open_kind != "thinking":
                    yield start({"type": "thinking", "thinking": "", "signature": ""})
                yield event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                              "thinking": value}})
            elif kind == "content":
                if open_kind != "text":
                    if open_kind is not None:
                        yield event("content_block_stop", {"index": index})
                    yield start({"type": "text", "text": ""})
                yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": value}})
            elif kind == "turn":
                turn = value
    except ApiError as e:
        yield event("error", {"error": anthropic_error_body(e)["error"]})
        return
    streamed = {"thinking", "text"} if open_kind == "text" else {open_kind}
    for b in _anthropic_blocks(turn):
        if b["type"] in streamed:  # its deltas went out as it was generated
            continue
        if open_kind is not None:
            yield event("content_block_stop", {"index": index})
        if b["type"] == "tool_use":
            yield start({**b, "input": {}})
            yield event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                          "partial_json": json.dumps(b["input"])}})
        else:  # an empty text block (nothing settled): the plain answer has one
            yield start({**b, "text": ""} if b["type"] == "text" else b)
    if open_kind is not None:
        yield event("content_block_stop", {"index": index})
    yield event("message_delta", {"delta": {"stop_reason": _finish_anthropic(turn),
                                            "stop_sequence": turn.stop_sequence},
                                  "usage": {"output_tokens": len(turn.output_ids)}})
    yield event("message_stop", {})


# ----------------------------------------------------------------------------------------------
# OpenAI Responses API (POST /v1/responses): input items in, output items out, same TITO path


def _response_parts_text(content, where: str) -> str:
    """Responses content: a string, or parts of type input_text / output_text / text."""
    if isinstance(content, list):
        content = [{"type": "text", "text": p.get("text")} if isinstance(p, dict) and
                   p.get("type") in ("input_text", "output_text", "text") else p for p in content]
    return _text_of(content, where)


def responses_messages(instructions, raw, previous: list[dict] | None) -> list[dict]:
    """Responses `input` (a string, or a list of message / function_call / function_call_output / custom_tool_call /
    custom_tool_call_output / reasoning items) after the conversation of `previous_response_id` -> internal messages;
    `instructions` become the system message (they are not carried over from the previous response, as in the API).
    A reasoning item's text becomes the reasoning_content of the assistant turn that follows it. A custom tool call
    becomes a call of the function it is rendered as (`responses_tools`): arguments {"input": its input}; its output
    a tool message like a function's."""
    msgs = list(previous or [])
    if msgs and msgs[0]["role"] == "system":  # the previous request's instructions (or first developer message)
        msgs.pop(0)
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, f"'instructions' must be a string, got {type(instructions).__name__}",
                           param="instructions")
        msgs.insert(0, {"role": "system", "content": instructions})
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'input' must be a non-empty string or list of input items", param="input")
    thinking = ""  # a reasoning item's text, for the next assistant turn

    def assistant(msg: dict) -> dict:
        nonlocal thinking
        if thinking:
            msg["reasoning_content"], thinking = thinking, ""
        return msg

    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object, got {type(item).__name__}", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise ApiError(400, f"{where}.role is {item.get('role')!r}; expected user, assistant, system or "
                               "developer", param=f"{where}.role")
            msg = {"role": role, "content": _response_parts_text(item.get("content"), where)}
            msgs.append(assistant(msg) if role == "assistant" else msg)
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "custom_tool_call" and not isinstance(item.get("input"), str):
                raise ApiError(400, f"{where}: a custom_tool_call needs its string 'input', got "
                               f"{item.get('input')!r:.100}", param=f"{where}.input")
            args = {CUSTOM_INPUT: item["input"]} if kind == "custom_tool_call" else item.get("arguments", "{}")
            call = _tool_call(item.get("name"), args, item.get("call_id"), where)
            if msgs and msgs[-1]["role"] == "assistant" and not thinking:  # several calls of one turn join its message
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            issued = {c["id"] for m in msgs for c in m.get("tool_calls") or ()}
            if item.get("call_id") not in issued:
                raise ApiError(400, f"{where}: no {kind.removesuffix('_output')} with call_id {item.get('call_id')!r} "
                               "precedes this output", param=f"{where}.call_id")
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": output if isinstance(output, str) else _response_parts_text(output, where)})
        elif kind == "reasoning":
            parts = item.get("content") or _decrypt(item.get("encrypted_content"), f"{where}.encrypted_content")
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                     for p in parts):
                raise ApiError(400, f"{where}.content must be a list of {{'type': 'reasoning_text', 'text': ...}}",
                               param=f"{where}.content")
            thinking = "".join(p["text"] for p in parts)
        else:
            raise ApiError(400, f"{where}.type is {kind!r}; supported: message, function_call, "
                           "function_call_output, custom_tool_call, custom_tool_call_output, reasoning",
                           param=f"{where}.type")
    return msgs


def _encrypt(reasoning: str) -> str:
    """A reasoning item's `encrypted_content` (asked for by include reasoning.encrypted_content with store false, as
    Codex does): the thinking itself, readable back by `_decrypt` when the item returns in a later input. Not a
    secret: a trajectory's thinking is the trainer's to read."""
    return "ls1." + base64.urlsafe_b64encode(reasoning.encode()).decode()


def _decrypt(blob, where: str) -> list[dict]:
    if blob is None:
        return []
    if not isinstance(blob, str) or not blob.startswith("ls1."):
        raise ApiError(400, f"{where} {blob!r:.60} was not made by this router (it reads back only the "
                       "encrypted_content of its own reasoning items)", param=where)
    return [{"type": "reasoning_text", "text": base64.urlsafe_b64decode(blob[4:].encode()).decode()}]


CUSTOM_INPUT = "input"  # the one string parameter a custom tool is rendered with
# Tool fields accepted at their neutral value only: tool search (defer_loading), OpenAI-side execution (async,
# programmatic callers), a schema of the tool's output: none is something a chat template renders. A function's
# `strict` holds its arguments to its schema (ChatRequest.strict; chat.ChatFormat.tool_grammar says where).
_TOOL_DEFAULT_ONLY = {"defer_loading": (None, False), "async": (None, False), "allowed_callers": (None, ["direct"]),
                      "output_schema": (None,)}


def responses_tools(raw) -> list[dict] | None:
    """Responses tools -> the function tools the chat template renders. A function tool ({"type": "function", "name",
    "description", "parameters"}) as it is. A custom tool ({"type": "custom", "name", "description", "format"}: the
    model writes free-form text as its input) becomes a function of one required string parameter, `input`, so every
    template and tool-call parser handles it as it handles functions; a call of it is answered as a custom_tool_call
    item whose `input` is that string (`responses_output`). Its format may only be text: a grammar (lark / regex) on
    the input alone would need a constrained span inside a free reply, which the engines are not asked for."""
    tools = []
    for i, t in enumerate(_tool_list(raw)):
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        where = f"tools[{i}]"
        if kind in ("function", "custom"):
            for name, neutral in _TOOL_DEFAULT_ONLY.items():
                if t.get(name) not in neutral:
                    raise ApiError(400, f"{where}.{name}={t[name]!r:.100} is not supported by this router (the chat "
                                   f"template renders a tool's name, description and parameters only); leave it unset",
                                   param=f"{where}.{name}")
        if kind == "function":
            extra = sorted(set(t) - {"type", "name", "description", "parameters", "strict", *_TOOL_DEFAULT_ONLY})
            if extra:
                raise ApiError(400, f"{where} has field(s) {extra} this router does not take (function tools: name, "
                               "description, parameters, strict)", param=where)
            tools.append(_function_tool(t.get("name"), t.get("description"), t.get("parameters"), where))
        elif kind == "custom":
            extra = sorted(set(t) - {"type", "name", "description", "format", *_TOOL_DEFAULT_ONLY})
            fmt = t.get("format")
            if extra or fmt is not None and fmt != {"type": "text"}:
                raise ApiError(400, f"{where}: a custom tool takes name, description and format {{'type': 'text'}} "
                               f"here (a grammar format is not supported: the input is free text); got "
                               f"{extra or fmt!r:.200}", param=where)
            tools.append(_function_tool(t.get("name"), t.get("description"), {
                "type": "object", "required": [CUSTOM_INPUT], "properties": {CUSTOM_INPUT: {
                    "type": "string", "description": "the tool's whole input, as free-form text"}}}, where))
        elif kind == "namespace" and isinstance(t.get("tools"), list):  # Codex's group of functions: each by its name
            tools += responses_tools(t["tools"]) or []
        elif kind not in HOSTED_TOOLS:
            raise ApiError(400, f"{where} has type {kind!r}; supported: function, custom, namespace, and the hosted "
                           f"tools {sorted(HOSTED_TOOLS)} (not shown to the model)", param=where)
    return _unique_tools(tools)


# Tools that run at OpenAI (Codex offers web_search by default): nothing runs them here, so the model is not shown
# them, as a request without them; the router warns once per kind and records them (responses_request: `unknown`)
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                          "computer_use_preview", "mcp", "tool_search"})


# The fields of a Responses create request (the official SDK's ResponseCreateParams), sorted as for Chat Completions.
_RESPONSES_HONOURED = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                       "top_p", "stream", "stream_options", "previous_response_id", "text", "reasoning", "include",
                       "top_k", "chat_template_kwargs",  # these two: SGLang's extensions
                       "parallel_tool_calls"}  # enforced with a forced tool_choice; with "auto" the model's calls stand
_RESPONSES_INERT = {**{k: v for k, v in _OPENAI_INERT.items() if k not in ("seed", "verbosity")},  # as Chat's
                    "max_tool_calls": int}  # caps built-in tool calls, and no built-in tool runs here
_RESPONSES_DEFAULT_ONLY = {"top_logprobs": [0], "truncation": ["disabled"], "background": [False], "prompt": [],
                           "conversation": [], "context_management": [[]], "background_options": [],
                           "access_programs": [], "image": []}
# What `include` may name: the token logprobs of the output text are returned; the rest name outputs of built-in
# tools and images (never produced here) or encrypted reasoning (reasoning items carry their text in the clear)
_RESPONSES_INCLUDABLE = {"message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                         "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                         "computer_call_output.output.image_url", "code_interpreter_call.outputs"}
_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _effort(v, param: str) -> bool | None:
    """A reasoning effort (Chat Completions `reasoning_effort`, Responses `reasoning.effort`) -> thinking on / off /
    not asked: "none" turns thinking off, any other level on (a chat template's thinking is a switch)."""
    if v is None:
        return None
    if v not in _REASONING_EFFORTS:
        raise ApiError(400, f"{param} {v!r:.100} must be one of {list(_REASONING_EFFORTS)}", param=param)
    return v != "none"


def _responses_reasoning(v) -> bool | None:
    """`reasoning` -> thinking on / off / not asked (`_effort`; the level itself is not enforced: the API calls it
    guidance, as Messages' budget_tokens). `summary` has no effect: the reasoning item carries the whole thinking as
    its content, with an empty summary. mode "pro" and a `context` other than auto are refused."""
    if v is None:
        return None
    extra = sorted(set(v) - {"effort", "summary", "generate_summary", "context", "mode"}) if isinstance(v, dict) else 0
    if not isinstance(v, dict) or extra or v.get("effort") not in (None, *_REASONING_EFFORTS) or \
            v.get("mode") not in (None, "standard") or v.get("context") not in (None, "auto") or \
            any(v.get(k) not in (None, "auto", "concise", "detailed") for k in ("summary", "generate_summary")):
        raise ApiError(400, f"reasoning {v!r:.200}: takes effort (one of {list(_REASONING_EFFORTS)}), summary "
                       "(auto, concise, detailed), mode 'standard' and context 'auto' here", param="reasoning")
    return _effort(v.get("effort"), "reasoning")


def _responses_tool_choice(choice, tools: list[dict] | None, custom: frozenset) -> tuple:
    """The tools a reply must call (ChatRequest.forced): all of them for "required", the one a named function or
    custom tool choice names, none for "auto" and "none"; allowed_tools and built-in tool choices are refused."""
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom") and set(choice) == {
        "type", "name"} and isinstance(choice.get("name"), str)
    if not (named or choice in ("auto", "none", "required")):
        raise ApiError(400, f"tool_choice {choice!r:.200} must be 'auto', 'none', 'required', {{'type': 'function', "
                       "'name': ...}} or {'type': 'custom', 'name': ...}", param="tool_choice")
    if named and (choice["name"] not in {t["function"]["name"] for t in tools or ()} or
                  (choice["type"] == "custom") != (choice["name"] in custom)):
        raise ApiError(400, f"tool_choice names the {choice['type']} tool {choice['name']!r}, which is not among "
                       "the tools", param="tool_choice")
    return _forced(tools, choice["name"] if named else None, choice == "required")


def responses_request(body: dict, previous: dict[str, list[dict]], strict: bool = False) -> ChatRequest:
    """A Responses body -> ChatRequest, its fields checked as Chat Completions' are (`_check_fields`). `previous`
    maps the session's response ids to their conversations (`previous_response_id` reaches only this session's)."""
    unknown = _check_fields(body, _RESPONSES_HONOURED, _RESPONSES_INERT, _RESPONSES_DEFAULT_ONLY, strict, ("input",))
    prev = body.get("previous_response_id")
    if prev is not None and prev not in previous:
        raise ApiError(400, f"previous_response_id {prev!r} is not a response of this session",
                       param="previous_response_id", code="previous_response_not_found")
    msgs = responses_messages(body.get("instructions"), body["input"], previous.get(prev))
    tools = responses_tools(body.get("tools"))
    custom = frozenset(t["name"] for t in body.get("tools") or () if t.get("type") == "custom")
    unknown += tuple(f"tools:{t['type']}" for t in body.get("tools") or () if t.get("type") in HOSTED_TOOLS)
    choice = body.get("tool_choice")
    forced = () if choice is None else _responses_tool_choice(choice, tools, custom)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_obfuscation"}):
        raise ApiError(400, f"stream_options {options!r:.100} is only allowed when 'stream' is true, as "
                       "{'include_obfuscation': bool}", param="stream_options")
    include = body.get("include") or []
    if not isinstance(include, list) or not set(include) <= _RESPONSES_INCLUDABLE:
        raise ApiError(400, f"include {include!r:.200}: each entry must be one of {sorted(_RESPONSES_INCLUDABLE)}",
                       param="include")
    text = body.get("text") or {}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or \
            text.get("verbosity") not in (None, "low", "medium", "high"):
        raise ApiError(400, f"text {text!r:.200} takes format and verbosity (low, medium, high)", param="text")
    grammar = {} if text.get("format") is None else _output_format(text["format"], "text.format", nested=False)
    return ChatRequest(msgs, tools, choice != "none", _positive_int(body.get("max_output_tokens"), "max_output_tokens"),
                       {**_sampling_overrides(body, temperature_max=2.0), **grammar}, None, stream,
                       logprobs="message.output_text.logprobs" in include,
                       template_kwargs=_template_kwargs(body.get("chat_template_kwargs")),
                       thinking=_responses_reasoning(body.get("reasoning")), custom_tools=custom,
                       structured="text.format" if grammar else None, forced=forced,
                       parallel_calls=_flag(body, "parallel_tool_calls", True),
                       # a custom tool's one string is its schema, always held; a function's where it is strict
                       strict=custom | {t["name"] for t in body.get("tools") or ()
                                        if t.get("type") == "function" and t.get("strict") is True}, unknown=unknown)


def _custom_input(arguments: dict) -> str:
    """A custom tool's input from the arguments of the function it is rendered as: the `input` string when the model
    wrote just that, else the arguments it wrote, whole, as JSON text (nothing of what it sampled is dropped)."""
    if set(arguments) == {CUSTOM_INPUT} and isinstance(arguments[CUSTOM_INPUT], str):
        return arguments[CUSTOM_INPUT]
    return json.dumps(arguments)


def responses_output(turn: Turn, custom: frozenset = frozenset(), logprobs: list | None = None) -> list[dict]:
    """The output items of a turn: a reasoning item (its thinking, if any), a message (its text, with `logprobs`: the
    output tokens' when `include` asks for message.output_text.logprobs) and one function_call item per call of a
    function tool, one custom_tool_call item per call of a custom tool (names in `custom`). A reasoning item carries
    its thinking in `content` and, for clients that keep nothing but `encrypted_content` (store false), there too."""
    out = []
    if turn.reasoning:
        out.append({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "status": "completed", "summary": [],
                    "content": [{"type": "reasoning_text", "text": turn.reasoning}],
                    "encrypted_content": _encrypt(turn.reasoning)})
    if turn.content or not turn.tool_calls:
        out.append({"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": turn.content, "annotations": [],
                                 "logprobs": logprobs or []}]})
    for c in turn.tool_calls:
        name, args = c["function"]["name"], c["function"]["arguments"]
        if name in custom:
            out.append({"type": "custom_tool_call", "id": "ctc_" + uuid.uuid4().hex, "call_id": c["id"], "name": name,
                        "input": _custom_input(args)})
        else:
            out.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": c["id"], "name": name,
                        "arguments": json.dumps(args), "status": "completed"})
    return out


def responses_logprobs(chat, turn: Turn) -> list[dict]:
    """The output text's logprobs as the Responses API lists them: every output token's (as Chat Completions'), no
    top_logprobs (the engine returns only the sampled token's)."""
    return [{**lp, "top_logprobs": []} for lp in _openai_logprobs(chat, turn)["content"]]


def responses_response(turn: Turn | None, model: str, rid: str, body: dict, output: list[dict]) -> dict:
    """The response object; `turn` None: as created, before its turn is generated (a stream's first events)."""
    incomplete = turn is not None and turn.finish_reason == "length" and not turn.tool_calls
    usage = None if turn is None else {
        "input_tokens": turn.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": len(turn.output_ids), "output_tokens_details": {"reasoning_tokens": turn.reasoning_tokens},
        "total_tokens": turn.prompt_tokens + len(turn.output_ids)}
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "in_progress" if turn is None else "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "output": output, "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "previous_response_id": body.get("previous_response_id"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": {"format": {"type": "text"}, **(body.get("text") or {})}, "reasoning": body.get("reasoning"),
            "usage": usage}


async def responses_stream(parts, model: str, rid: str, body: dict, custom: frozenset = frozenset(), logprobs_of=None):
    """The events of a streamed response as the turn is generated (`parts`: see openai_stream): created,
    in_progress; a reasoning item whose reasoning_text deltas follow the reasoning, a message item whose output_text
    deltas follow the content, each closed (done events) when the next opens or the turn ends; then at the end the
    function_call items (arguments whole: one function_call_arguments delta) and custom_tool_call items (input whole:
    one custom_tool_call_input delta), as a call is parsed whole; completed with the whole response, whose items keep
    the streamed ids. `logprobs_of(turn)`: the output text's logprobs, if asked, in the message's done events (known
    at the end only). Every event is numbered; a failure is an `error` event."""
    seq = iter(range(10 ** 9))

    def event(kind, **fields):
        return _sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    created = responses_response(None, model, rid, body, [])
    yield event("response.created", response=created)
    yield event("response.in_progress", response=created)
    opened: list[dict] = []  # the items streamed so far, each {"type", "id", "text"}; the last is open till the end
    turn = None

    def where():
        return dict(item_id=opened[-1]["id"], output_index=len(opened) - 1, content_index=0)

    def close():
        item = opened[-1]
        if item["type"] == "reasoning":
            yield event("response.reasoning_text.done", **where(), text=item["text"])
            done = {"type": "reasoning", "id": item["id"], "status": "completed", "summary": [],
                    "content": [{"type": "reasoning_text", "text": item["text"]}],
                    "encrypted_content": _encrypt(item["text"])}
        else:
            lps = logprobs_of(turn) if logprobs_of is not None and turn is not None else []
            part = {"type": "output_text", "text": item["text"], "annotations": [], "logprobs": lps}
            yield event("response.output_text.done", **where(), text=item["text"], logprobs=lps)
            yield event("response.content_part.done", **where(), part=part)
            done = {"type": "message", "id": item["id"], "status": "completed", "role": "assistant", "content": [part]}
        yield event("response.output_item.done", output_index=len(opened) - 1, item=done)

    def add(kind, item_id):
        opened.append({"type": kind, "id": item_id, "text": ""})
        item = {"type": kind, "id": item_id, "status": "in_progress"}
        item.update({"summary": [], "content": []} if kind == "reasoning" else {"role": "assistant", "content": []})
        yield event("response.output_item.added", output_index=len(opened) - 1, item=item)
        if kind == "message":
            yield event("response.content_part.added", **where(), part={
                "type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def delta(text):
        opened[-1]["text"] += text
        if opened[-1]["type"] == "reasoning":
            yield event("response.reasoning_text.delta", **where(), delta=text)
        else:
            yield event("response.output_text.delta", **where(), delta=text, logprobs=[])

    try:
        async for kind, value in parts:
            if kind == "turn":
                turn = value
            if kind not in ("reasoning", "content"):
                continue
            item_type = "reasoning" if kind == "reasoning" else "message"
            if not (opened and opened[-1]["type"] == item_type):
                item_id = ("rs_" if kind == "reasoning" else "msg_") + uuid.uuid4().hex
                for ev in [*(close() if opened else ()), *add(item_type, item_id)]:  # the open one closes first
                    yield ev
            for ev in delta(value):
                yield ev
    except ApiError as e:
        yield event("error", code=e.code, message=e.message, param=e.param)
        return
    if opened:
        for ev in close():
            yield ev
    output = responses_output(turn, custom, logprobs_of(turn) if logprobs_of is not None else None)
    for item, streamed in zip(output, opened):  # the streamed items come first, in the same order
        item["id"] = streamed["id"]
    for i, item in enumerate(output[len(opened):], start=len(opened)):
        if item["type"] in ("function_call", "custom_tool_call"):  # a function's arguments, a custom tool's input
            key, kind = ("arguments", "function_call_arguments") if item["type"] == "function_call" else \
                ("input", "custom_tool_call_input")
            yield event("response.output_item.added", output_index=i, item={**item, key: ""} | (
                {"status": "in_progress"} if "status" in item else {}))
            yield event(f"response.{kind}.delta", item_id=item["id"], output_index=i, delta=item[key])
            yield event(f"response.{kind}.done", item_id=item["id"], output_index=i, **{key: item[key]},
                        **({"name": item["name"]} if key == "arguments" else {}))
            yield event("response.output_item.done", output_index=i, item=item)
        else:  # nothing of it settled before the end (an empty message): its whole sequence now
            text = item["content"][0]["text"]
            for ev in [*add(item["type"], item["id"]), *(delta(text) if text else ()), *close()]:
                yield ev
    yield event("response.completed", response={**responses_response(turn, model, rid, body, output),
                                                "created_at": created["created_at"]})
