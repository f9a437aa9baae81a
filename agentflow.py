"""AgentFlow: every agent trains through a standard chat API.

The controller's rollout producer hands AgentFlow prompt groups with `submit(groups, n, sampling, step)` and
takes each group back from `completed()` the moment its n trajectories are done (groups finish in any order;
see `train()` in loongsage.py for the window that decides how many are in flight). `generate(samples, n,
sampling, step)` does the same for one batch and waits for all of it (eval). Each trajectory is produced one
of three ways:

* `cfg.agent == ""` and no `cfg.agent_command` (the fast path of the CPU recipes): render
  `sample["messages"]` with the chat template and send the token ids straight to the least-loaded
  rollout engine's `/generate` — no HTTP router hop.
* `cfg.agent = "module.function"` (white-box): `async def agent(client, sample)` gets an official
  `openai.AsyncOpenAI` bound to a per-trajectory session URL of the router and talks to it like to any
  OpenAI endpoint. It returns its final text, or a dict that may carry its own `reward`; otherwise
  the reward is computed from the session's last assistant text.
* `cfg.agent_command = "<shell command>"` (black-box): any program, run in a sandbox
  (`cfg.sandbox`) with OPENAI_BASE_URL / OPENAI_API_KEY / ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY
  pointing at its session (OPENAI_MODEL: the name the router serves); the task (the sample's last
  user message) arrives on stdin and in $LOONGSAGE_TASK (the whole sample as JSON in the file
  $LOONGSAGE_SAMPLE_FILE); what it prints is its answer, and the reward is computed from that.

The reward is `cfg.reward(text, sample)` (a data source's own `reward` for its samples, as its `agent` replaces
`cfg.agent`), or with `reward: judge` a judge model's parsed verdict: once a group is complete, `_judge` sends its
trajectories to the judge's engine (`cfg.judge`) as one batched greedy /generate; a judge that does not answer
within judge.timeout fails those trajectories, not the step.

Budgets per trajectory: `cfg.agent_timeout` seconds, `cfg.max_turns` model calls, `cfg.max_context_len`
tokens (a request past it gets a 400 `context_length_exceeded`; what was generated is kept and the
trajectory is "truncated"); a failed trajectory is retried up to `cfg.agent_retries` times and then
kept as "failed" (reward 0, loss_mask all 0) so its group stays complete.

The router is one HTTP server in front of all engines. Each trajectory gets a session base URL
`http://host:port/s/<session>/v1` (the session id and the api key are unguessable tokens) serving OpenAI
`POST /chat/completions` and `POST /responses` (`previous_response_id` within the session, across weight updates),
Anthropic `POST /messages` and `GET /models`, plain and streaming (`Router._streamed`), with tool calls. A
session sticks to one engine (its KV prefix cache stays warm); new sessions go to the engine with the fewest requests
in flight. An engine that fails a call or a periodic probe leaves routing at once (rollout.EnginePool); the controller
re-creates it and `replace_engine` routes to its successor.

Requests are checked, and answered, in each API's own shapes by wire.py (its docstring says what is refused and
why); structured output is constrained decoding in the engine, its logprobs those of the masked distribution
(docs/ENGINES.md).

Token in, token out (TITO): the chat is rendered with the template once. On the next turn the router
checks that the new messages extend the previous ones, keeps the exact token ids the model produced,
and appends only the tokens of the new messages (loss_mask 0). Generated text is never re-tokenized,
so the trainer sees exactly the ids — and logprobs, and weight versions — the engine sampled, a thinking model's
thinking included. A history that does not extend starts a new segment (`Session.plan`); all segments are kept.

Black-box agents and code-test rewards run in sandboxes (sandbox.py: limits, containment where the OS allows,
every process killed at the end). With `cfg.agent_preload` (e.g. ["openai"]) a Python agent command is forked
from one warm interpreter that has imported those modules, instead of starting Python per trajectory.

Reading order (top to bottom): `Trajectory`, what the trainer reads; `Session`, where TITO happens; `Router`, the HTTP
endpoints, one method per route; the code-test reward; `AgentFlow`, the actor the controller calls. The engines behind
the router are `rollout.EnginePool`, the chat template and the family's parsers `chat.ChatFormat`, and wire.py holds
the OpenAI / Anthropic / Responses formats and nothing else: this file is the system and that one the protocol.

Run a router by hand over running engines (prints session settings for any OpenAI/Anthropic client):
`python agentflow.py --engine http://127.0.0.1:30000 --tokenizer DIR`.
Test: `.venv/bin/pytest tests/test_agentflow.py` (CPU engine + router + official openai/anthropic
clients), the Responses API in `tests/test_responses.py`; streaming in `tests/test_token_stream.py`. Left out: the API
features wire.py's docstring lists (images/audio, built-in tools, n > 1 per request: ask n sessions instead, tool-call
deltas, strict calls under tool_choice "auto" in templates without a per-call marker), structured output or a forced
tool call together with thinking, structured output with tools, stop strings inside the engine (the router cuts the
turn after it ends, so a streamed reply with `stop` waits, like a plain one, for the engine to finish), per-token
logprobs in stream chunks (they all come with the last one), retrying a failed judgement (the trajectory stays failed).
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import base64
import collections
import contextlib
import functools
import gc
import hashlib
import importlib
import inspect
import json
import logging
import math
import re
import secrets
import signal
import socket
import ssl
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

import chat
import data
import rollout
import sandbox
from wire import (ApiError, Turn, anthropic_error_body, anthropic_request, anthropic_response, anthropic_stream,
                  openai_error_body, openai_messages, openai_request, openai_response, openai_stream, openai_tools,
                  responses_logprobs, responses_output, responses_request, responses_response, responses_stream)

log = logging.getLogger("loongsage.agentflow")
# A request's segment label (Router._admit): one of config.SEGMENT_LABELS; Config.train_labels picks those that train,
# the others stay in the trajectory, loss mask 0. A side call names SIDE_MODEL; a compaction opens with Codex's prompt.
SIDE_MODEL = "loongsage-side"
CODEX_COMPACTION = "You are performing a CONTEXT CHECKPOINT COMPACTION."


# ----------------------------------------------------------------------------------------------
# the trajectory: what one sample becomes, and what the trainer reads


@dataclass
class Trajectory:
    prompt_ids: list[int]          # the rendered first prompt of the (last) segment, chat template applied
    response_ids: list[int]        # every token after the prompt: model tokens and tool/template tokens interleaved
    loss_mask: list[int]           # 1 on tokens the model generated, 0 on tokens the template or tools inserted
    rollout_logprobs: list[float]  # engine logprob of each response token; 0.0 where loss_mask == 0
    weight_versions: list[int]     # engine weight version that sampled each token; -1 where loss_mask == 0
    routed_experts: str = ""       # router_replay: the engine's meta_info.routed_experts of the last call, base64 int32
    #                                (tokens, layers, top_k) over prompt_ids + response_ids from position 0 (the tokens
    #                                no call ran on, at the end, are absent); "" otherwise. The trainer replays it (R3)
    segments: list[dict] = field(default_factory=list)  # one dict per context segment (same keys as above);
    #                                the last one is the top-level fields; earlier ones exist when the agent
    #                                compacted/edited its history, so a forker can train on them too
    reward: float = 0.0            # scalar reward of the whole trajectory
    turn_rewards: list[float] = field(default_factory=list)  # optional, one per model turn of the last segment
    #                                (an agent returns {"turn_rewards": [...]}): returns / gae / reinforce_pp
    #                                then reward each turn's last token instead of only the final one
    status: str = "ok"             # "ok" | "failed" (agent/engine/sandbox error, an agent's garbage return, a reward
    #                                that raised or is not a finite number: reward 0, loss_mask all 0) | "aborted" |
    #                                "truncated" (hit a token/turn/time budget; still rewarded and trainable)
    group_id: int = -1             # which prompt this sample answers; unique across generate() calls
    sample_index: int = -1         # 0..n-1 within its group
    timings: dict = field(default_factory=dict)   # seconds: total_s, generate_s, reward_s
    metadata: dict = field(default_factory=dict)  # free-form: step, engine, finish_reason, turns, error, ...
    prompt_text: str = ""          # decoded prompt, for logging only
    response_text: str = ""        # the text the reward was computed from, for logging only


# ----------------------------------------------------------------------------------------------
# engines (rollout.EnginePool) and the clients of white-box agents


def _routed_prefix(b64: str, rows: int, keep: int) -> str:
    """The first `keep` of the `rows` token rows of an engine's base64 `routed_experts` (a stop string cut the
    turn short: the ids after the cut are dropped, so is their routing). Rows are equal-sized int32 blocks."""
    if not b64 or keep >= rows:
        return b64
    raw = base64.b64decode(b64)
    if rows <= 0 or len(raw) % rows:
        raise RuntimeError(f"routed_experts holds {len(raw)} bytes, not a whole number of rows for {rows} tokens; "
                           "the engine's answer does not follow SGLang's (tokens, layers, top_k) int32 layout")
    return base64.b64encode(raw[:len(raw) // rows * max(keep, 0)]).decode()


def sampling_seed(*key) -> int:
    """A sampling_seed (SGLang's per-request seed; the CPU engine's too) from any key, < 2**56. Seeding every
    request from what it is (run seed, group, sample, attempt, turn) rather than from its arrival makes a
    trajectory's tokens independent of timing and batch composition: sync and async runs, and a resumed run,
    draw the same random numbers for the same trajectory."""
    return int.from_bytes(hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=7).digest(), "big")


def sdk_httpx():
    """The httpx flavour the official OpenAI SDK builds its requests with (httpx, or its fork httpx2 in newer
    releases): a transport given to the SDK's client must come from this module."""
    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    return importlib.import_module(base.__module__.split(".")[0])


