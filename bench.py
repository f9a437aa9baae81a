"""LoongSage benchmarks: each prints a ratio against a baseline measured in the same run.

Speed targets live here, never in timed tests, because the machines these run on are shared and noisy: a ratio
measured back to back in one run is far steadier than an absolute number.

    python bench.py rollout [--batch 64 --new-tokens 64 --prompt-len 32 --repeats 3]
        CPU engine (cpu_engine.CpuEngine, continuous batching over a slot KV cache) vs transformers `model.generate`
        on the same tiny Qwen3 (~3.4M parameters: hidden 256, 4 layers), batch of prompts and per-request lengths,
        all sampling at temperature 1 with no top-k/top-p. Two workloads: all requests new_tokens long, and lengths
        spread over [1, 2*new_tokens) as RL responses are (generate keeps finished rows in its batch until the
        longest is done; the engine frees their slots). Each side in a process of its own, taking turns (in one
        process, two OpenMP thread pools slowed both). Prints tokens/s of each and the ratios (target >= 2.0x on
        both). Where .venv-vllm exists, vLLM is a third column (engine: vllm, the batch as one /generate to its front;
        the core its model runner is bound to said), and one weight update (pause, shm push, continue) of the model
        is timed on the CPU engine and on vLLM.

    python bench.py router [--requests 100 --repeats 3 --profile FILE]
        Router overhead per request: an official OpenAI client through agentflow's router (session lookup, chat
        template, TITO bookkeeping, tool-call parsing, response shaping) vs the same greedy /generate sent directly,
        back to back in pairs, each checked to send the same ids and get the same tokens. Prints p50/p99 of the
        paired difference and its ratio to a 64-token generation (median of --repeats, spread over the run); the same
        in CPU time of the bench process (client and router), which a shared machine's load does not stretch; and
        where that went (the client and HTTP hop, the router's app, the session's turn, its engine call), from clocks
        inside the routed request. `--profile FILE`: a cProfile of the measured pairs, by CPU clock. Targets: p50
        <= 2%, p99 <= 5% of a 64-token generation.

    python bench.py async [--steps 24 --prompts 16 --stale-steps 1] [--sync-set K=V ...] [--async-set K=V ...]
        Fully async vs sync training on a long-tail task (responses of 4 to 46 tokens), same everything else: the
        RL loop's wall time and trained samples per second of each, their ratio (target >= 1.7x), both final eval
        accuracies (a matched learning curve: within +-0.05), the lag of the trained tokens (mean, max, on-policy
        share, partial rollouts, tokens masked by the bound), the trainer's wait and the engine's idle share, how busy
        the cores were in each, and the ratio async's own work would give with every core busy all the time. Each
        mode in its fastest CPU layout: sync with one engine per core (`sync_engines`), async with one trainer and
        one engine on cores of their own (the trainer also on the engine's core while it idles).
        The first run also builds the warm start (400 SFT steps), cached for the next ones. --sync-set and
        --async-set add config overrides to one run (e.g. --async-set trainer_threads=2 engine_threads=1).

    python bench.py agentic [--steps 24 --prompts 16 --stale-steps 2 --lrs 5e-4,1e-3 --target 0.6 --seed 2]
        Time to a target accuracy where the model waits on a slow tool: the calc agent (recipes/calc.py: the model
        calls a calculator, reads its result, answers), every call taking wall-clock time from a seeded lognormal
        (median 0.3 s, p99 5 s), from one warm start (the calc recipe's, seed 2: built once, cached). Three runs on
        the same trained samples: sync at B = 16 prompts, sync at C = B * (1 + stale_steps) prompts (as many
        trajectories in flight as async keeps), async; each at every --lrs value, the soonest to the target kept.
        The recipe's eval (128 questions x 2 samples) every 3 steps of B, off both clocks. Prints each run's curve,
        time to --target, samples/s, lag, where the time went; async's time to the target against the best sync
        baseline's (target >= 2.5x sooner, lag <= 2) and its ceiling here. Write-up: docs/ASYNC.md.

    python bench.py modes [--recipe recipes/arith_cpu.yaml --stale-steps 1 --seed 1234]
        The default recipe in sync and in async mode: eval accuracy by step and by wall time in one PNG
        (runs/bench_modes/modes.png), final accuracies and RL-loop wall times.

    python bench.py sync [--quick] [--repeats 3]
        Weight sync: each CPU transport of transfermesh (shared memory, gloo broadcast, disk) moving 10 MB, 100 MB
        and 1 GB of fp32 weights into another process that checks the checksums and copies them into its own tensors,
        as GB/s and as a fraction of a memcpy of the same bytes, next to a one-parameter-per-request pickle-over-HTTP
        path; then the fixed cost of a sync (pause -> begin -> update -> end -> continue) into a real CPU engine on
        the tiny model, that model's whole sync, and the trainer's own (TrainerWorker.sync_weights: gather, HF names,
        push) with its peak extra RSS (docs/TRANSFERMESH.md compares it across commits). Targets: shm >= 0.5x memcpy
        at >= 100 MB, >= 10x pickle/HTTP, fixed cost <= 20 ms. `--quick`: 1 and 4 MB (a smoke test).

    python bench.py step [--steps 12] [--quick] [--sync-set K=V ...] [--async-set K=V ...]
        One RL step of the recipe as users run it (`loongsage.py recipes/arith_cpu.yaml`, a process of its own, sync
        then async, shrunk to STEP_SET: 8 prompts x 8 samples, 32 new tokens, one optimizer step, the 3.35M tiny Qwen3)
        against TRL's GRPOTrainer (TRL pinned, in a venv of its own under the LoongSage cache, built on first use) on
        the same model dir, prompts, reward and batch, fp32, 2 threads. Each side timed from outside: the rows'
        time/wall, TRL's on_step_end; medians of steps 2..N-1. Prints the ratios (target: sync <= 0.8x TRL's s/step),
        the 1-minute load during each run, LoongSage's timeline (timing/* phases, the trainer's own phases) and the
        CPU seconds of every process of its run. `--quick`: 4 steps (a smoke test).

    python bench.py pack [--repeats 3] [--quick: 16 samples, long ones 128 tokens]
        Packed sequences (max_tokens_per_micro_batch) against padded micro-batches: one trainer rank in this process,
        the same long-tail batch (32 samples of a 16-token prompt, most responses 8-32 tokens, one in eight 384),
        RL train steps (old logprobs, forward, backward, optimizer) alternating between the layouts. Prints each
        padded layout's padding fraction, trainer tokens/s of each (real tokens) and the ratio (target >= 2.0x where
        padding is >= 60%).

    python bench.py teachers [--workdir DIR]
        Memory of the Teacher Manager (teacher.py): peak RSS of a teacher process holding 3 same-size teachers
        (13M parameters each: hidden 512, 4 layers; one resident skeleton, the others as swapped snapshots) against
        one holding 1, each scoring one batch routed to all of its teachers; what the teachers add over the process's
        RSS before any model, and the swaps (each teacher loads at most once per batch). Target: both ratios <= 1.3
        (all three resident would be ~1.74). Then the top-k targets' peak extra memory on 4096 x 32768 fp32 logits:
        the teacher's chunked path against a full-vocabulary log-softmax.

Each benchmark is one function `bench_<name>(args)`; `main` dispatches on the subcommand with if/elif and returns
its result dict. Left out: GPU benchmarks (SGLang has its own) and multi-process setups.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import inspect
import itertools
import json
import math
import multiprocessing as mp
import os
import pickle
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import ray
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

import config
import convert
import cpu
import cpu_engine
import data
import fleet
import loongsage
import rollout
import teacher
import transfermesh as tm
import vllm_engine


def run_mode(cfg) -> list[dict]:
    """loongsage.train(cfg), each mode of a bench in a fresh Ray: train() starts one when none is up, and it is
    shut down after the run (train() itself leaves Ray up for a next run), so no worker of one mode serves the next.
    A Ray the caller started (a test session's) is used as found and left up."""
    own = not ray.is_initialized()
    try:
        return loongsage.train(cfg)
    finally:
        if own:
            ray.shutdown()


def sync_engines() -> list[str]:
    """A sync layout on a CPU node: one engine per core, one torch thread each, so a sync step's generation runs as
    request-level parallelism (each engine decodes its share of the groups). On bench step's generation (64 samples
    of ~30 tokens, 2 cores), alternated: 2 engines x 1 thread 0.56-0.58 s, 1 engine x 2 threads 0.60-0.63 s, whole
    steps 1.65-1.66 s against 1.61-1.65 s: the same within noise. (Before the engine built its model on a thread of
    its own, a 2-thread engine took 1.15 s; see CpuEngine.) The trainer gets every core in its phase either way."""
    return [f"num_engines={len(cpu.usable_cores()) or os.cpu_count() or 1}", "engine_threads=1"]


def _interleaved(fns: list, repeats: int) -> list[float]:
    """Median seconds of each fn over `repeats` rounds, the fns taking turns within a round, so a change in the
    machine's load (it is shared) hits baseline and candidate alike. The caller warms them up first."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def _rollout_worker(kind: str, conn, path: str, prompts: list, workloads: dict, threads: int) -> None:
    """One side of `bench rollout` in a process of its own, as each runs in practice (the engine as its server's
    process, generate in its trainer's): "hf" (transformers generate), "engine" (cpu_engine.CpuEngine, served) or
    "vllm" (a vLLM server and its front). Runs the workload named by each message on `conn` (an engine's "update":
    one weight update of the same weights) and answers its seconds. Both sides in one process measured wrongly
    here: while the engine's thread was alive, generate in the main thread ran 1.8-2.0x slower (two OpenMP thread
    pools in one process on 2 cores), and the engine ran slower beside generate's pool too."""
    torch.set_num_threads(threads)
    prompt_len, longest = len(prompts[0]), max(max(v) for v in workloads.values())
    eos = 1  # any id works: the random model is stopped by length, never by chance (ids < 10 are never sampled)
    if kind == "hf":
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor(prompts)  # (B, P), no padding needed

        class EndAt(LogitsProcessor):
            """Force `eos` at each row's own length, so generate ends row b after lengths[b] tokens, as the engine
            does; like any batch of generate, the batch still runs until its longest row is done."""
            def __init__(self, lengths):
                self.lengths = torch.tensor(lengths)

            def __call__(self, input_ids, scores):
                done = (input_ids.shape[1] - prompt_len + 1) >= self.lengths          # (B,) last token now
                scores[done] = float("-inf")
                scores[done, eos] = 0.0
                scores[~done, :10] = float("-inf")  # no early stop by chance: lengths are exactly as planned
                return scores

        def run(lengths):
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, max_new_tokens=max(lengths), min_new_tokens=0,
                                  logits_processor=LogitsProcessorList([EndAt(lengths)]), eos_token_id=eos,
                                  pad_token_id=0)
            got = [(row[prompt_len:] != 0).sum().item() for row in out]  # tokens up to and incl. eos
            assert got == lengths, (got[:8], lengths[:8])
    elif kind == "engine":
        url, server = cpu_engine.serve(path, max_batch=len(prompts), max_len=prompt_len + longest + 1)

        def run(lengths):
            reqs = [server.engine.make_request(p, {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": n,
                                                   "ignore_eos": True}) for p, n in zip(prompts, lengths)]
            outs = [f.result() for f in server.engine.submit(*reqs)]
            assert [len(o["output_ids"]) for o in outs] == lengths
    else:
        cfg = config.finalize(config.Config(model_path=path, engine="vllm", max_prompt_len=prompt_len,
                                            max_new_tokens=longest, engine_max_batch=len(prompts),
                                            output_dir=tempfile.mkdtemp()))
        url = (server := rollout.RolloutEngine(cfg, 0)).url()
        note = "".join(f"  vLLM's model runner: {line.split('local_rank=0, ')[1].strip()} of {os.cpu_count()} cores\n"
                       for line in open(server.log_path) if "local_rank=0, core ids=" in line)

        def run(lengths):
            outs = rollout.post(url, "/generate", {"input_ids": prompts, "sampling_params": [
                {"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]}, timeout=600)
            assert [len(o["output_ids"]) for o in outs] == lengths
    weights, versions = sorted(load_file(f"{path}/model.safetensors").items()), itertools.count(1)
    conn.send("ready" + (note if kind == "vllm" else ""))
    while (name := conn.recv()) is not None:
        t0 = time.perf_counter()
        if name == "update":  # an engine's weight update as train() makes it: pause in place, shm push, continue
            tm.pause_engines([url])
            tm.push_weights(weights, [url], next(versions), transport="shm")
            tm.continue_engines([url])
        else:
            run(workloads[name])
        conn.send(time.perf_counter() - t0)
    if kind == "vllm":
        server.shutdown()  # the server's whole session, its engine core too


def bench_rollout(args) -> dict:
    """Tokens/s of transformers generate, the CPU engine and vLLM on the same batches (the module docstring), each
    side in a process of its own (`_rollout_worker`), taking turns: one computes while the others wait."""
    path = data.build_tiny_model(data.default_cache_dir() / "tiny-bench", hidden_size=256, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768)
    n_params = sum(t.numel() for t in load_file(f"{path}/model.safetensors").values())
    vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    prompts = torch.randint(10, vocab, (args.batch, args.prompt_len), generator=torch.manual_seed(0)).tolist()
    rng = torch.Generator().manual_seed(1)
    workloads = {"fixed": [args.new_tokens] * args.batch,
                 "varied": torch.randint(1, 2 * args.new_tokens, (args.batch,), generator=rng).tolist()}
    threads = torch.get_num_threads()
    print(f"rollout: model {n_params / 1e6:.2f}M params, batch {args.batch}, prompt {args.prompt_len}, "
          f"new tokens {args.new_tokens}, torch threads {threads}, each side in its own process")
    ctx = mp.get_context("spawn")
    sides, kinds = {}, ["hf", "engine"]
    try:
        vllm_engine.python()
        kinds.append("vllm")
    except RuntimeError as e:
        print(f"  no vLLM column: {e}")
    try:
        for kind in kinds:
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_rollout_worker, args=(kind, child, path, prompts, workloads, threads),
                               daemon=True)
            proc.start()
            sides[kind] = (conn, proc)
        for kind, (conn, proc) in sides.items():
            if not conn.poll(600) or not (msg := conn.recv()).startswith("ready"):
                raise RuntimeError(f"bench rollout: the {kind} process did not start (exit code {proc.exitcode})")
            print(msg[5:], end="")  # what a side says of itself: the cores vLLM's model runner is bound to

        def turn(kind, name):
            def fn():
                sides[kind][0].send(name)
                if not sides[kind][0].poll(600):
                    raise RuntimeError(f"bench rollout: the {kind} process gave no answer for {name!r}")
                return sides[kind][0].recv()
            return fn

        result = {"params": n_params}
        for name, lengths in [*workloads.items(), *([("update", None)] if "vllm" in kinds else [])]:
            ks = kinds if lengths else kinds[1:]
            for k in ks:
                turn(k, name)()  # warm-up
            result[name] = t = dict(zip(ks, _interleaved([turn(k, name) for k in ks], args.repeats)))
            if not lengths:
                print("  one weight update of the model (pause in place, shm push, continue): CPU engine "
                      f"{t['engine'] * 1e3:.0f} ms, vLLM {t['vllm'] * 1e3:.0f} ms")
                continue
            r = result[name] = {f"{k}_tok_s": sum(lengths) / t[k] for k in ks} | {"ratio": t["hf"] / t["engine"]}
            print(f"  {name:6s} lengths ({min(lengths)}-{max(lengths)} tokens): transformers generate "
                  f"{r['hf_tok_s']:7.0f} tok/s, CPU engine {r['engine_tok_s']:7.0f} tok/s, ratio {r['ratio']:.2f}x"
                  + (f"; vLLM {r['vllm_tok_s']:7.0f} tok/s" if "vllm" in t else ""))
    finally:
        for conn, proc in sides.values():
            if proc.is_alive():
                conn.send(None)
                proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    print("  target: >= 2.0x on both workloads")
    return result


def router_clocks(flow, clocks) -> tuple[dict, object]:
    """Clocks inside the routed request, on this flow's own objects only (instance attributes; nothing global is
    patched): the router's ASGI app from the request's arrival to its answer's last byte ("app"), the engine call it
    makes ("engine", and the ids it sent and got), and the session's turn bookkeeping ("turn": Session.plan +
    Session.commit, render, tokenize, TITO; `timed` wraps a session's two methods). One request runs at a time, so
    the CPU this process spends inside a span is that request's. Returns (span, timed)."""
    span = {}

    def add(name, t0):
        span[name] = [s + c() - t for s, c, t in zip(span.get(name, (0.0, 0.0)), clocks, t0)]

    make_app, real_generate = flow.router.app, flow.pool.generate

    def timed_app():
        app = make_app()

        async def asgi(scope, receive, send):
            async def keep(message):  # the answer's body, for the SDK's in-memory replay (bench_router)
                if message["type"] == "http.response.body":
                    span["body"] = span.get("body", b"") + message.get("body", b"")
                await send(message)
            t0 = [c() for c in clocks]
            await app(scope, receive, keep)
            add("app", t0)
        return asgi

    async def timed_generate(input_ids, sampling_params, rid, prefer=None, batch="", on_chunk=None):
        t0 = [c() for c in clocks]
        answer = await real_generate(input_ids, sampling_params, rid, prefer, batch, on_chunk=on_chunk)
        add("engine", t0)
        span["ids"], span["answer"] = (list(input_ids), answer[1]["output_ids"]), answer
        return answer

    def timed(fn):
        def call(*a, **kw):
            t0 = [c() for c in clocks]
            try:
                return fn(*a, **kw)
            finally:
                add("turn", t0)
        return call

    flow.router.app, flow.pool.generate = timed_app, timed_generate
    return span, timed


async def router_app_alone(flow, make_app, answer: tuple, msgs: list, params: dict, n: int) -> list[float]:
    """CPU seconds per Chat Completions request of the router's own code: its ASGI app (`make_app`, the untimed one)
    called in process, no socket and no HTTP parser, with the engine call answered at once by `answer` (a real
    answer, captured); one session per request, as in bench_router."""
    app = make_app()
    body = json.dumps({"model": "m", "messages": msgs, "max_tokens": 8, "temperature": 0.0}).encode()

    async def canned(*args, **kwargs):
        return answer
    engine_call, flow.pool.generate = flow.pool.generate, canned
    cpu = []
    try:
        for _ in range(n):
            s = flow.router.open_session(sampling=params, max_context_len=512, max_turns=1)
            path = f"/s/{s.id}/v1/chat/completions"
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                     "headers": [(b"content-type", b"application/json"),
                                 (b"authorization", f"Bearer {s.api_key}".encode())],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
            request, sent = [{"type": "http.request", "body": body, "more_body": False}], []

            async def receive():
                return request.pop() if request else {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)
            t0 = time.process_time()
            await app(scope, receive, send)
            cpu.append(time.process_time() - t0)
            if sent[0]["status"] != 200:
                raise RuntimeError(f"bench router: the in-process request was answered {sent}")
            await flow.router.close_session(s)
    finally:
        flow.pool.generate = engine_call
    return cpu


def bench_router(args) -> dict:
    """Router overhead per request, wall and CPU, and where the CPU time went (see the module docstring)."""
    import agentflow  # late: ~0.7 s (the OpenAI client), which only this subcommand needs
    import openai  # likewise: only this subcommand talks through the official client

    path = data.build_tiny_model(data.default_cache_dir() / "tiny-bench", hidden_size=256, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768)
    # The engine runs in its own process, as engines do in a run (an in-process one would share the GIL
    # with the router and the clients being timed), on --engine-threads torch threads: 1 leaves the other core to
    # this process (agent and router), as a router beside GPU engines has host CPU the engines do not use; with 2
    # the engine's threads take both cores and a routed request's wall time shows the contention, not the router.
    port = tm.free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "cpu_engine.py", "--model-path", path, "--port", str(port),
                             "--max-batch", "8"],
                            cwd=str(Path(__file__).resolve().parent), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(args.engine_threads)})
    url = f"http://127.0.0.1:{port}"
    rollout.wait_healthy(url, timeout=120, proc=proc)
    cfg = config.Config(max_context_len=512, max_new_tokens=8)
    clocks = (time.perf_counter, time.process_time)  # wall, and CPU of this process (the engine's is its own)

    async def run() -> dict:
        flow = agentflow.AgentFlow(cfg, [url], path)
        make_app = flow.router.app
        span, timed = router_clocks(flow, clocks)
        await flow.start_router()
        msgs = [{"role": "user", "content": "12+7"}]
        ids = flow.chat.encode(flow.chat.render(msgs, add_generation_prompt=True))
        # Greedy, so both paths generate the very same tokens (checked below): the paired difference is the router.
        params = {"temperature": 0.0, "max_new_tokens": 8, "stop_token_ids": flow.chat.stop_ids}
        http = flow.pool.http

        async def one_gen64():
            t0 = time.perf_counter()
            await rollout.generate(http, url, ids, {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True})
            t64.append(time.perf_counter() - t0)

        async def one_direct():
            t0 = [c() for c in clocks]
            out = await rollout.generate(http, url, ids, params)
            direct.append([c() - t for c, t in zip(clocks, t0)])
            direct_ids.append(out["output_ids"])

        async def one_routed():
            # One session and one client per request, as AgentFlow gives each white-box trajectory: on the flow's
            # one connection pool (an agent program of its own opens a connection with its first request)
            s = flow.router.open_session(sampling=params, max_context_len=512, max_turns=1)
            s.plan, s.commit = timed(s.plan), timed(s.commit)
            client = flow.session_client(s)
            span.clear()
            t0 = [c() for c in clocks]
            await client.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0.0)
            routed.append([c() - t for c, t in zip(clocks, t0)])
            spans.append(dict(span))
            await flow.router.close_session(s)
            await one_sdk(span["body"])

        async def one_sdk(body: bytes):
            # The official SDK's own work for the same call (the request built from Python objects, the answer parsed
            # into a ChatCompletion) against an in-memory transport that replays the router's answer: what an agent's
            # process pays against any OpenAI server, SGLang's own included, so not the router's.
            mod = agentflow.sdk_httpx()
            replay = mod.MockTransport(lambda request: mod.Response(
                200, headers={"content-type": "application/json"}, content=body))
            client = openai.AsyncOpenAI(base_url="http://replay/v1", api_key="none", max_retries=0,
                                        http_client=openai.DefaultAsyncHttpxClient(transport=replay))
            t0 = [c() for c in clocks]
            await client.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0.0)
            sdk.append([c() - t for c, t in zip(clocks, t0)])
            await client.close()

        t64, direct, routed, direct_ids, spans, sdk = [], [], [], [], [], []
        await one_gen64()  # warm-up
        t64.clear()
        profile = cProfile.Profile(time.process_time) if args.profile else None  # CPU clock: load does not stretch it
        for i in range(args.requests + 5):  # the first 5 pairs are warm-up; alternate which goes first
            if profile is not None and i == 5:
                profile.enable()
            for fn in ((one_direct, one_routed) if i % 2 == 0 else (one_routed, one_direct)):
                await fn()
            if i % max(1, args.requests // args.repeats) == 0 and i >= 5:  # the reference, spread over the run
                await one_gen64()
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile)
        alone = await router_app_alone(flow, make_app, span["answer"], msgs, params, args.requests + 5)
        await flow.close()
        for d, sp in zip(direct_ids, spans):  # a fair pair: the same prompt ids in, the same tokens out
            if sp["ids"] != (ids, d):
                raise RuntimeError(f"bench router: the routed request sent {sp['ids'][0]} and got {sp['ids'][1]}, the "
                                   f"direct one sent {ids} and got {d}; the pairs would not compare like for like")
        return {"t64": statistics.median(t64), "direct": direct[5:], "routed": routed[5:], "spans": spans[5:],
                "sdk": sdk[5:], "alone": alone[5:]}

    try:
        r = asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return router_report(args, r)


def router_report(args, r: dict) -> dict:
    """bench router's figures from its measured pairs `r` (bench_router's run()), wall and CPU, p50/p99, the wall ones
    also as a fraction of a 64-token generation; printed, and returned. Three views of one request's overhead:
    * "pair": the routed request over the direct one sent next to it: the engine's own jitter, in both, is in it.
    * "outside": the routed request less its own engine call (the router's /generate call, the very call the direct
      request makes): the official SDK, the HTTP hop and the router, with no engine time in it.
    * "router": "outside" less the SDK's own work for that call (measured against an in-memory transport): the hop
      and the router, what serving a request through LoongSage's router adds over the engine. The goal's figure.
    And the CPU overhead split by the clocks inside the routed request."""
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    result = {"gen64_s": r["t64"]}
    views = {"pair": lambda k: [b[k] - a[k] for a, b in zip(r["direct"], r["routed"])],  # back to back, same tokens
             "outside": lambda k: [b[k] - sp["engine"][k] for b, sp in zip(r["routed"], r["spans"])],
             "sdk": lambda k: [x[k] for x in r["sdk"]],
             "router": lambda k: [b[k] - sp["engine"][k] - x[k] for b, sp, x in zip(r["routed"], r["spans"], r["sdk"])]}
    for k, clock in enumerate(("wall", "cpu")):
        result[f"direct_{clock}_p50_s"] = statistics.median(a[k] for a in r["direct"])
        result[f"routed_{clock}_p50_s"] = statistics.median(b[k] for b in r["routed"])
        for view, xs in views.items():
            result[f"{view}_{clock}_p50_s"], result[f"{view}_{clock}_p99_s"] = pct(xs(k), 0.5), pct(xs(k), 0.99)
    for view in views:
        result[f"{view}_ratio_p50"], result[f"{view}_ratio_p99"] = (result[f"{view}_wall_{q}_s"] / r["t64"]
                                                                    for q in ("p50", "p99"))
    # The CPU overhead split by the clocks inside the routed request; the parts add up to it pair by pair.
    cpu = 1
    parts = {"client": [b[cpu] - sp["app"][cpu] for b, sp in zip(r["routed"], r["spans"])],  # SDK, both HTTP ends
             "app": [sp["app"][cpu] - sp["engine"][cpu] - sp["turn"][cpu] for sp in r["spans"]],  # routing, checks,
             #                                                                                      response
             "turn": [sp["turn"][cpu] for sp in r["spans"]],                                      # render, TITO
             "engine": [sp["engine"][cpu] - a[cpu] for sp, a in zip(r["spans"], r["direct"])]}  # over direct's
    result.update({f"cpu_{k}_p50_s": pct(v, 0.5) for k, v in parts.items()})
    ms = lambda key: f"{result[key] * 1e3:.2f}"  # noqa: E731
    print(f"router: {args.requests} request pairs (greedy, 8 new tokens); a 64-token generation takes "
          f"{r['t64'] * 1e3:.1f} ms (median of {args.repeats}, spread over the run; engine on {args.engine_threads} "
          "torch thread(s))")
    print(f"  direct /generate p50 {ms('direct_wall_p50_s')} ms; OpenAI client -> router p50 "
          f"{ms('routed_wall_p50_s')} ms")
    labels = {"pair": "routed over the direct request next to it (both hold the engine's jitter)",
              "outside": "routed request less its own engine call (SDK, HTTP hop, router)",
              "sdk": "the official SDK's own work for the call (in-memory transport)",
              "router": "router overhead per request (outside less the SDK's: the hop and the router)"}
    for view, label in labels.items():
        print(f"  {label}: p50 {ms(f'{view}_wall_p50_s')} ms, p99 {ms(f'{view}_wall_p99_s')} ms = "
              f"{result[f'{view}_ratio_p50']:.3f}, {result[f'{view}_ratio_p99']:.3f} of a 64-token generation; "
              f"CPU p50 {ms(f'{view}_cpu_p50_s')} ms, p99 {ms(f'{view}_cpu_p99_s')} ms")
    result["app_alone_cpu_p50_s"], result["app_alone_cpu_p99_s"] = pct(r["alone"], 0.5), pct(r["alone"], 0.99)
    print(f"  the router's own code (its app called in process, no socket, the engine answering at once): CPU p50 "
          f"{ms('app_alone_cpu_p50_s')} ms, p99 {ms('app_alone_cpu_p99_s')} ms; the rest of the router's share is the "
          "HTTP hop (uvicorn, the SDK's HTTP client, the event loop, the kernel)")
    print(f"  where the routed request's CPU over the direct one went, p50 of each part (ms): OpenAI client and both "
          f"ends of the HTTP hop {ms('cpu_client_p50_s')}, router app {ms('cpu_app_p50_s')}, session turn "
          f"{ms('cpu_turn_p50_s')}, engine call over direct {ms('cpu_engine_p50_s')}")
    if args.profile:
        print(f"  cProfile of the measured pairs (CPU clock) in {args.profile}; the timings above include its cost")
    return result