def openai_http_client():
    """The http client of every white-box agent's AsyncOpenAI client: the SDK's own aiohttp backend
    (`openai.DefaultAioHttpClient`), whose C HTTP parser costs the agent's event loop less per request than the default
    transport's pure-Python one (docs/BENCHMARKS.md). aiohttp sets TCP_NODELAY itself; `max_connections=0` is aiohttp's
    "no limit", each connection kept open for the next request until it has idled for the pool's expiry (5 s). The
    TLS context is given, though the router speaks plain HTTP: else the transport builds one, loading the CA store
    while the event loop waits (docs/BENCHMARKS.md)."""
    limits = sdk_httpx().Limits(max_connections=0, max_keepalive_connections=None)
    return openai.DefaultAioHttpClient(limits=limits, verify=ssl.create_default_context())


def _message_key(m: dict) -> tuple:
    """What must match for a message to count as 'the same' when checking that a history extends."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in m.get("tool_calls") or ())
    return m["role"], (m.get("content") or "").strip(), calls


# ----------------------------------------------------------------------------------------------
# sessions: token-in-token-out trajectory building


@dataclass
class Segment:
    """One contiguous context: a prompt and everything after it, token for token."""
    messages: list[dict]         # the chat so far, including the assistant turns this segment produced
    tools: list[dict] | None     # the tools the chat was rendered with (a change starts a new segment)
    text: str | None             # template rendering of `messages` (no generation prompt): the prefix check. None
    #                              until the next turn's plan() needs it: a session's last turn is never rendered
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    pending_close: list[int] = field(default_factory=list)  # ids that close the last assistant turn
    routed_experts: str = ""     # base64 routing of the segment's ids from position 0 (see Trajectory.routed_experts)
    kwargs: dict = field(default_factory=dict)  # the chat_template_kwargs it was rendered with (a change: new segment)
    thinking_shown: bool = True  # False once the template drops a turn's thinking from that very turn's rendering (it
    #                              never shows past thinking, e.g. DeepSeek-R1's): the next turn starts a new segment
    label: str = "main"          # its request's kind (config.SEGMENT_LABELS): a turn extends only one of its label

    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def as_dict(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids, "loss_mask": self.loss_mask,
                "rollout_logprobs": self.rollout_logprobs, "weight_versions": self.weight_versions,
                "routed_experts": self.routed_experts, "label": self.label}


@dataclass
class TurnPlan:
    """The input ids of the next engine call, not yet committed to the session."""
    segment: Segment | None       # the segment it extends, or None for a new one
    new_ids: list[int]            # ids appended to that segment (template + new messages, loss_mask 0)
    input_ids: list[int]          # the whole context sent to the engine
    messages: list[dict]          # the chat it renders: the segment's own record of its turns, then the new messages
    tools: list[dict] | None
    kwargs: dict                  # chat_template_kwargs
    label: str = "main"


class Session:
    """The state of one trajectory: its segments, its engine, its budgets, its status.

    The router holds one per session URL; the default single-turn path uses one without HTTP, so
    both build trajectories through the same TITO code.
    """

    def __init__(self, chat: chat.ChatFormat, *, sampling: dict, max_context_len: int, max_turns: int,
                 sample: dict | None = None, batch: str = "", constraint: dict | None = None,
                 train_labels: tuple = ("main",)):
        self.id = secrets.token_urlsafe(18)       # the unguessable part of the session URL
        self.api_key = "ls-" + secrets.token_urlsafe(18)
        self.chat, self.sampling, self.sample = chat, dict(sampling), sample or {}
        self.max_context_len, self.max_turns = max_context_len, max_turns
        self.segments: list[Segment] = []
        self.turns = 0
        self.status = "ok"                        # becomes truncated / failed / aborted
        self.engine: str | None = None            # sticky engine url
        self.closed = False
        self.lock = asyncio.Lock()                # one turn at a time per session
        self.inflight_rid: str | None = None
        self.last_text = ""                       # last assistant content, what the reward sees by default
        self.finish_reasons: list[str] = []
        self.responses: dict[str, list[dict]] = {}  # Responses API: id -> the conversation up to it
        self.generate_s = 0.0
        self.batch = batch                        # rollout.EnginePool batch key: the prompt group (see _coalesced)
        self.unknown_fields: set[str] = set()     # request fields no table of wire.py knows, accepted
        self.tool_parse_failures = 0              # turns that opened a tool call the parser could not read
        # a recipe's declared grammar (SGLang's regex / ebnf / json_schema) for the first turn offered tools: how a
        # model that cannot yet call a program's tools is made to (tests/test_real_agents.py); in the trajectory
        self.constraint, self.constrained_turns = dict(constraint or {}), []
        self.train_labels = tuple(train_labels)   # segments of other labels are kept with loss mask 0 (trajectory)

    def plan(self, messages: list[dict], tools: list[dict] | None, kwargs: dict | None = None,
             label: str = "main") -> TurnPlan:
        """The input ids for a turn: extend the last segment if the history extends it, else start a new one.

        The history extends when the messages continue the segment's (same roles, content and calls; thinking, which
        clients often drop when they echo a turn, is not compared) and the template renders the new chat as the old
        one plus more text. The model's own turns are then rendered from the segment's record, thinking included. A
        template that drops past thinking (Qwen3 at a new user query) renders the history differently: a new segment
        starts, and the earlier one keeps its sampled tokens (docs/AGENTFLOW.md, thinking models)."""
        kwargs = dict(kwargs or {})
        seg = next((g for g in reversed(self.segments) if g.label == label), None)
        if seg is not None and tools == seg.tools and kwargs == seg.kwargs and \
                len(messages) >= len(seg.messages) and \
                all(_message_key(a) == _message_key(b) for a, b in zip(seg.messages, messages)) and \
                self._render_text(seg).thinking_shown:
            messages = seg.messages + messages[len(seg.messages):]
            full = self.chat.render(messages, tools, add_generation_prompt=True, kwargs=kwargs)
            if full.startswith(seg.text):
                # Reuse the segment's ids verbatim; only the new messages and the template glue are tokenized.
                new_ids = seg.pending_close + self.chat.encode(full[len(seg.text):])
                return TurnPlan(seg, new_ids, seg.ids() + new_ids, messages, tools, kwargs, label)
        prompt = self.chat.prompt_ids(messages, tools, kwargs)
        return TurnPlan(None, prompt, prompt, messages, tools, kwargs, label)

    def commit(self, plan: TurnPlan, turn: Turn) -> None:
        """Append a generated turn (and the ids that led to it) to its segment."""
        seg = plan.segment
        if seg is None:
            seg = Segment(messages=[], tools=plan.tools, text="", prompt_ids=plan.new_ids, kwargs=plan.kwargs,
                          label=plan.label)
            self.segments.append(seg)
        else:
            n = len(plan.new_ids)
            seg.response_ids += plan.new_ids
            seg.loss_mask += [0] * n
            seg.rollout_logprobs += [0.0] * n
            seg.weight_versions += [-1] * n
        n = len(turn.output_ids)
        seg.response_ids += turn.output_ids
        seg.loss_mask += [1] * n
        seg.rollout_logprobs += turn.logprobs
        seg.weight_versions += turn.versions
        seg.pending_close = self.chat.close_turn_ids(turn.output_ids)
        if turn.routed_experts:  # the call ran on the whole segment from its prompt: its routing replaces the last
            seg.routed_experts = turn.routed_experts
        seg.messages = plan.messages + [{"role": "assistant", "content": turn.content,
                                         **({"reasoning_content": turn.reasoning} if turn.reasoning else {}),
                                         **({"tool_calls": turn.tool_calls} if turn.tool_calls else {})}]
        seg.text = None  # rendered by the next turn's plan(), if one comes (_render_text)
        self.turns += 1
        self.last_text = turn.content if plan.label == "main" else self.last_text
        self.finish_reasons.append(turn.finish_reason)

    def _render_text(self, seg: Segment) -> Segment:
        """Render the segment's chat (its `text`) and decide `thinking_shown`, once, when a turn extends it. Done
        here rather than at commit, so a session's last turn (every turn of a single-turn agent) is never rendered:
        a Jinja render of the whole chat, growing with it, most of a short turn's CPU."""
        if seg.text is None:
            seg.text = self.chat.render(seg.messages, seg.tools, kwargs=seg.kwargs)
            reasoning = seg.messages[-1].get("reasoning_content")
            if reasoning:  # does the template show the last turn's thinking (the tokens the model was trained on)?
                head = self.chat.render(seg.messages[:-1], seg.tools, kwargs=seg.kwargs)
                shown = seg.text[len(head):] if seg.text.startswith(head) else seg.text
                seg.thinking_shown = reasoning in shown
        return seg

    async def run_turn(self, pool: rollout.EnginePool, messages: list[dict], tools: list[dict] | None, *,
                       parse_tools: bool = True, max_tokens: int | None = None, overrides: dict | None = None,
                       stop: list[str] | None = None, template_kwargs: dict | None = None,
                       separate_reasoning: bool = True, on_tokens=None, label: str = "main") -> Turn:
        """Render, check the budgets, generate on an engine, parse thinking and tool calls, commit. Raises ApiError.
        `template_kwargs`: the request's chat_template_kwargs (e.g. enable_thinking). `on_tokens`: the engine streams,
        and `on_tokens(chunk)` gets each of its chunks (SGLang's, cumulative: output_ids, meta_info) while the turn
        generates; what is committed is the finished answer, exactly as without it."""
        if parse_tools and tools and not (self.chat.tool_parser or self.chat.user_parser):
            raise ApiError(400, "this request offers tools, but no tool-call parser is set for this model and its chat "
                           "template shows no tool-call format LoongSage knows; set cfg.tool_parser to one of "
                           f"{chat.TOOL_PARSERS} or a dotted path", param="tools")
        async with self.lock:
            if self.closed:
                raise ApiError(404, "this session is finished; its trajectory has been handed to the trainer",
                               code="session_closed")
            if self.turns >= self.max_turns:
                self.status = "truncated"
                raise ApiError(400, f"this session used its {self.max_turns} turns (cfg.max_turns); "
                               "end the episode", code="max_turns_exceeded")
            plan = self.plan(messages, tools, template_kwargs, label)
            room = self.max_context_len - len(plan.input_ids)
            if room <= 0:
                self.status = "truncated"
                raise ApiError(400, f"this request has {len(plan.input_ids)} tokens; the context limit is "
                               f"{self.max_context_len} (cfg.max_context_len). Shorten or compact the history.",
                               code="context_length_exceeded", param="messages")
            sp = {**self.sampling, **(overrides or {})}
            if sp.get("sampling_seed") is not None:  # one seed per trajectory -> one per turn
                sp["sampling_seed"] = sampling_seed(sp["sampling_seed"], self.turns)
            # The recipe's max_new_tokens caps every turn; a client's max_tokens may only lower it.
            sp["max_new_tokens"] = min(sp.get("max_new_tokens") or room, max_tokens or room, room)
            sp.update(stop_token_ids=self.chat.stop_ids, skip_special_tokens=False, no_stop_trim=True)
            if self.constraint and tools and not self.constrained_turns:
                sp = {k: v for k, v in sp.items() if k not in ("regex", "ebnf", "json_schema")} | self.constraint
                self.constrained_turns.append(self.turns)
            rid = f"{self.id[:8]}-{self.turns}-{uuid.uuid4().hex[:8]}"
            self.inflight_rid = rid
            t0 = time.perf_counter()
            try:
                url, out = await pool.generate(plan.input_ids, sp, rid, prefer=self.engine, batch=self.batch,
                                               on_chunk=on_tokens)
            finally:
                self.inflight_rid = None
                self.generate_s += time.perf_counter() - t0
            if self.closed:  # the trajectory ended (timeout/abort) while this turn was generating
                raise ApiError(404, "this session was closed while generating", code="session_closed")
            self.engine = url
            meta = out.get("meta_info", {})
            output_ids = list(out.get("output_ids", []))
            lps = meta.get("output_token_logprobs") or []
            if len(lps) != len(output_ids):
                raise RuntimeError(f"engine {url} returned {len(output_ids)} output ids but {len(lps)} logprobs; "
                                   "it must honour return_logprob=True")
            finish = (meta.get("finish_reason") or {}).get("type", "stop")
            if finish == "abort":
                self.status = "aborted"
                raise ApiError(503, "generation was aborted by the trainer (weight update or shutdown)", code="aborted")
            logprobs, versions = [float(lp[0]) for lp in lps], rollout.token_versions(meta, len(output_ids))
            if stop:
                output_ids, finish = self._cut_at_stop(output_ids, stop, finish)
                logprobs, versions = logprobs[:len(output_ids)], versions[:len(output_ids)]
            text, matched = self.chat.assistant_text(output_ids), None
            if stop and finish == "stop_string":  # the stop string itself is not part of the content
                matched = min((x for x in stop if x in text), key=text.find)
                text, finish = text[:text.find(matched)], "stop"
            reasoning, content, calls = self.chat.parse(text, tools, parse_tools, separate_reasoning)
            opens = chat.TOOL_CALL_STARTS.get(self.chat.tool_parser)
            if parse_tools and tools and not calls and opens and opens in text:
                # A malformed call (bad JSON, an unknown tool): it goes back as the text the model wrote, as the real
                # services answer, and the episode goes on; counted (agentflow/tool_parse_failures)
                self.tool_parse_failures += 1
                reasoning, content, _ = self.chat.parse(text, tools, False, separate_reasoning)
            routed = _routed_prefix(meta.get("routed_experts") or "", len(plan.input_ids) + len(lps) - 1,
                                    len(plan.input_ids) + len(output_ids) - 1)
            turn = Turn(output_ids, logprobs, versions, finish, content, calls, len(plan.input_ids), url, matched,
                        routed, reasoning=reasoning, reasoning_tokens=self.chat.reasoning_tokens(output_ids, reasoning))
            self.commit(plan, turn)
            if finish == "length" and len((plan.segment or self.segments[-1]).ids()) >= self.max_context_len:
                self.status = "truncated"
            return turn

    def _cut_at_stop(self, output_ids: list[int], stop: list[str], finish: str) -> tuple[list[int], str]:
        """Stop strings, applied here rather than in the engine (the CPU engine has none): keep the
        sampled ids up to the token that completes a stop string and drop the rest. The kept ids are
        a prefix of what the engine sampled, so ids and logprobs stay exact (TITO)."""
        if not any(x and x in self.chat.assistant_text(output_ids) for x in stop):
            return output_ids, finish
        for k in range(1, len(output_ids) + 1):
            text = self.chat.assistant_text(output_ids[:k])
            if any(x and x in text for x in stop):
                return output_ids[:k], "stop_string"
        return output_ids, finish

    def trajectory(self, reward: float, status: str | None = None) -> Trajectory:
        """The session as a Trajectory: the last segment of a trained label on top (and last in `segments`), the
        other segments before it in order; those of labels the recipe does not train with loss mask 0."""
        status = status or self.status
        trained = [g for g in self.segments if g.label in self.train_labels]
        segs = [g for g in self.segments if g is not trained[-1]] + trained[-1:] if trained else self.segments
        if not segs:  # nothing was generated: keep the prompt so the trainer has a valid row
            try:
                prompt = self.chat.prompt_ids(self.sample.get("messages") or [{"role": "user", "content": ""}])
            except Exception:
                prompt = [self.chat.eos_id]
        seg = segs[-1] if segs else Segment(messages=[], tools=None, text="", prompt_ids=prompt)
        dicts = [g.as_dict() if status != "failed" and g.label in self.train_labels else
                 {**g.as_dict(), "loss_mask": [0] * len(g.loss_mask)} for g in segs]
        mask = dicts[-1]["loss_mask"] if segs else []
        return Trajectory(
            prompt_ids=list(seg.prompt_ids), response_ids=list(seg.response_ids), loss_mask=list(mask),
            rollout_logprobs=list(seg.rollout_logprobs), weight_versions=list(seg.weight_versions),
            routed_experts=seg.routed_experts,
            segments=dicts, reward=float(reward) if status != "failed" else 0.0,
            status=status, prompt_text=self.chat.decode(seg.prompt_ids, skip_special_tokens=False),
            metadata={"turns": self.turns, "finish_reasons": self.finish_reasons, "engine": self.engine,
                      "num_segments": len(self.segments), "unknown_fields": sorted(self.unknown_fields),
                      "tool_parse_failures": self.tool_parse_failures, "constraint": self.constraint,
                      "constrained_turns": self.constrained_turns, "segment_labels": [g.label for g in segs]})