# ----------------------------------------------------------------------------------------------
# async: a long-tail task, async vs sync, trained samples per second at a matched learning curve


def longtail_samples(n: int, seed: int) -> list[dict]:
    """Single-digit a+b or a-b with a letter: "3+4 e" is answered by counting down the alphabet from that letter,
    then the sum: "e d c b a 7". The letter is "a" for three prompts in four and "h" to "z" for the rest, so
    responses run from 4 to 46 tokens (mean ~11): the long tail that makes a synchronous step wait for its slowest
    trajectories while most of the engine's batch has finished. Counting down is a rule the tiny model learns in
    the warm start (each letter follows from the one before, the answer from "a"), where repeating the answer k
    times was not: that model had to count, and its answers came out 6 tokens long on average, with no tail."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = data.arith_problem(rng, max_operand=9)
        k = 1 if rng.random() < 0.75 else rng.randint(8, 26)  # letters to count down
        out.append({"messages": [{"role": "user", "content": f"{s['messages'][0]['content']} {chr(96 + k)}"}],
                    "answer": s["answer"], "count": k})
    return out


def longtail_sft(tok, sample: dict, rng=None, label_noise: float = 0.0) -> dict:
    """Warm-start example: the letters from the prompt's down to "a", then the (possibly near-miss) answer, then
    end of turn."""
    t = data.sft_trajectory(tok, sample, rng, label_noise)  # answer (maybe off by one) + the end token
    answer = tok.decode(t["response_ids"][:-1])
    letters = [chr(96 + i) for i in range(sample["count"], 0, -1)]
    r = tok.encode(" ".join(letters + [answer]), add_special_tokens=False) + t["response_ids"][-1:]
    return {**t, "response_ids": r, "loss_mask": [1] * len(r), "rollout_logprobs": [0.0] * len(r),
            "weight_versions": [-1] * len(r)}


def run_stats(hist: list[dict]) -> dict:
    """What bench async and bench agentic report of one run, from its logged rows: the RL loop's wall time (evals
    left out) and trained samples per second, eval before and after, the lag of the trained tokens, the trainer's
    wait and the engine's idle share, and where the loop's time went (waiting for rollouts, train, weight sync)."""
    steps = [h for h in hist if "timing/step" in h]
    wall = sum(h["timing/step"] - h.get("timing/eval", 0.0) for h in steps)
    trained = sum(h.get("train/samples", 0) for h in steps)
    tokens = sum(h["rollout/generated_tokens"] for h in steps)
    phases = {k: sum(h.get(f"timing/{k}", 0.0) for h in steps) for k in ("generate", "train", "sync")}
    return {"wall_s": wall, "samples_per_s": trained / wall, "trained": trained,
            "eval_start": hist[0]["eval/accuracy"],
            "eval_end": [h for h in hist if "eval/accuracy" in h][-1]["eval/accuracy"],
            # lag of trained tokens, over the run: token-weighted mean, max, and the share at lag 0
            "lag_mean": sum(h["rollout/lag_mean"] * h["rollout/generated_tokens"] for h in steps) / tokens,
            "lag_max": max(h.get("rollout/lag_max", 0) for h in steps),
            "on_policy": sum(h["rollout/on_policy_frac"] * h["rollout/generated_tokens"] for h in steps) / tokens,
            "partial": statistics.mean(h["rollout/partial_frac"] for h in steps),
            "masked": sum(h.get("rollout/lag_masked_tokens", 0) for h in steps),
            # groups whose every token was past the bound, replaced by the next complete group
            "lag_dropped": sum(h.get("rollout/lag_dropped_groups", 0) for h in steps),
            "wait": statistics.mean(h["perf/trainer_wait_frac"] for h in steps),
            # share of the machine's CPU time busy over the steps without an eval (/proc/stat)
            "cpu_busy": statistics.mean([h.get("perf/node_cpu_busy_frac", float("nan"))
                                         for h in steps if "timing/eval" not in h] or [float("nan")]),
            "idle": statistics.mean(h["perf/engine_idle_frac"] for h in steps),
            "response_len": statistics.mean(h["rollout/response_len"] for h in steps),
            # the loop's wall time by phase: the trainer waiting for rollouts, training, weight sync, the rest
            # (logging, metrics, the engines' health calls)
            "time": {**phases, "other": wall - sum(phases.values())}}


def bench_async(args) -> dict:
    """Async vs sync on the long-tail task (the module docstring: what it prints, the targets).

    The settings are a user's: 16 prompts x 8 samples per step, one optimizer step per RL step, async with
    stale_steps=1 (C = 32 groups), window-gated, max_version_lag=2 and the token IS correction (both modes, so
    they differ in the mode alone). The data files live in the cache directory under fixed names (their content
    is seeded), so the warm start (400 SFT steps) is cached across runs and only the first run pays for it."""
    where = data.default_cache_dir() / "bench_async"
    where.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("train.jsonl", 4096, 1), ("eval.jsonl", 128, 2)):
        text = "\n".join(json.dumps(s) for s in longtail_samples(n, seed))
        if not (where / name).exists() or (where / name).read_text() != text:
            (where / name).write_text(text)
    out = Path(tempfile.mkdtemp(prefix="loongsage_bench_async_"))
    args.steps, args.prompts = args.steps or 24, args.prompts or 16
    common = [f"num_steps={args.steps}", f"prompts_per_step={args.prompts}", "samples_per_prompt=8",
              f"global_batch_size={args.prompts * 8}", f"micro_batch_size={args.prompts * 4}", "max_new_tokens=64",
              f"dataset={where / 'train.jsonl'}", f"eval_dataset={where / 'eval.jsonl'}", "eval_samples=4",
              f"eval_every={args.steps}", "reward=data.last_number_match", "warmstart_example=bench.longtail_sft",
              f"warmstart_dataset={where / 'train.jsonl'}", f"warmstart_steps={args.warmstart_steps or 400}",
              "lr=1e-3", "min_lr=1e-3", "print_every=0", "max_context_len=256",
              "is_correction=token"]  # both modes: the IS weight corrects async's lag (and is ~1 in sync)
    modes = {"sync": ["mode=sync", *sync_engines(), *args.sync_set],
             "async": ["mode=async", f"stale_steps={args.stale_steps}", "max_version_lag=2", "window=window-gated",
                       *args.async_set]}
    res = {}
    for name, extra in modes.items():
        cfg = config.load_config("recipes/arith_cpu.yaml", common + extra + [f"output_dir={out / name}"])
        hist = run_mode(cfg)
        res[name] = run_stats(hist)
    ratio = res["async"]["samples_per_s"] / res["sync"]["samples_per_s"]
    diff = res["async"]["eval_end"] - res["sync"]["eval_end"]
    print(f"bench async: long-tail task, {args.steps} steps x {args.prompts} prompts x 8 samples, mean response "
          f"{res['sync']['response_len']:.1f} tokens; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name, r in res.items():
        print(f"  {name:5s}: RL loop {r['wall_s']:.1f} s for {r['trained']} trained samples, {r['samples_per_s']:.1f}"
              f"/s; eval {r['eval_start']:.3f} -> {r['eval_end']:.3f}; trainer waits {r['wait']:.0%} of a step, "
              f"engine idle {r['idle']:.0%}")
        print(f"         lag of trained tokens: mean {r['lag_mean']:.2f}, max {r['lag_max']:.0f}, on-policy "
              f"{r['on_policy']:.0%}; partial rollouts {r['partial']:.0%}; masked by the bound {r['masked']:.0f} "
              f"tokens, {r['lag_dropped']:.0f} groups (nothing left to train: the next complete group took its place)")
    print(f"  async / sync trained samples per second: {ratio:.2f}x (target >= 1.7x); final eval async - sync "
          f"{diff:+.3f} (matched within +-0.05: {abs(diff) <= 0.05})")
    busy = res["async"]["cpu_busy"]
    print(f"  the cores were busy {res['sync']['cpu_busy']:.0%} of sync's steps and {busy:.0%} of async's: async's own "
          f"work, with every core busy all the time, would give at most {ratio / busy:.2f}x")
    res["ceiling"] = ratio / busy
    return {"ratio": ratio, **res}


# ----------------------------------------------------------------------------------------------
# agentic: the calc agent waiting on a slow tool, async vs sync


def tool_waits(rollouts: Path) -> dict:
    """From a run's dumped rollouts (the trained trajectories, with their timings): the mean seconds a trajectory
    spent in generation (generate_s: the engine's work and its queue), waiting on the calculator (what the calc agent
    reports) and elsewhere (the agent and the router's own work, and their event loop's queue), and the slowest."""
    trajs = [json.loads(line) for f in sorted(rollouts.glob("step_*.jsonl")) for line in open(f)]
    total = [t["timings"]["total_s"] for t in trajs]
    gen = [t["timings"]["generate_s"] for t in trajs]
    tool = [(t["metadata"].get("agent_result") or {}).get("tool_s", 0.0) for t in trajs]
    return {"total_s": statistics.mean(total), "generate_s": statistics.mean(gen), "tool_s": statistics.mean(tool),
            "rest_s": statistics.mean(total) - statistics.mean(gen) - statistics.mean(tool), "slowest_s": max(total)}


def learning_curve(hist: list[dict], target: float) -> dict:
    """The eval curve of a run on the RL loop's clock (each step's wall time less its eval's: an eval is pinned to the
    weights just synced, and its time is in neither mode's clock), as (trained samples, seconds, accuracy), and the
    first point at or above `target` (None when the run never got there)."""
    clock = samples = 0.0
    curve = [(0, 0.0, hist[0]["eval/accuracy"])]
    for h in hist[1:]:  # after the eval before training
        clock += h.get("timing/step", 0.0) - h.get("timing/eval", 0.0)
        samples += h.get("train/samples", 0)
        if "eval/accuracy" in h:
            curve.append((int(samples), clock, h["eval/accuracy"]))
    hit = next((p for p in curve if p[2] >= target), None)
    # the same, less at the mercy of one eval's noise: accuracy = a + b ln(samples) fitted to the evals after the
    # first by least squares, crossing the target at exp((target - a) / b) samples, timed at the run's samples/s
    xs, ys = [math.log(n) for n, _, _ in curve[1:]], [acc for _, _, acc in curve[1:]]
    b = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else 0.0
    fit = math.exp((target - statistics.fmean(ys) + b * statistics.fmean(xs)) / b) if b > 0 else None
    return {"curve": curve, "to_target_s": hit and hit[1], "to_target_samples": hit and hit[0],
            "fit_samples": fit, "fit_s": fit and fit * clock / samples,
            "eval_s": sum(h.get("timing/eval", 0.0) for h in hist)}


def bench_agentic(args) -> dict:
    """Async vs two sync baselines where the model waits on a slow tool (the module docstring: what it prints, the
    target); a question's tool durations are the same in every run, drawn from a lognormal seeded by --tool-seed.

    The calc agent (recipes/calc.py) from the calc recipe's warm start of seed --seed (built once, cached), B prompts
    x 8 samples per step, 64 samples per optimizer step in every run. Sync at B waits each step for its slowest
    tool call, engines and trainer idle; sync at C = B * (1 + stale_steps) prompts keeps as many trajectories in
    flight as async does (fewer, larger steps: the same samples, the same optimizer steps); async keeps C groups
    going (no-window: a group enters the buffer the moment it is complete), training while agents wait, its lag
    bounded by max_version_lag 2 (older tokens masked). Each mode runs at every --lrs value; the one that reaches
    --target soonest is its result."""
    sigma = math.log(args.tool_p99 / args.tool_median) / 2.3263  # z of the 99th percentile of a standard normal
    latency = {"median": args.tool_median, "sigma": sigma, "seed": args.tool_seed}
    where = data.default_cache_dir() / "bench_agentic"
    where.mkdir(parents=True, exist_ok=True)
    (where / "train.jsonl").write_text("\n".join(json.dumps({**s, "tool_latency": latency})
                                                  for s in data.load_dataset("synthetic:calc:4096:1")))
    out = Path(tempfile.mkdtemp(prefix="loongsage_bench_agentic_"))
    steps, b = args.steps or 24, args.prompts or 16
    stale = 2.0 if args.stale_steps is None else args.stale_steps
    wide = round(b * (1 + stale))
    gbs = min(64, b * 8)
    common = [f"seed={2 if args.seed is None else args.seed}", "samples_per_prompt=8", f"global_batch_size={gbs}",
              f"micro_batch_size={gbs // 2}", f"dataset={where / 'train.jsonl'}",
              # the recipe's eval: 2 samples a question at temperature 1 move with the policy (greedy jumps in a step)
              f"eval_dataset=synthetic:calc:{args.eval_prompts}:2", "eval_temperature=1.0", "eval_samples=2",
              "print_every=0", "save_every=0", "max_version_lag=2",
              "is_correction=token"]  # every mode: the IS weight corrects async's lag (and is ~1 in sync)
    if args.warmstart_steps is not None:
        common.append(f"warmstart_steps={args.warmstart_steps}")
    e = args.eval_every or 3  # evals every e steps of B prompts, the wide run at the same samples
    modes = {"async": ["mode=async", f"prompts_per_step={b}", f"num_steps={steps}", f"eval_every={e}",
                       f"stale_steps={stale}", "window=no-window", *args.async_set],
             "sync": ["mode=sync", f"prompts_per_step={b}", f"num_steps={steps}", f"eval_every={e}",
                      *sync_engines(), *args.sync_set],
             f"sync-{wide}": ["mode=sync", f"prompts_per_step={wide}", f"num_steps={max(1, round(steps * b / wide))}",
                              f"eval_every={max(1, round(e * b / wide))}", *sync_engines(), *args.sync_set]}
    print(f"bench agentic: calc agent, calculator lognormal (median {args.tool_median:g} s, p99 {args.tool_p99:g} s, "
          f"seed {args.tool_seed}), {steps} steps x {b} prompts x 8 samples (sync-{wide}: the same samples in larger "
          f"steps), async stale_steps {stale:g}, lr from {args.lrs}, target {args.target:g} on "
          f"{args.eval_prompts} prompts x 2 samples; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    res, runs = {}, {}
    for lr in args.lrs.split(","):
        for name, extra in modes.items():
            run = out / f"{name}_lr{lr}"
            cfg = config.load_config("recipes/calc_cpu.yaml", common + extra + [
                f"lr={lr}", f"min_lr={lr}", f"output_dir={run}", f"dump_rollouts={run / 'rollouts'}"])
            hist = run_mode(cfg)
            r = runs[name, lr] = {"lr": float(lr), **run_stats(hist), **tool_waits(run / "rollouts"),
                                  **learning_curve(hist, args.target)}
            t = r["time"]
            print(f"  {name} lr {lr}: eval (samples, s, accuracy) " + ", ".join(
                f"({n}, {c:.0f}, {a:.3f})" for n, c, a in r["curve"]) + f"; time to {args.target:g}: "
                + (f"{r['to_target_s']:.1f} s" if r["to_target_s"] is not None else "not reached")
                + (f"; fitted: {r['fit_samples']:.0f} samples, {r['fit_s']:.1f} s" if r["fit_s"] else ""))
            print(f"      RL loop {r['wall_s']:.1f} s for {r['trained']:.0f} trained samples, "
                  f"{r['samples_per_s']:.2f}/s (evals {r['eval_s']:.0f} s, off the clock); lag mean "
                  f"{r['lag_mean']:.2f}, max {r['lag_max']:.0f}, masked {r['masked']:.0f} tokens, "
                  f"{r['lag_dropped']:.0f} groups; trainer waits {r['wait']:.0%}, engine idle {r['idle']:.0%}")
            print(f"      loop: waiting for rollouts {t['generate']:.1f} s, train {t['train']:.1f} s, weight sync "
                  f"{t['sync']:.1f} s, other {t['other']:.1f} s; a trajectory (mean) {r['total_s']:.2f} s = "
                  f"{r['generate_s']:.2f} s generating + {r['tool_s']:.2f} s waiting on the calculator + "
                  f"{r['rest_s']:.2f} s in the agent and router; slowest {r['slowest_s']:.1f} s")
    for name in modes:  # each mode at its best lr: the soonest to the target, else the highest final eval
        res[name] = min((r for (n, _), r in runs.items() if n == name),
                        key=lambda r: (r["to_target_s"] is None, r["to_target_s"] or -r["eval_end"]))
    syncs = [n for n in modes if n != "async"]
    best = min(syncs, key=lambda n: (res[n]["to_target_s"] is None, res[n]["to_target_s"] or 0.0))
    a, s = res["async"]["to_target_s"], res[best]["to_target_s"]
    speedup = s / a if a and s else None
    for name, r in res.items():
        print(f"  {name:>8s} (lr {r['lr']:g}): eval {r['eval_start']:.3f} -> {r['eval_end']:.3f}, time to "
              f"{args.target:g} " + (f"{r['to_target_s']:.1f} s" if r["to_target_s"] is not None else "never")
              + f", {r['samples_per_s']:.2f} trained samples/s, max lag {r['lag_max']:.0f}")
    rate = res["async"]["samples_per_s"] / res[best]["samples_per_s"]
    fits = {n: r["fit_s"] for n, r in res.items()}
    fitted = min(fits[n] for n in syncs) / fits["async"] if all(fits.values()) else None
    quick = min(syncs, key=lambda n: res[n]["wall_s"])  # the fastest sync loop, over what no overlap removes
    ceiling = res[quick]["wall_s"] / res["async"]["time"]["train"]
    print(f"  async reaches {args.target:g} " + (f"{speedup:.2f}x sooner than" if speedup else "-- (one of them never "
          "did) --") + f" the best sync baseline ({best}), at {rate:.2f}x its trained samples/s (target >= 2.5x "
          f"sooner, max lag <= 2); at most {ceiling:.2f}x here: {quick}'s RL loop {res[quick]['wall_s']:.0f} s over "
          f"async's training {res['async']['time']['train']:.0f} s, which no overlap removes")
    print("  fitted: " + (f"async {fitted:.2f}x sooner than the best sync baseline (" + ", ".join(
        f"{n} {v:.1f} s" for n, v in fits.items()) + ")" if fitted else "-- (a run's evals did not rise) --"))
    return {"speedup": speedup, "fitted": fitted, "best_sync": best, "ceiling": ceiling, "runs": runs, **res}


def bench_modes(args) -> dict:
    """The recipe in sync and in async mode (the module docstring); the bar: async ends within 0.05 of sync's accuracy
    in less wall time. Sync in its fastest CPU layout (`sync_engines`: one engine per core), async as placed."""
    res, args.seed = {}, 1234 if args.seed is None else args.seed
    for name, extra in {"sync": ["mode=sync", *sync_engines()],
                        "async": ["mode=async", f"stale_steps={args.stale_steps}", "max_version_lag=2"]}.items():
        cfg = config.load_config(args.recipe, extra + [f"output_dir=runs/bench_modes/{name}", f"seed={args.seed}"])
        t0 = time.perf_counter()
        hist = run_mode(cfg)
        total = time.perf_counter() - t0
        steps = [h for h in hist if "timing/step" in h]
        # wall time of the RL loop at the end of each step
        clock = dict(zip([h["step"] for h in steps], itertools.accumulate(h["timing/step"] for h in steps)))
        rl = clock[steps[-1]["step"]]
        evals = [(h["step"], h["eval/accuracy"]) for h in hist if "eval/accuracy" in h]
        res[name] = {"evals": evals, "clock": clock, "rl_s": rl, "total_s": total,
                     "lag_max": max(h.get("rollout/lag_max", 0) for h in steps)}
    import matplotlib  # late: ~0.5 s, for this subcommand's plot only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot picks its backend on import
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in res.items():
        steps_, acc = zip(*r["evals"])
        a.plot(steps_, acc, "o-", label=name)
        b.plot([0.0] + [r["clock"][s - 1] for s in steps_[1:]], acc, "o-", label=name)
    for ax, x in ((a, "RL step"), (b, "RL loop wall time (s)")):
        ax.set(xlabel=x, ylabel="eval accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{args.recipe}: sync vs async (stale_steps={args.stale_steps}), seed {args.seed}")
    fig.tight_layout()
    Path("runs/bench_modes").mkdir(parents=True, exist_ok=True)
    fig.savefig("runs/bench_modes/modes.png", dpi=110)
    print(f"bench modes: {args.recipe}, seed {args.seed}")
    for name, r in res.items():
        print(f"  {name:5s}: eval {r['evals'][0][1]:.3f} -> {r['evals'][-1][1]:.3f}, RL loop {r['rl_s']:.0f} s "
              f"(run {r['total_s']:.0f} s), max version lag {r['lag_max']:.0f}")
    d = res["async"]["evals"][-1][1] - res["sync"]["evals"][-1][1]
    print(f"  final accuracy async - sync {d:+.3f} (within 0.05: {abs(d) <= 0.05}); RL loop time async / sync "
          f"{res['async']['rl_s'] / res['sync']['rl_s']:.2f}; curves: runs/bench_modes/modes.png")
    (Path("runs/bench_modes") / "result.json").write_text(json.dumps(res, default=str))
    return res


# ----------------------------------------------------------------------------------------------
# weight sync: transports vs memcpy and vs pickle-over-HTTP; the fixed cost of a sync


def _sync_receiver(conn) -> None:
    """The receiving process of `bench sync`: what an engine does with each transport, down to copying the
    weights into tensors it owns (checksums verified as the engine verifies them). Commands arrive on `conn`."""
    torch.set_num_threads(1)  # the sender keeps the other core, as an engine actor and a trainer would
    group, dest = None, {}

    def keep(named):
        for name, t in named:
            if name not in dest or dest[name].shape != t.shape:
                dest[name] = torch.empty_like(t)
            dest[name].copy_(t)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            keep([pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))])
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    conn.send(http.server_address[1])
    while True:
        cmd, *a = conn.recv()
        if cmd == "stop":
            http.shutdown()
            return
        if cmd == "join":
            group = tm.new_sglang_group("127.0.0.1", a[0], 1, 2, "bench", "gloo")
        elif cmd == "shm":
            keep(tm.read_tensor_payload(a[0], "flattened_bucket", a[1]))
        elif cmd == "broadcast":
            keep(tm.recv_broadcast(group, *a))
        elif cmd == "disk":
            keep(load_file(a[0]).items())
        elif cmd == "clear":
            dest.clear()
        conn.send("ok")


def _trainer_sync(path: str, url: str, repeats: int) -> tuple[float, int]:
    """Median seconds of `TrainerWorker.sync_weights` (one rank in this process, shm into the engine at `url`,
    pause and continue around it as train() does) after a warm-up sync, and the largest extra resident memory of
    this process during one (its peak RSS minus its RSS before the call)."""
    import trainer  # Megatron: late (its import takes seconds)
    cfg = config.load_config(None, [f"model_path={path}", "transfer=shm", "kl_coef=0", "trainer_threads=1"])
    w = trainer.TrainerWorker(cfg, 0, 1, "127.0.0.1", tm.free_port())
    try:
        w.load_hf(path)
        times, peak = [], 0
        for v in range(300, 301 + repeats):
            before = tm.rss_bytes()
            tm.reset_peak_rss()
            t0 = time.perf_counter()
            tm.pause_engines([url])
            w.sync_weights([url], v)
            tm.continue_engines([url])
            times.append(time.perf_counter() - t0)
            peak = max(peak, tm.peak_rss_bytes() - before) if v > 300 else peak  # the warm-up makes the segment
        return statistics.median(times[1:]), peak
    finally:
        w.shutdown()


def bench_sync(args) -> dict:
    """Weight sync (the module docstring): 4 MB tensors, 64 MB buckets, checksums on; best of --repeats after a
    warm-up."""
    sizes_mb = [1, 4] if args.quick else [10, 100, 1000]
    bucket_bytes = 64 * 2**20
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_sync_receiver, args=(child_conn,), daemon=True)
    proc.start()
    http_port = conn.recv()

    def ask(*cmd):
        conn.send(cmd)
        assert conn.recv() == "ok"

    port = tm.free_port()
    conn.send(("join", port))
    group = tm.new_sglang_group("127.0.0.1", port, 0, 2, "bench", "gloo")
    assert conn.recv() == "ok"
    http = httpx.Client(timeout=600, transport=httpx.HTTPTransport(
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]))
    tmp = Path(tempfile.mkdtemp(prefix="loongsage_bench_sync_"))

    def shm(named):  # as transfermesh._push_shm: bucket i+1 is written while the receiver copies bucket i out
        buckets = list(tm.iter_buckets(named, bucket_bytes))
        tm.reserve_shm(max(tm.bucket_layout(b)[1] for b in buckets))
        for i, bucket in enumerate(buckets):
            flat, metas, sums = tm.write_shm_bucket(bucket, half=i % 2)
            payload = tm.tensor_payloads(flat, metas, 1)[0]
            if i:
                assert conn.recv() == "ok"
            conn.send(("shm", payload, sums))
        assert conn.recv() == "ok"

    def broadcast(named):
        for bucket in tm.iter_buckets(named, bucket_bytes):
            flat, metas = tm.flatten_bucket(bucket)
            conn.send(("broadcast", [m[0] for m in metas], [m[1] for m in metas], [m[2] for m in metas],
                       "flattened_bucket", tm.checksum(flat)))
            group.broadcast(flat, 0).wait()
            assert conn.recv() == "ok"

    def disk(named):
        path = str(tmp / "model.safetensors")
        save_file(dict(named), path)
        ask("disk", path)
        os.remove(path)

    def pickle_http(named):  # the naive baseline: one POST per parameter, the tensor pickled into the body
        for pair in named:
            http.post(f"http://127.0.0.1:{http_port}/", content=pickle.dumps(pair)).raise_for_status()

    print(f"sync: transports into another process (receiver copies into its own tensors; XXH3 checksums checked), "
          f"torch threads {torch.get_num_threads()}")
    print(f"  {'size':>8s} {'memcpy':>8s} {'shm':>14s} {'broadcast':>14s} {'disk':>14s} {'pickle/HTTP':>12s} "
          f"{'shm/pickle':>10s}  (GB/s; x = fraction of memcpy)")
    result = {}
    for mb in sizes_mb:
        nbytes = mb * 2**20
        per = min(4 * 2**20, nbytes) // 4
        named = [(f"w{i}", torch.randn(per)) for i in range(nbytes // 4 // per)]  # 4 MB fp32 tensors
        src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        src_np, dst_np = src.numpy(), dst.numpy()
        # the baseline is the faster memcpy of the two: torch's copy_ (its threads) or numpy's (one thread; torch's
        # two threads copied slower than one here whenever the other core was busy)
        fns = {"memcpy_torch": lambda _: dst.copy_(src), "memcpy_numpy": lambda _: np.copyto(dst_np, src_np),
               "shm": shm, "broadcast": broadcast, "disk": disk, "pickle_http": pickle_http}
        ask("clear")
        for fn in fns.values():
            fn(named)  # warm-up: first-touch page faults on both sides, as a second sync would not pay them
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.repeats):  # rounds in which the transports take turns, so a change of load hits all
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn(named)
                best[name] = min(best[name], time.perf_counter() - t0)  # best of: a spike of load is not the transport
        row = {name: nbytes / t / 1e9 for name, t in best.items()}
        row["memcpy"] = max(row.pop("memcpy_torch"), row.pop("memcpy_numpy"))
        del src, dst, src_np, dst_np
        result[mb] = row
        frac = {k: row[k] / row["memcpy"] for k in row}
        print(f"  {mb:6d}MB {row['memcpy']:8.2f} " + " ".join(f"{row[k]:7.2f} ({frac[k]:.2f}x)"
              for k in ("shm", "broadcast", "disk")) + f" {row['pickle_http']:12.2f} "
              f"{row['shm'] / row['pickle_http']:9.1f}x")
        del named
    conn.send(("stop",))
    proc.join(timeout=30)
    http.close()

    # the fixed cost: a real CPU engine in its own process, synced the way train() does it
    path = data.build_tiny_model(data.default_cache_dir() / "tiny-bench", hidden_size=256, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768)
    eport = tm.free_port("127.0.0.1")
    eproc = subprocess.Popen([sys.executable, "cpu_engine.py", "--model-path", path, "--port", str(eport),
                              "--max-batch", "8"],
                             cwd=str(Path(__file__).resolve().parent), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{eport}"
    try:
        rollout.wait_healthy(url, timeout=120, proc=eproc)
        weights = sorted(load_file(f"{path}/model.safetensors").items())
        one = [w for w in weights if w[0] == "model.norm.weight"]  # 1 KB: the sync's fixed cost alone

        def sync(named, version):
            t0 = time.perf_counter()
            tm.pause_engines([url])
            tm.push_weights(named, [url], version, transport="shm")
            tm.continue_engines([url])
            return time.perf_counter() - t0

        sync(weights, 1)  # warm-up: connection, first segment
        fixed = statistics.median(sync(one, v) for v in range(2, 2 + args.repeats * 3))
        whole = statistics.median(sync(weights, v) for v in range(100, 100 + args.repeats))
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        trainer_s, trainer_peak = _trainer_sync(path, url, args.repeats)
    finally:
        eproc.terminate()
        eproc.wait(timeout=30)
    result["fixed_s"], result["tiny_sync_s"] = fixed, whole
    print(f"  fixed cost of a sync into a CPU engine (pause, begin, 1 KB update, end, continue; one connection): "
          f"{fixed * 1e3:.1f} ms (target <= 20 ms)")
    print(f"  whole sync of the tiny model ({nbytes / 1e6:.1f} MB, shm): {whole * 1e3:.1f} ms")
    result["trainer_sync_s"], result["trainer_peak_extra_mb"] = trainer_s, trainer_peak / 2**20
    print(f"  the trainer's sync of it (TrainerWorker.sync_weights: gather, HF names, push; same buckets): "
          f"{trainer_s * 1e3:.1f} ms, {trainer_s / whole:.2f}x the push alone; peak extra RSS of the "
          f"trainer process {trainer_peak / 2**20:.1f} MB")
    big = max(sizes_mb)
    print(f"  targets: shm >= 0.5x memcpy at >= 100 MB (here {result[big]['shm'] / result[big]['memcpy']:.2f}x at "
          f"{big} MB); shm >= 10x pickle/HTTP (here {result[big]['shm'] / result[big]['pickle_http']:.1f}x)")
    return result


# ----------------------------------------------------------------------------------------------
# one RL step of the recipe as users run it (loongsage.py, its own process) vs TRL's GRPOTrainer, same model and batch

TRL = "trl==1.16.0"  # the TRL side's pin, in a venv of its own under the LoongSage cache (trl_venv)
# the recipe shrunk to TRL's batch: 8 prompts x 8 samples, 32 new tokens, one optimizer step of one micro-batch per
# RL step, on the 3.35M-parameter tiny Qwen3 (hidden 256) that both sides load from the dir the recipe builds
STEP_SET = ["warmstart_steps=0", "prompts_per_step=8", "samples_per_prompt=8", "max_new_tokens=32",
            "global_batch_size=64", "micro_batch_size=64", "eval_every=0", "print_every=0",
            "tiny_model.hidden_size=256", "tiny_model.head_dim=64", "tiny_model.intermediate_size=768"]
STEP_WARMUP = 2  # steps 0 and 1 pay first calls and an unsettled allocator: medians are over steps 2..N-1


def trl_venv() -> Path:
    """TRL's venv, built once as bootstrap.sh builds .venv (a CPU torch, TORCH_SPEC / TORCH_INDEX_URL as there; by
    default this venv's torch version, so both sides run the same kernels), then TRL and this venv's transformers."""
    import transformers  # the version to match
    venv = data.default_cache_dir() / f"venv-{TRL.replace('==', '-')}"
    if not (venv / "ready").exists():
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        index = ["--index-url", os.environ["TORCH_INDEX_URL"]] if os.environ.get("TORCH_INDEX_URL") else []
        for cmd in ([sys.executable, "-m", "venv", "--clear", str(venv)],
                    [*pip, *index, os.environ.get("TORCH_SPEC", f"torch=={torch.__version__.split('+')[0]}")],
                    [*pip, TRL, f"transformers=={transformers.__version__}", "datasets"]):
            print(f"step: building TRL's venv: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, check=True)
        (venv / "ready").write_text(TRL)
    return venv / "bin" / "python"


def trl_steps(model: str, dataset: str, steps: int, out: str, root: str) -> None:
    """Runs in TRL's venv (bench_step sends it this source): GRPOTrainer on the recipe's model, prompts and reward
    (data.py: it needs only torch and tokenizers), issue 47's configuration; at each on_step_end one JSON line: wall
    clock, the process's CPU seconds, the step's generation and scoring seconds, the 1-minute load."""
    # every import here is TRL's venv's: this function runs alone there
    import json, os, sys, time  # noqa: E401
    sys.path.insert(0, root)  # data.py: the recipe's dataset and reward (it needs only torch and tokenizers)
    import data  # from `root`
    import torch  # TRL's venv's, as the three below
    from datasets import Dataset  # TRL's dependency
    from transformers import TrainerCallback  # the version this venv has
    from trl import GRPOConfig, GRPOTrainer  # TRL, pinned
    torch.set_num_threads(2)

    def reward(completions, answer, **_):  # the recipe's reward on the decoded completion
        return [data.exact_match(c[-1]["content"], {"answer": a}) for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):  # the step's end; and, below, how long its generation and scoring took
        def on_step_end(self, args, state, control, **_):
            print("trl " + json.dumps({"wall": time.perf_counter(), "cpu": time.process_time(), "generate": gen[0],
                                       "load": os.getloadavg()[0]}), flush=True)

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *a, **k):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **k)
            gen[0] = time.perf_counter() - t0
            return out
    gen = [0.0]
    conf = GRPOConfig(output_dir=out, per_device_train_batch_size=64, num_generations=8, max_completion_length=32,
                      gradient_accumulation_steps=1, learning_rate=1e-3, max_steps=steps, beta=0.0, epsilon=0.2,
                      epsilon_high=0.28, temperature=1.0, max_grad_norm=1.0, logging_steps=1, report_to=[],
                      save_strategy="no", use_cpu=True, bf16=False, fp16=False, seed=1234, disable_tqdm=True,
                      gradient_checkpointing=False)  # TRL recomputes activations by default; the recipe does not
    rows = [{"prompt": s["messages"], "answer": str(s["answer"])} for s in data.load_dataset(dataset)]
    Timed(model=model, reward_funcs=reward, args=conf, train_dataset=Dataset.from_list(rows),
          callbacks=[Clock()]).train()


def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of process `root` and every process under it (a run's Ray daemons and
    actors are), by name: `controller` (root), `ray::<Actor>` (whatever method it runs now), others by program."""
    procs, tick = {}, os.sysconf("SC_CLK_TCK")
    for d in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):  # none without /proc (macOS)
        try:
            stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()  # state ppid ... utime(11) stime(12)
            cmd = open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:  # exited meanwhile
            continue
        procs[int(d)] = (int(stat[1]), (int(stat[11]) + int(stat[12])) / tick, cmd)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            cmd = procs[pid][2]
            name = ("controller" if pid == root else cmd[0].split(".")[0] if cmd[0].startswith("ray::") else
                    " ".join(Path(c).name for c in cmd[:2] if c and not c.startswith("-")))
            out[name] = out.get(name, 0.0) + procs[pid][1]
            todo += [p for p, (ppid, _, _) in procs.items() if ppid == pid]
    return out