# ----------------------------------------------------------------------------------------------
# the router: one HTTP server, a session URL per trajectory


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _api_error(e: Exception) -> ApiError:
    """A failed request as its client sees it: an ApiError as raised, no engine a 503, a bug a 500."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, rollout.EngineUnavailable):
        return ApiError(503, str(e), code="engine_unavailable")
    if isinstance(e, rollout.EngineRejected):
        return ApiError(400, str(e), code="engine_rejected")
    log.error("router error", exc_info=e)  # a bug here must not take the router (and every session) down
    return ApiError(500, f"internal router error: {e!r}")


def _answering(error_body, handler):
    """The route of `handler(request)`: every error answered in its API's shape (`error_body(ApiError)`), unexpected
    ones as 500s, never a crash."""
    @functools.wraps(handler)
    async def route(request: Request):
        try:
            return await handler(request)
        except Exception as e:
            error = _api_error(e)
            return JSONResponse(error_body(error), status_code=error.status)
    return route


class Router:
    """Sessions + the Starlette app that serves them. Runs inside the caller's event loop (the AgentFlow actor)."""

    def __init__(self, pool: rollout.EnginePool, chat: chat.ChatFormat, *, model_name: str = "loongsage",
                 host: str = "127.0.0.1", strict_fields: bool = False):
        self.pool, self.chat, self.model_name, self.host = pool, chat, model_name, host
        self.strict_fields = strict_fields  # refuse every unknown request field (wire._check_fields)
        self.unknown_fields: collections.Counter = collections.Counter()  # requests that sent each unknown field
        self.tool_parse_failures = 0  # turns of closed sessions whose tool-call text did not parse (Session)
        self._later_system: bool | None = None  # does the template show a system message after the first (probed)
        self.sessions: dict[str, Session] = {}
        self.url: str | None = None
        self._server = None
        self._task: asyncio.Task | None = None

    # --- sessions

    def open_session(self, **session_args) -> Session:
        """A new Session (its keyword arguments), served at base_url(s) until close_session(s)."""
        s = Session(self.chat, **session_args)
        self.sessions[s.id] = s
        return s

    def base_url(self, s: Session) -> str:
        return f"{self.url}/s/{s.id}/v1"

    async def close_session(self, s: Session) -> None:
        """Finish a session: later requests get 404; a turn still generating is aborted on its engine."""
        s.closed = True
        if self.sessions.pop(s.id, None) is not None:
            self.tool_parse_failures += s.tool_parse_failures
        if s.inflight_rid:
            await self.pool.abort(s.inflight_rid)

    def _admit(self, s: Session, req, model=None) -> str:
        """What every request goes through after its API's parsing. Unknown fields (accepted: agent programs add
        fields with every release) are counted, warned about once per name and recorded in the session's trajectory
        (metadata.unknown_fields). A system or developer message after the first (Codex and Claude Code send them)
        stays a system message where the chat template shows one there (Qwen3's does); where the template would drop
        or refuse it, it goes in as a user message, the same way every turn, so the model sees it and the history
        keeps extending (one segment). Returns the request's segment label (config.SEGMENT_LABELS)."""
        for name in req.unknown:
            if not self.unknown_fields[name]:
                log.warning("accepting unknown request field %r (first seen; counted in agentflow/unknown_fields and "
                            "recorded in trajectories' metadata.unknown_fields)", name)
            self.unknown_fields[name] += 1
            s.unknown_fields.add(name)
        if self._later_system is None and any(m["role"] == "system" for m in req.messages[1:]):
            try:
                self._later_system = "\x1fprobe" in self.chat.render([{"role": "user", "content": "u"},
                                                                      {"role": "system", "content": "\x1fprobe"}])
            except Exception:  # a template that takes no system message there
                self._later_system = False
        if self._later_system is False:
            req.messages = [dict(m, role="user") if m["role"] == "system" and i else m
                            for i, m in enumerate(req.messages)]
        last_user = next((m.get("content") for m in reversed(req.messages) if m["role"] == "user"), "")
        return "side" if model == SIDE_MODEL else "compaction" if isinstance(last_user, str) and \
            last_user.lstrip().startswith(CODEX_COMPACTION) else "main"

    def _session(self, request: Request) -> Session:
        """The session a request's URL names, its api key checked."""
        s, headers = self.sessions.get(request.path_params["sid"]), request.headers
        if s is None:
            raise ApiError(404, "unknown or finished session; each trajectory has its own base URL "
                           "http://host:port/s/<session>/v1", code="session_not_found")
        key = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(key.encode(), s.api_key.encode()):
            raise ApiError(401, "wrong API key for this session; use the api_key handed out with the session URL",
                           code="invalid_api_key")
        return s

    def _turn_args(self, s: Session, req, body: dict, thinking_field: str) -> dict:
        """Session.run_turn's arguments for a checked request of any API: its label (_admit), the template variables
        its thinking field sets, the grammar of a forced or strict tool call. Structured output is checked against the
        template for the OpenAI APIs only (Messages' output_config.format is not)."""
        label = self._admit(s, req, body.get("model"))
        template_kwargs = self.chat.with_thinking(req, thinking_field, body.get(thinking_field))
        if thinking_field != "thinking":
            self.chat.check_structured(req, template_kwargs)
        return dict(parse_tools=req.parse_tools, max_tokens=req.max_tokens, stop=req.stop,
                    overrides={**req.overrides, **self.chat.tool_grammar(req, template_kwargs)},
                    template_kwargs=template_kwargs, separate_reasoning=req.separate_reasoning, label=label)

    # --- the app: one method per route, each answering errors in its API's shape (_answering)

    def app(self) -> Starlette:
        """The routes. Plain Starlette, not FastAPI: FastAPI's layers around the handlers cost ~0.1 ms of the ~0.9 ms
        a request spent outside the SDK and the engine (bench.py router)."""
        openai_route = functools.partial(_answering, openai_error_body)
        anthropic_route = functools.partial(_answering, anthropic_error_body)
        return Starlette(routes=[
            Route("/s/{sid}/v1/chat/completions", openai_route(self.chat_completions), methods=["POST"]),
            Route("/s/{sid}/v1/messages", anthropic_route(self.messages), methods=["POST"]),
            Route("/s/{sid}/v1/responses", openai_route(self.responses), methods=["POST"]),
            Route("/s/{sid}/v1/messages/count_tokens", anthropic_route(self.count_tokens), methods=["POST"]),
            Route("/s/{sid}/v1/models", openai_route(self.models), methods=["GET"]),
            Route("/s/{sid}/v1/models/{model:path}", openai_route(self.models), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            # any other path, any method: a 404 in OpenAI's shape naming the session URL (a client pointed at the
            # router's root POSTs /v1/chat/completions; the real service answers an unknown URL with a JSON 404)
            Route("/{path:path}", openai_route(self.unscoped),
                  methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]),
        ])

    async def chat_completions(self, request: Request):
        s, body = self._session(request), await _json_body(request)
        req = openai_request(body, self.strict_fields)
        kw = self._turn_args(s, req, body, "reasoning_effort")
        if req.stream:
            return await self._streamed(s, req, kw, lambda parts: openai_stream(
                self.chat, parts, self.model_name, req.logprobs, req.include_usage))
        turn = await s.run_turn(self.pool, req.messages, req.tools, **kw)
        return JSONResponse(openai_response(self.chat, turn, self.model_name, req.logprobs))

    async def messages(self, request: Request):
        s, body = self._session(request), await _json_body(request)
        req = anthropic_request(body, self.strict_fields, self.model_name)
        kw = self._turn_args(s, req, body, "thinking")
        if req.stream:
            return await self._streamed(s, req, kw, lambda parts: anthropic_stream(parts, self.model_name))
        turn = await s.run_turn(self.pool, req.messages, req.tools, **kw)
        return JSONResponse(anthropic_response(turn, self.model_name))

    async def responses(self, request: Request):
        s, body = self._session(request), await _json_body(request)
        req = responses_request(body, s.responses, self.strict_fields)
        kw = self._turn_args(s, req, body, "reasoning")
        rid = "resp_" + uuid.uuid4().hex
        logprobs_of = functools.partial(responses_logprobs, self.chat) if req.logprobs else None

        def remember(turn: Turn) -> None:  # the conversation so far, for a later previous_response_id
            s.responses[rid] = next(g for g in reversed(s.segments) if g.label == kw["label"]).messages
        if req.stream:
            return await self._streamed(s, req, kw, lambda parts: responses_stream(
                parts, self.model_name, rid, body, req.custom_tools, logprobs_of), after=remember)
        turn = await s.run_turn(self.pool, req.messages, req.tools, **kw)
        remember(turn)
        output = responses_output(turn, req.custom_tools, logprobs_of(turn) if logprobs_of else None)
        return JSONResponse(responses_response(turn, self.model_name, rid, body, output))

    async def count_tokens(self, request: Request):
        """Messages count_tokens (Claude Code asks it): the prompt's length as the template renders it; no turn. The
        prompt is recorded as a segment of its own, labelled count_tokens (nothing generated: nothing to train)."""
        s, body = self._session(request), await _json_body(request)
        req = anthropic_request({**body, "max_tokens": 1}, self.strict_fields, self.model_name)
        self._admit(s, req)
        kwargs = {**self.chat.template_kwargs, **self.chat.with_thinking(req, "thinking", body.get("thinking"))}
        ids = self.chat.prompt_ids(req.messages, req.tools, kwargs)
        s.segments.append(Segment(req.messages, req.tools, "", ids, kwargs=kwargs, label="count_tokens"))
        return JSONResponse({"input_tokens": len(ids)})

    async def models(self, request: Request):
        """The one model served, in the shape of the API asking: Anthropic's (its clients send anthropic-version)
        or OpenAI's; /models/{id} the model itself."""
        self._session(request)
        anthropic = "anthropic-version" in request.headers
        model = {"type": "model", "id": self.model_name, "display_name": self.model_name,
                 "created_at": "1970-01-01T00:00:00Z"} if anthropic else \
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "loongsage"}
        if "model" in request.path_params:
            if request.path_params["model"] != self.model_name:
                raise ApiError(404, f"model {request.path_params['model']!r} is not served here; the one model "
                               f"is {self.model_name!r}", code="model_not_found")
            return JSONResponse(model)
        return JSONResponse({"data": [model], "has_more": False, "first_id": self.model_name,
                             "last_id": self.model_name} if anthropic else {"object": "list", "data": [model]})

    async def health(self, request: Request):
        return JSONResponse({"status": "ok", "sessions": len(self.sessions), "engines_up": len(self.pool.healthy())})

    async def unscoped(self, request: Request):
        raise ApiError(404, f"no such endpoint {request.url.path}; use the session base URL "
                       "http://host:port/s/<session>/v1 handed out with each trajectory", code="not_found")

    async def _streamed(self, s: Session, req, kw: dict, render, after=None) -> StreamingResponse:
        """Run a turn with the engine streaming and answer with the Server-Sent Events `render(parts)` (wire.py's
        *_stream) as it generates: parts are ("start", prompt tokens), the reasoning and content deltas as they
        settle (TurnStream), then ("turn", Turn), after `after(turn)`. The answer starts at the engine's first
        chunk (or the turn's end, if that comes first), so a request refused before any token (bad input, a
        budget, the engine's own 400) still gets its plain error answer and status; a failure after that is the
        stream's error event. A client that leaves does not stop the turn: it is committed as a plain one is."""
        live = chat.TurnStream(self.chat, req.tools, kw["parse_tools"], kw["separate_reasoning"], kw["stop"])
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(s.run_turn(self.pool, req.messages, req.tools, **kw,
                                                on_tokens=lambda chunk: queue.put_nowait(("chunk", chunk))))
        # the end, and the turn's error marked as seen: a client that left never reads it
        task.add_done_callback(lambda t: (t.cancelled() or t.exception(), queue.put_nowait(("end", None))))
        first = await queue.get()
        if first[0] == "end":
            task.result()  # a turn that failed before any token: its plain error answer

        async def parts():
            kind, value = first
            yield "start", value["meta_info"]["prompt_tokens"] if kind == "chunk" else task.result().prompt_tokens
            while kind == "chunk":
                for part in live.update(value["output_ids"]):
                    yield part
                kind, value = await queue.get()
                while kind == "chunk" and not queue.empty():  # chunks are cumulative: the newest is enough
                    kind, value = queue.get_nowait()
            try:
                turn = task.result()
            except Exception as e:
                raise _api_error(e) from None
            if after is not None:
                after(turn)
            for part in live.finish(turn):
                yield part
            yield "turn", turn
        return StreamingResponse(render(parts()), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def start(self, port: int = 0) -> str:
        """Serve the app on host:port (0 = any free port) as a task of the running loop; returns the URL."""
        # proxy_headers off: agents call it directly, never through a proxy whose headers would name the client.
        # An idle connection stays open 75 s, longer than any client's pool keeps one (httpx and the SDKs' aiohttp
        # 5 s, Node 4 s): at uvicorn's default 5 s, a request sent as the server closed it failed "Request timed out"
        config = uvicorn.Config(self.app(), host=self.host, port=port, log_level="warning", lifespan="off",
                                access_log=False, proxy_headers=False, timeout_keep_alive=75)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # TCP_NODELAY, inherited by accepted connections: an answer's headers and body go out as two writes, and
        # with Nagle the body would wait for the client's delayed ACK (~40 ms on every agent call)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, port))
        self._server = uvicorn.Server(config)
        # The loop belongs to the actor/test, not to uvicorn: leave its signal handlers alone.
        self._server.capture_signals = contextlib.nullcontext
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # e.g. the port is taken: surface uvicorn's error
                self._task.result()
                raise RuntimeError(f"router failed to start on {self.host}:{port}")
            await asyncio.sleep(0.01)
        bound = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task
            self._server = None


_CODE_BLOCK_RE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


async def code_tests(response: str, sample: dict) -> float:
    """Reward: 1.0 when the response's last ```python block passes `sample["tests"]` in a sandbox.

    `sample["tests"]` is Python source that imports from `solution` (or asserts on names defined in
    it) and exits non-zero on failure. Limits: `sample["timeout"]` seconds (default 10). Runs in Docker
    where an engine answers, else locally.
    """
    blocks = _CODE_BLOCK_RE.findall(response)
    code = blocks[-1] if blocks else response
    box = await sandbox.make_sandbox("auto", cpu_s=int(sample.get("timeout", 10)) + 1, network=False).create()
    try:
        box.write("solution.py", code)
        test = box.write("test_solution.py", "from solution import *\n" + str(sample["tests"]))
        r = await box.execute(f"python {test}", timeout_s=float(sample.get("timeout", 10)))
        return float(r.exit_code == 0 and not r.timed_out)
    finally:
        await box.delete()


# ----------------------------------------------------------------------------------------------
# AgentFlow: the actor the controller calls


def _scalar_reward(value, source: str) -> tuple[float | None, str | None]:
    """(reward, None) for a finite number, else (None, error). A NaN or inf reward would turn every
    advantage of its group (and the loss) into NaN; per-turn rewards travel separately (an agent's
    {"turn_rewards": [...]}), so a list here is a mistake."""
    if isinstance(value, (list, tuple)):
        return None, (f"{source} returned a sequence {value!r:.200}; return one number per trajectory (an agent "
                      "reports per-turn rewards as {'turn_rewards': [...]} in its returned dict)")
    try:
        if value is None or isinstance(value, (str, bytes, dict)):
            raise TypeError
        value = float(value)  # bools, numpy and 0-d torch numbers convert
    except (TypeError, ValueError):
        return None, f"{source} returned {value!r:.200} ({type(value).__name__}); it must return a number"
    if not math.isfinite(value):
        return None, f"{source} returned {value}; rewards must be finite numbers"
    return value, None


class AgentFlow:
    """Turns prompts into rewarded trajectory groups. The controller wraps it with `ray.remote` as an
    async actor; every method runs on that actor's event loop, as does the router it starts."""

    def __init__(self, cfg, engine_urls: list, tokenizer_path: str, judge_url=None):
        """`engine_urls`: the engines' URLs, or (the controller) Ray refs of them, so this actor starts while the
        engines are still loading. `judge_url`: the judge engine's URL (or a Ray ref of it) for `reward: judge`,
        unless cfg.judge names a `url` of its own."""
        self.cfg = cfg
        judge_url = cfg.judge.get("url") or judge_url
        if not all(isinstance(u, str) for u in engine_urls) or not isinstance(judge_url, (str, type(None))):
            import ray  # late: AgentFlow also runs without Ray
            if not all(isinstance(u, str) for u in engine_urls):
                engine_urls = ray.get(engine_urls, timeout=cfg.actor_timeout)
            if not isinstance(judge_url, (str, type(None))):
                judge_url = ray.get(judge_url, timeout=cfg.actor_timeout)
        # the cfg's dotted paths (a template string, a tool parser function) resolved here: chat.py imports nothing
        self.chat = chat.ChatFormat(tokenizer_path, data.import_object(cfg.chat_template) if cfg.chat_template else "",
                                    data.import_object(cfg.tool_parser) if data.is_dotted(cfg.tool_parser)
                                    else cfg.tool_parser, cfg.reasoning_parser, cfg.chat_template_kwargs)
        self.pool = rollout.EnginePool(engine_urls, health_timeout_s=cfg.engine_health_timeout,
                                       check_every_s=cfg.engine_check_every, wait_s=cfg.engine_wait,
                                       return_routed_experts=bool(cfg.router_replay))
        # reward None: `reward: judge`, the judge model scores each group once it is complete (_judge)
        self.reward_fn = None if cfg.reward == "judge" else data.import_object(cfg.reward)
        self.agent_fn = data.import_object(cfg.agent) if cfg.agent else None
        # data_sources: a source's own reward / agent, looked up by sample["source"]; else the ones above
        # the dotted names, for error messages: a failed trajectory names the reward / agent that failed it
        self._reward_name = {s["name"]: s["reward"] for s in cfg.data_sources if s.get("reward")}
        self._agent_name = {s["name"]: s["agent"] for s in cfg.data_sources if s.get("agent")}
        self.source_reward = {k: None if v == "judge" else data.import_object(v) for k, v in self._reward_name.items()}
        self.source_agent = {k: data.import_object(v) for k, v in self._agent_name.items()}
        for name, fn in [(cfg.agent, self.agent_fn), *((self._agent_name[k], f) for k, f in self.source_agent.items())]:
            if fn is not None and not callable(fn):
                raise ValueError(f"agent {name!r} is not callable; it must be `async def agent(client, sample)`")
        if cfg.agent_command:
            sandbox.make_sandbox(cfg.sandbox)  # fail now, not at the first trajectory, on a bad/unavailable sandbox
        # agent_preload: Python agent commands fork from one warm interpreter (started at the first trajectory)
        self._warm = sandbox.WarmPython(cfg.agent_preload) if cfg.agent_command and cfg.agent_preload else None
        # Loopback by default: agents run on this node. Set cfg.router_host to serve sandboxes elsewhere.
        self.router = Router(self.pool, self.chat, model_name=Path(tokenizer_path).name or "loongsage",
                             host=cfg.router_host, strict_fields=cfg.strict_fields)
        # The white-box agents' clients share one connection pool to the router: a trajectory's first call takes a
        # kept-alive connection instead of opening one (docs/BENCHMARKS.md)
        self._sdk_http = None
        self._next_group = 0                # generate()'s group ids (eval): unique across its calls
        self._tasks: set[asyncio.Task] = set()
        self._completed: list[dict] = []    # submit()'s groups that finished since the last completed() call
        self._producing = 0                 # submit()'s groups still running
        self._wake = asyncio.Event()        # set when a submitted group finishes
        # Black-box agents are processes: bound how many run at once (white-box ones are coroutines).
        self._sandbox_slots = asyncio.Semaphore(cfg.max_parallel_sandboxes)
        self.judge_url = None
        if self.reward_fn is None or None in self.source_reward.values():
            if not judge_url:
                raise ValueError("reward: judge, but no judge to ask: set judge.url, or let the controller start the "
                                 "judge engine from judge.model_path (fleet.start_judge)")
            self.judge_url = judge_url.rstrip("/")
            self.judge_chat = chat.ChatFormat(cfg.judge["model_path"])  # the judge's own tokenizer and chat template
            self.judge_parse = data.judge_parser(cfg.judge["parse"])
            self._judge_http = httpx.AsyncClient(transport=rollout.nodelay_transport())
        # A full garbage collection walks every object the process tracks (~475k once torch and the tokenizer are
        # loaded: ~220 ms of CPU, with the router and every agent on this loop waiting). What start-up made lives as
        # long as the process: moved out of the collector's sight, once.
        if gc.get_freeze_count() == 0:
            gc.collect()
            gc.freeze()
            atexit.register(gc.unfreeze)  # at exit the objects are collected as usual (nanobind reports leaks else)

    async def start_router(self) -> str:
        """Start the router (once) and return its URL. generate() calls it when an agent is configured."""
        if self.router.url is None:
            await self.router.start()
        return self.router.url

    async def submit(self, groups: list[tuple[int, dict]], n: int, sampling: dict, step: int) -> None:
        """The rollout producer's dispatch: start n trajectories for each (seq, sample) and return at once.
        `seq` (the controller's sequence number) is the group id; `step` the RL step dispatching it (kept in
        each trajectory's metadata). Each group reaches `completed()` the moment its n trajectories are done,
        in whatever order groups finish."""
        if self.agent_fn is not None or self.cfg.agent_command or self.source_agent:
            await self.start_router()
        for seq, sample in groups:
            task = asyncio.ensure_future(self._group(sample, seq, n, sampling, step))
            self._tasks.add(task)
            task.add_done_callback(self._group_done)
            self._producing += 1

    def _group_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._producing -= 1
        if not task.cancelled():  # a cancelled group (abort at shutdown) is nobody's any more
            self._completed.append(task)
        self._wake.set()

    async def completed(self, wait: bool = True) -> list[dict]:
        """Groups finished since the last call, as {"seq", "trajs", "aborted"}; with `wait`, block until there
        is at least one (or nothing is running). An aborted group (an engine cut it) is returned without its
        trajectories so the controller can dispatch its prompt again."""
        while wait and not self._completed and self._producing:
            self._wake.clear()
            await self._wake.wait()
        done, self._completed = self._completed, []
        return [task.result() for task in done]  # a bug inside _group raises here, in the controller's ray.get

    async def _group(self, sample: dict, seq: int, n: int, sampling: dict, step: int) -> dict:
        results = await asyncio.gather(*(self._trajectory(sample, seq, i, sampling, step) for i in range(n)),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        if errors:  # _trajectory turns agent/engine errors into failed trajectories: this is a bug
            raise errors[0]
        aborted = any(isinstance(r, BaseException) or r.status == "aborted" for r in results)
        if not aborted and self.judge_url is not None:
            await self._judge(results, sample)
        # an aborted group is incomplete: group-relative advantages over it would be biased
        # vars(), not dataclasses.asdict, which deep-copies every token list (the largest per-trajectory cost of a
        # step); the lists are already this trajectory's own (Session.trajectory copies them)
        return {"seq": seq, "aborted": aborted, "trajs": [] if aborted else [dict(vars(r)) for r in results]}

    async def generate(self, samples: list[dict], n: int, sampling: dict, step: int) -> list[dict]:
        """n trajectories per sample, rewarded, as dicts of the Trajectory fields, complete groups only (eval).

        `sampling`: temperature, top_p, top_k, max_new_tokens. Failed trajectories stay in their group
        (status "failed", reward 0, loss_mask all 0) so the step goes on; groups cut by abort() are dropped.
        """
        if self.agent_fn is not None or self.cfg.agent_command or self.source_agent:
            await self.start_router()
        base = self._next_group
        self._next_group += len(samples)
        tasks = [asyncio.ensure_future(self._group(sample, base + g, n, sampling, step))
                 for g, sample in enumerate(samples)]
        self._tasks.update(tasks)
        try:
            groups = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._tasks.difference_update(tasks)
        for g in groups:  # a group cancelled by abort() is dropped; anything else raised is a bug
            if isinstance(g, BaseException) and not isinstance(g, asyncio.CancelledError):
                raise g
        return [t for g in groups if isinstance(g, dict) for t in g["trajs"]]

    # --- engine health (the controller asks; rollout.EnginePool does the work)

    async def check_engines(self) -> list[str]:
        """Probe every engine now; the URLs of those out of routing (dead or hung), for the controller to re-create."""
        return await self.pool.check()

    def replace_engine(self, old_url: str, new_url: str) -> None:
        """The controller re-created the engine at old_url as new_url, on the current weights: route to it."""
        self.pool.replace(old_url, new_url)

    async def use_adapter(self, name: str, version: int) -> None:
        """LoRA: after a weight sync, new requests generate with adapter `name`, weight version `version` (async: the
        pool unloads the adapter it replaces from this actor's event loop)."""
        self.pool.use_adapter(name, version)

    def engine_metrics(self) -> dict:
        return {"engines/healthy": len(self.pool.healthy()), "rollout/retried": self.pool.retried,
                "agentflow/unknown_fields": sum(self.router.unknown_fields.values()),
                "agentflow/tool_parse_failures": self.router.tool_parse_failures,
                "memory/router_mb": rollout.transfermesh.rss_bytes() / 2**20}  # this process: AgentFlow and its router

    async def abort(self) -> None:
        """Stop every running trajectory now (weight update with abort, or shutdown); their groups are dropped."""
        for t in list(self._tasks):
            t.cancel()
        await self.pool.abort()

    def session_client(self, s: "Session", timeout: float | None = None) -> openai.AsyncOpenAI:
        """An official AsyncOpenAI client bound to session `s`, on the flow's one connection pool (not closed with
        the client: `close()` closes the pool)."""
        if self._sdk_http is None:
            self._sdk_http = openai_http_client()
        return openai.AsyncOpenAI(base_url=self.router.base_url(s), api_key=s.api_key, max_retries=0,
                                  timeout=timeout, http_client=self._sdk_http)

    async def close(self) -> None:
        await self.abort()
        await self.router.stop()
        await self.pool.close()
        if self._sdk_http is not None:
            await self._sdk_http.aclose()
            self._sdk_http = None
        if self._warm is not None:
            await self._warm.close()
        if self.judge_url is not None:
            await self._judge_http.aclose()

    # --- one trajectory, with retries

    async def _trajectory(self, sample: dict, group_id: int, index: int, sampling: dict, step: int) -> Trajectory:
        t0 = time.perf_counter()
        attempts = 1 + max(0, int(self.cfg.agent_retries))
        for attempt in range(1, attempts + 1):
            sampling = {**sampling, "sampling_seed": sampling_seed(self.cfg.seed, group_id, index, attempt)}
            if self.cfg.agent_command:
                traj = await self._blackbox(sample, sampling, group_id)
            elif self.agent_fn is not None or sample.get("source") in self.source_agent:
                traj = await self._whitebox(sample, sampling, group_id)
            else:
                traj = await self._single_turn(sample, sampling, group_id)
            if traj.status != "failed":
                break
            log.warning("trajectory of group %d sample %d failed (attempt %d/%d): %s", group_id, index, attempt,
                        attempts, traj.metadata.get("error"))
        traj.group_id, traj.sample_index = group_id, index
        traj.metadata.update(step=step, attempts=attempt)
        if "source" in sample or "teacher" in sample:  # data_sources / teacher routing read these (teacher.py)
            traj.metadata.update(source=sample.get("source"), teacher=sample.get("teacher"))
        traj.timings["total_s"] = time.perf_counter() - t0
        return traj

    def _session_args(self, sampling: dict, sample: dict, max_turns: int, group_id: int) -> dict:
        # async: one engine batch per group, so groups come back one by one (rollout.EnginePool._coalesced). Sync keeps
        # one batch per loop tick: the engine then admits a step's rows together, whatever the HTTP timing, and
        # its batch composition (which can move a logit's last bits) is the same in every run: bit for bit
        streaming = self.cfg.mode == "async" and self.cfg.stale_steps > 0
        return dict(sampling=sampling, max_context_len=self.cfg.max_context_len, max_turns=max_turns, sample=sample,
                    batch=str(group_id) if streaming else "", constraint=self.cfg.first_turn_constraint,
                    train_labels=tuple(self.cfg.train_labels))

    async def _finish(self, s: Session, sample: dict, *, status: str | None = None, error: str | None = None,
                      reward: float | None = None, response_text: str | None = None) -> Trajectory:
        """Reward (unless given or failed) and package a session as a Trajectory."""
        status = status or s.status
        if not s.segments and status != "aborted":
            status = "failed"  # nothing was generated: nothing to train on
            error = error or "the agent finished without calling the model"
        text = s.last_text if response_text is None else response_text
        t0, fn = time.perf_counter(), self.source_reward.get(sample.get("source"), self.reward_fn)
        rewarding = status not in ("failed", "aborted") and reward is None
        judged = rewarding and fn is None  # reward: judge; _group asks the judge for the whole group at once
        if rewarding and fn is not None:
            name = self._reward_name.get(sample.get("source"), self.cfg.reward)
            try:
                value = fn(text, sample)  # a reward may be sync or async
                reward, bad = _scalar_reward(await value if inspect.isawaitable(value) else value, f"reward {name}")
            except Exception as e:  # a reward bug must show, but not kill the whole step
                log.exception("reward %s failed", name)
                reward, bad = None, f"reward {name} raised {e!r}"
            if bad:
                status, error = "failed", bad
        traj = s.trajectory(reward or 0.0, status)
        traj.response_text = text
        traj.timings.update(generate_s=s.generate_s, reward_s=time.perf_counter() - t0)
        if error:
            traj.metadata["error"] = error
        if judged:
            traj.metadata["judge_pending"] = True
        return traj

    async def _judge(self, trajs: list[Trajectory], sample: dict) -> None:
        """`reward: judge`: the judge model scores a complete group in ONE batched /generate (greedy, the prompt
        `judge.prompt_template` rendered with the judge's chat template), and each parsed verdict becomes that
        trajectory's reward (the verdict text is kept in metadata.judge_verdict). A judge that does not answer
        within judge.timeout, answers with an error, or writes a verdict judge.parse cannot read, fails those
        trajectories only (status "failed", the reason in metadata.error): the step goes on without them."""
        todo = [t for t in trajs if t.metadata.pop("judge_pending", False)]
        if not todo:
            return
        j, t0 = self.cfg.judge, time.perf_counter()
        ids = [self.judge_chat.prompt_ids([{"role": "user", "content": data.judge_prompt(
            j["prompt_template"], sample, t.response_text)}]) for t in todo]
        rids = [f"judge-{uuid.uuid4().hex}" for _ in todo]
        answers, error = None, None
        try:
            answers = await rollout.generate(self._judge_http, self.judge_url, ids,
                                             {"temperature": 0.0, "max_new_tokens": j["max_new_tokens"]},
                                             rid=rids, return_logprob=False, timeout=j["timeout"])
        except httpx.TimeoutException:
            error = (f"the judge at {self.judge_url} did not answer within judge.timeout={j['timeout']:g}s, so this "
                     "trajectory has no reward; raise judge.timeout or give the judge more capacity")
            with contextlib.suppress(httpx.HTTPError):  # stop the judge computing what nobody will read
                await asyncio.gather(*(self._judge_http.post(f"{self.judge_url}/abort_request", json={"rid": r},
                                                             timeout=min(5.0, j["timeout"])) for r in rids))
        except (httpx.HTTPError, rollout.EngineError) as e:
            error = f"the judge at {self.judge_url} failed: {e}"
        for k, t in enumerate(todo):
            reward, bad = None, error
            if answers is not None:
                t.metadata["judge_verdict"] = answers[k]["text"]
                try:
                    reward, bad = _scalar_reward(self.judge_parse(answers[k]["text"]), f"judge.parse {j['parse']!r}")
                except Exception as e:  # a verdict the parser cannot read fails this trajectory, as a reward bug would
                    bad = f"judge.parse {j['parse']!r} failed: {type(e).__name__}: {e}"
            if bad:  # as Session.trajectory makes a failed one: reward 0, nothing trained
                t.status, t.reward, t.turn_rewards, t.metadata["error"] = "failed", 0.0, [], bad
                t.loss_mask = [0] * len(t.loss_mask)
                t.segments = [{**seg, "loss_mask": [0] * len(seg["loss_mask"])} for seg in t.segments]
            else:
                t.reward = reward
            t.timings["reward_s"] = t.timings.get("reward_s", 0.0) + time.perf_counter() - t0

    # --- the three ways a trajectory is made

    async def _single_turn(self, sample: dict, sampling: dict, group_id: int) -> Trajectory:
        """Fast path: the sample's messages, rendered once, straight to an engine (no router)."""
        s = Session(self.chat, **self._session_args(sampling, sample, 1, group_id))
        try:
            messages, tools = openai_messages(sample.get("messages")), openai_tools(sample.get("tools"))
            plan = s.plan(messages, tools)
            if len(plan.input_ids) > self.cfg.max_prompt_len:
                return await self._finish(s, sample, status="failed", error=(
                    f"prompt has {len(plan.input_ids)} tokens > max_prompt_len={self.cfg.max_prompt_len}; "
                    "filter the dataset or raise max_prompt_len"))
            turn = await s.run_turn(self.pool, messages, tools)
        except Exception as e:  # a bad sample (no messages, a template error) or engine error fails this one only
            return await self._finish(s, sample, status="failed" if s.status == "ok" else s.status,
                                      error=getattr(e, "message", None) or repr(e))
        status = "truncated" if turn.finish_reason == "length" else "ok"
        return await self._finish(s, sample, status=status, response_text=turn.content)  # thinking apart

    async def _whitebox(self, sample: dict, sampling: dict, group_id: int) -> Trajectory:
        """`await agent(client, sample)` with an official AsyncOpenAI client bound to a fresh session."""
        s = self.router.open_session(**self._session_args(sampling, sample, self.cfg.max_turns, group_id))
        client = self.session_client(s, timeout=self.cfg.agent_timeout)
        result, status, error = None, None, None
        name = self._agent_name.get(sample.get("source"), self.cfg.agent)  # a data source's own agent, or cfg.agent
        try:
            agent_fn = self.source_agent.get(sample.get("source"), self.agent_fn)
            result = await asyncio.wait_for(agent_fn(client, sample), self.cfg.agent_timeout)
        except asyncio.TimeoutError:
            status, error = "truncated", f"agent timed out after {self.cfg.agent_timeout}s (cfg.agent_timeout)"
        except Exception as e:
            # An agent that stops because the router refused a budget (context/turns) is truncated, not
            # failed: what it generated is kept and rewarded. Anything else is a crash.
            if s.status in ("truncated", "aborted"):
                status = s.status
            else:
                status, error = "failed", f"agent {name} raised {e!r}"
        finally:
            await self.router.close_session(s)  # the client holds nothing of its own: the pool is the flow's
        reward = None
        if status is None and not (result is None or isinstance(result, (str, dict))):
            status, error = "failed", (f"agent {name} returned {type(result).__name__} {result!r:.200}; "
                                       "return the final text (str), a dict (optionally with 'reward'), or None")
        elif status is None and isinstance(result, dict) and result.get("reward") is not None:
            reward, error = _scalar_reward(result["reward"], f"agent {name}'s 'reward'")
            status = "failed" if error else None
        turn_rewards = result.get("turn_rewards") if isinstance(result, dict) and status is None else None
        if turn_rewards is not None:  # one finite number per model turn, or the trajectory fails
            checked = [_scalar_reward(r, f"agent {name}'s turn_rewards[{i}]")
                       for i, r in enumerate(turn_rewards if isinstance(turn_rewards, list) else [turn_rewards])]
            error = next((e for _, e in checked if e), None) or (
                None if isinstance(turn_rewards, list) else f"agent {name}'s turn_rewards must be a list")
            status = "failed" if error else None
        traj = await self._finish(s, sample, status=status, error=error, reward=reward)
        if turn_rewards and traj.status != "failed":
            traj.turn_rewards = [r for r, _ in checked]
        if isinstance(result, (str, dict)):
            traj.metadata["agent_result"] = result if isinstance(result, dict) else result[:2000]
        return traj

    async def _blackbox(self, sample: dict, sampling: dict, group_id: int) -> Trajectory:
        """Run `cfg.agent_command` in a sandbox pointed at a fresh session; its stdout is its answer."""
        async with self._sandbox_slots:
            s = self.router.open_session(**self._session_args(sampling, sample, self.cfg.max_turns, group_id))
            box = sandbox.make_sandbox(self.cfg.sandbox)
            status, error, answer = None, None, None
            try:
                await box.create()
                task = data.task_text(sample)
                env = {"OPENAI_BASE_URL": self.router.base_url(s), "OPENAI_API_KEY": s.api_key,
                       "OPENAI_MODEL": self.router.model_name, "LOONGSAGE_TASK": task,
                       # the Anthropic SDK appends /v1/messages to its base URL itself
                       "ANTHROPIC_BASE_URL": f"{self.router.url}/s/{s.id}", "ANTHROPIC_API_KEY": s.api_key,
                       # a file, not a variable: samples (tests, repos) can exceed the environment's size limit
                       "LOONGSAGE_SAMPLE_FILE": box.write("sample.json", json.dumps(sample, default=str))}
                run = box.execute if self._warm is None else functools.partial(box.execute_warm, self._warm)
                r = await run(self.cfg.agent_command, stdin=task, env=env, timeout_s=self.cfg.agent_timeout)
                answer = r.stdout.strip()
                if r.timed_out:
                    status, error = "truncated", f"agent command timed out after {self.cfg.agent_timeout}s"
                elif r.exit_code != 0 and s.status == "ok":
                    status, error = "failed", f"agent command exited {r.exit_code}: {r.stderr.strip()[-1000:]}"
            except Exception as e:  # sandbox start/exec trouble fails this trajectory, not the step
                status, error = "failed", f"sandbox error: {e!r}"
            finally:
                await self.router.close_session(s)
                await box.delete()
            return await self._finish(s, sample, status=status, error=error, response_text=answer or s.last_text)


# ----------------------------------------------------------------------------------------------
# debug seam: a standalone router to point any agent at by hand


def main(argv=None) -> None:
    """`python agentflow.py --engine URL [--engine URL2] --tokenizer DIR [--port 8000]`: serve the router
    over running engines and print one session's OpenAI/Anthropic settings; Ctrl-C (or SIGTERM) prints
    the session's trajectory and exits."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--engine", action="append", required=True, help="rollout engine URL (repeatable)")
    p.add_argument("--tokenizer", required=True, help="HF model/tokenizer dir with the chat template")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-context-len", type=int, default=4096)
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args(argv)

    async def serve():
        router = Router(rollout.EnginePool(args.engine), chat.ChatFormat(args.tokenizer),
                        model_name=Path(args.tokenizer).name)
        await router.start(args.port)
        s = router.open_session(sampling={"temperature": 1.0, "max_new_tokens": args.max_new_tokens},
                                max_context_len=args.max_context_len, max_turns=10 ** 6)
        print(f"OPENAI_BASE_URL={router.base_url(s)} OPENAI_API_KEY={s.api_key}\n"
              f"ANTHROPIC_BASE_URL={router.url}/s/{s.id} ANTHROPIC_API_KEY={s.api_key}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        t = s.trajectory(0.0)
        print(json.dumps({k: v for k, v in vars(t).items() if k != "segments"})[:4000], flush=True)
        await router.stop()
        await router.pool.close()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