def step_run(mode: str, out: Path, steps: int, extra: list[str]) -> dict:
    """`loongsage.py recipes/arith_cpu.yaml` (STEP_SET) as a process of its own; at each new metrics row its process
    tree's CPU time by process. Steps timed from the rows' time/wall; phases from their timing/* keys."""
    cmd = [sys.executable, "loongsage.py", "recipes/arith_cpu.yaml", *STEP_SET, f"num_steps={steps}", f"mode={mode}",
           f"output_dir={out}", *extra]
    print("step: " + " ".join(cmd[1:]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    t0, cpu, metrics = time.perf_counter(), [], out / "metrics.jsonl"
    with open(out.parent / f"{mode}.log", "w") as log:
        p = subprocess.Popen(cmd, cwd=Path(__file__).parent, stdout=log, stderr=subprocess.STDOUT)
        while p.poll() is None:  # at each new row: where the CPU went until it
            if (n := metrics.read_text().count("\n") if metrics.exists() else 0) > len(cpu):
                cpu += [(tree_cpu(p.pid), os.getloadavg()[0])] * (n - len(cpu))
            time.sleep(0.05)
    if p.returncode:
        raise SystemExit(f"step: the {mode} run failed (exit {p.returncode}); its log: {out.parent / f'{mode}.log'}")
    rows, a = [json.loads(x) for x in metrics.read_text().splitlines()], STEP_WARMUP - 1  # a: the row before step 2
    gaps = [r["time/wall"] - q["time/wall"] for q, r in zip(rows, rows[1:])][a:]
    phases = {k.split("/")[1]: statistics.median(r.get(k, 0.0) for r in rows[a + 1:]) for k in rows[-1]
              if k.startswith("timing/") or k.endswith("_core_s")}  # the trainer's phases: wall and core seconds
    phases["after timing/step: engine metrics, logging"] = statistics.median(gaps) - phases["step"]
    return {"step_s": statistics.median(gaps), "steps": gaps, "phases": phases, "wall_s": time.perf_counter() - t0,
            "cpu": {k: (v - cpu[a][0].get(k, 0.0)) / len(gaps) for k, v in cpu[-1][0].items()},
            "load": statistics.mean(c[1] for c in cpu[a:])}


def bench_step(args) -> dict:
    """Seconds per RL step of the recipe (sync, then async) and of TRL's GRPOTrainer (the module docstring)."""
    steps = 4 if args.quick else (args.steps or 12)
    out = Path(tempfile.mkdtemp(prefix="loongsage_bench_step_"))
    cfg = config.load_config("recipes/arith_cpu.yaml", STEP_SET)
    model = fleet.base_model(cfg)  # the HF dir (and tokenizer) the recipe builds, which loongsage.py loads too
    source = inspect.getsource(trl_steps) + f"\ntrl_steps(*{[model, cfg.dataset, steps, str(out / 'trl')]!r}, " \
        f"{str(Path(__file__).parent.resolve())!r})"
    t0 = time.perf_counter()
    log = subprocess.run([str(trl_venv()), "-c", source], capture_output=True, text=True)
    ticks = [json.loads(x[4:]) for x in log.stdout.splitlines() if x.startswith("trl {")]
    if log.returncode or len(ticks) != steps:
        raise SystemExit(f"step: TRL's run failed (exit {log.returncode}):\n{log.stderr[-3000:]}")
    gaps, timed = [b["wall"] - a["wall"] for a, b in zip(ticks, ticks[1:])][STEP_WARMUP - 1:], ticks[STEP_WARMUP:]
    result = {"trl": {"step_s": statistics.median(gaps), "steps": gaps, "wall_s": time.perf_counter() - t0,
                      "cpu": {"TRL": (ticks[-1]["cpu"] - ticks[STEP_WARMUP - 1]["cpu"]) / len(gaps)},
                      "load": statistics.mean(t["load"] for t in timed),
                      "phases": {"generate and score": statistics.median(t["generate"] for t in timed)}}}
    for mode in ("sync", "async"):
        result[mode] = step_run(mode, out / mode, steps, args.sync_set if mode == "sync" else args.async_set)
    print(f"step: {model}, 8 prompts x 8 samples, <= 32 new tokens, {steps} steps; median s/step of steps "
          f"{STEP_WARMUP}..{steps - 1} from each side's own wall clock")
    for side, r in result.items():
        ratio = "" if side == "trl" else f"  = {r['step_s'] / result['trl']['step_s']:.2f}x TRL's (target <= 0.8)"
        print(f"  {side:5s} {r['step_s']:.3f} s/step{ratio}   load {r['load']:.1f}, run {r['wall_s']:.0f} s, "
              f"CPU {sum(r['cpu'].values()):.2f} core-s/step")
    for side, r in result.items():
        print(f"  {side} phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items()))
        print(f"  {side} CPU by process (core-s/step): " + ", ".join(
            f"{k} {v:.3f}" for k, v in sorted(r["cpu"].items(), key=lambda kv: -kv[1]) if v >= 0.005))
    return result


# ----------------------------------------------------------------------------------------------
# Teacher Manager memory: a teacher group holding 1 vs 3 same-size teachers


def teacher_memory(workdir: str, hidden_size: int = 512, layers: int = 4) -> dict:
    """Build 3 same-size tiny Qwen3 teachers (different seeds), then in two fresh teacher processes
    register 1 resp. 3 of them and score one batch routed to all of them. Returns both processes'
    peak RSS and what the teachers added to it (peak minus the RSS before any model was built)."""
    paths = {f"t{i}": data.build_tiny_model(Path(workdir) / f"t{i}", hidden_size=hidden_size,
                                            num_hidden_layers=layers, intermediate_size=3 * hidden_size,
                                            num_attention_heads=8, num_key_value_heads=4, head_dim=64, seed=i)
             for i in range(3)}
    cfg = config.Config(teacher_tp=1, teacher_micro_batch=16, teacher_topk=8, teacher_route="", seed=0,
                           dtype="float32", megatron={}, gkd_ratio=0.0, distill_type="topk_kl", trainer_threads=0,
                           output_dir=workdir)
    tok = data.load_tokenizer(paths["t0"])
    batch = []
    for i, s in enumerate(data.arith_samples(48, 3)):
        r = tok.encode(s["answer"], add_special_tokens=False)
        batch.append({"prompt_ids": data.prompt_ids(tok, s), "response_ids": r, "loss_mask": [1] * len(r),
                      "group_id": i, "metadata": {"teacher": f"t{i % 3}"}})
    if not ray.is_initialized():  # a Ray the caller started (a test session's) is used as found
        ray.init(num_cpus=2, include_dashboard=False)
    Actor = ray.remote(teacher.TeacherWorker).options(num_cpus=1)
    out = {}
    for k in (1, 3):
        a = Actor.remote(cfg, 0, 1, "127.0.0.1", tm.free_port())
        ray.get(a.load_teachers.remote({n: paths[n] for n in list(paths)[:k]}, f"{workdir}/snap{k}"))
        b = [dict(s, metadata={"teacher": f"t{i % k}"}) for i, s in enumerate(batch)]
        _, m = ray.get(a.score.remote(b))
        mem = ray.get(a.memory.remote())
        out[k] = {"peak_rss_mb": mem["peak_rss_mb"], "added_mb": mem["peak_rss_mb"] - mem["base_rss_mb"],
                  "swaps": m["teacher/swaps"]}
        ray.kill(a)
    out["params_per_teacher"] = sum(t.numel() for t in convert.load_hf_state(paths["t0"]).values())
    out["peak_ratio"] = out[3]["peak_rss_mb"] / out[1]["peak_rss_mb"]
    out["added_ratio"] = out[3]["added_mb"] / out[1]["added_mb"]
    return out


def bench_pack(args) -> dict:
    """Trainer tokens/s of RL train steps on one long-tail batch, packed against padded (see the module docstring)."""
    import trainer  # Megatron: late (its import takes seconds)
    path = data.build_tiny_model(data.default_cache_dir() / "tiny-bench", hidden_size=256, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768)
    n, long_len, budget = (16, 128, 256) if args.quick else (32, 384, 1024)
    rng = random.Random(0)
    batch = []
    for i in range(n):  # groups of 4; every eighth response long (an agent's long trajectory), the rest short
        r = long_len if i % 8 == 5 else rng.randint(8, 32)
        resp = [rng.randrange(10, 300) for _ in range(r)]
        batch.append(dict(prompt_ids=[rng.randrange(10, 300) for _ in range(16)], response_ids=resp,
                          loss_mask=[1] * r, rollout_logprobs=[-5.0] * r, weight_versions=[0] * r,
                          reward=float(i % 2), status="ok", group_id=i // 4, sample_index=i % 4))
    real = sum(len(b["prompt_ids"]) + len(b["response_ids"]) for b in batch)
    cfg = config.load_config(None, [f"model_path={path}", "kl_coef=0", f"prompts_per_step={n // 4}",
                                    "samples_per_prompt=4", f"global_batch_size={n}", "micro_batch_size=8",
                                    f"max_tokens_per_micro_batch={budget}"])
    # padded rows are sorted by length within a mini-batch (trainer.plan_minibatches), so micro-batches of 8 put the
    # long samples together; one micro-batch of all the rows pads every short one to the longest
    layouts = {"padded_mb8": (0, 8), f"padded_mb{n}": (0, n), "packed": (budget, 8)}
    w = trainer.TrainerWorker(cfg, 0, 1, "127.0.0.1", tm.free_port())
    times, pad = {k: [] for k in layouts}, {}
    try:
        w.load_hf(path)
        for rep_i in range(args.repeats + 1):  # the first round warms every layout up and is left out
            for name, (max_tokens, rows) in layouts.items():
                w.policy.max_tokens, w.policy.micro_batch_size = max_tokens, rows
                t0 = time.perf_counter()
                m = w.train_step(batch, rep_i)
                if rep_i:
                    times[name].append(time.perf_counter() - t0)
                pad[name] = m["train/pad_frac"]
    finally:
        w.shutdown()
    out = {k: {"seconds": statistics.median(v), "tokens_per_s": real / statistics.median(v), "pad_frac": pad[k]}
           for k, v in times.items()}
    print(f"pack: {n} samples, {real} real tokens (one in eight {long_len} response tokens); RL train steps, median "
          f"of {args.repeats}")
    for k in layouts:
        out[k]["ratio"] = out["packed"]["tokens_per_s"] / out[k]["tokens_per_s"]
        print(f"  {k:11s} {out[k]['pad_frac']:4.0%} padding  {out[k]['seconds']:.2f} s per step  "
              f"{out[k]['tokens_per_s']:6.0f} tokens/s  packed is {out[k]['ratio']:.2f}x")
    print(f"  target: packed >= 2.0x the padded layout whose padding is >= 60% (padded_mb{n})")
    return out


def targets_memory(n: int = 4096, vocab: int = 32768, k: int = 8) -> dict:
    """Peak extra resident memory (MB) of turning (n, vocab) fp32 logits into top-k targets, in this process: the
    teacher's chunked path (teacher.TeacherWorker._topk, one rank) against the full path it replaced (log_softmax of
    every row, then top-k). The chunked one runs first, so the full one cannot reuse heap it freed."""
    from types import SimpleNamespace  # a stand-in for the one-rank TeacherWorker whose _topk this measures
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    one_rank = SimpleNamespace(par=SimpleNamespace(tp_rank=0, tp_size=1))
    out = {"logits_mb": logits.numel() * 4 / 2**20}
    for name, fn in (("chunked", lambda: teacher.TeacherWorker._topk(one_rank, logits, k)),
                     ("full", lambda: torch.log_softmax(logits, -1).topk(k, -1))):
        before = tm.rss_bytes()
        tm.reset_peak_rss()
        fn()
        out[f"{name}_mb"] = max(tm.peak_rss_bytes() - before, 0) / 2**20
    return out


def bench_teachers(args) -> dict:
    """`teacher_memory` (each group a new process), then `targets_memory`; a Ray it started is shut down after."""
    own = not ray.is_initialized()
    try:
        out = teacher_memory(args.workdir or tempfile.mkdtemp())
    finally:
        if own:
            ray.shutdown()
    print(f"teachers: {out['params_per_teacher'] / 1e6:.1f}M parameters each; peak RSS 1 teacher "
          f"{out[1]['peak_rss_mb']:.0f} MB, 3 teachers {out[3]['peak_rss_mb']:.0f} MB: {out['peak_ratio']:.2f}x "
          f"(added {out[1]['added_mb']:.0f} -> {out[3]['added_mb']:.0f} MB: {out['added_ratio']:.2f}x; target <= 1.3); "
          f"swaps {out[1]['swaps']:.0f} / {out[3]['swaps']:.0f}")
    out["targets"] = t = targets_memory()
    print(f"top-k targets of {t['logits_mb']:.0f} MB of logits (4096 x 32768, k=8): peak extra "
          f"{t['chunked_mb']:.0f} MB chunked (teacher.CHUNK_FLOATS) vs {t['full_mb']:.0f} MB full log-softmax")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", help="which benchmark: rollout | router | sync | step | async | agentic | modes | "
                   "teachers | pack")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=100, help="router bench: requests of each kind")
    p.add_argument("--engine-threads", type=int, default=1, help="router bench: the engine's torch threads")
    p.add_argument("--profile", default=None, metavar="FILE", help="router bench: write a cProfile (CPU clock) of the "
                   "measured pairs to FILE (read it with python -m pstats FILE)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (step: 12, async: 24, agentic: 16)")
    p.add_argument("--quick", action="store_true", help="sync/step: tiny sizes, a smoke test")
    p.add_argument("--prompts", type=int, default=None, help="async, agentic: prompts per step, 8 samples each "
                   "(async: 16, agentic: 8)")
    p.add_argument("--stale-steps", type=float, default=None, help="async, agentic, modes: the async run's "
                   "stale_steps (agentic: 2, the others: 1)")
    p.add_argument("--tool-median", type=float, default=0.3, help="agentic bench: median seconds of a tool call")
    p.add_argument("--tool-p99", type=float, default=5.0, help="agentic bench: 99th percentile seconds of a tool call")
    p.add_argument("--eval-prompts", type=int, default=128, help="agentic bench: prompts of each eval, 2 samples each")
    p.add_argument("--eval-every", type=int, default=None, help="agentic bench: steps of B prompts between evals (3)")
    p.add_argument("--target", type=float, default=0.6, help="agentic bench: the eval accuracy timed to")
    p.add_argument("--lrs", default="5e-4,1e-3", help="agentic bench: the learning rates each mode runs at")
    p.add_argument("--tool-seed", type=int, default=0, help="agentic bench: seed of the tool calls' durations")
    p.add_argument("--sync-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="async, agentic, step: sync run overrides")
    p.add_argument("--async-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="async, agentic, step: async run overrides")
    p.add_argument("--warmstart-steps", type=int, default=None, help="async, agentic: SFT steps of the warm start "
                   "(async: 400, agentic: the arith_cpu recipe's)")
    p.add_argument("--recipe", default="recipes/arith_cpu.yaml", help="modes bench: the recipe run in both modes")
    p.add_argument("--seed", type=int, default=None, help="modes, agentic: the run seed (modes: 1234, agentic: 2)")
    p.add_argument("--workdir", default=None, help="teachers bench: where the teachers are built (default: a temp dir)")
    args = p.parse_args(argv)
    if args.bench == "rollout":
        return bench_rollout(args)
    elif args.bench == "router":
        return bench_router(args)
    elif args.bench == "sync":
        return bench_sync(args)
    elif args.bench == "step":
        return bench_step(args)
    elif args.bench == "async":
        return bench_async(args)
    elif args.bench == "agentic":
        return bench_agentic(args)
    elif args.bench == "modes":
        return bench_modes(args)
    elif args.bench == "teachers":
        return bench_teachers(args)
    elif args.bench == "pack":
        return bench_pack(args)
    raise SystemExit(f"unknown benchmark {args.bench!r}; valid: rollout, router, sync, step, async, agentic, modes, "
                     "teachers, pack")


if __name__ == "__main__":
    main()
