"""The router of the flood drill (tests/test_recover.py, test_router_flood_...): AgentFlow's Router serving
OpenAI chat completions on loopback, in a process of its own so that its memory is measured alone.

TEST DOUBLE: an echo engine stands in for the model (the pool's generate), because on a shared 2-core machine 6,000
generations of the tiny model would dominate the drill and measure the engine, not the router. It decodes the prompt
the router rendered, finds the last turn's nonce ("n<session>x<hex> t<turn>") and answers "<that> ok" (streamed as
SGLang's cumulative chunks when the router streams), after a short sleep standing in for generation. Everything
else is real: the HTTP server, the sessions, the chat template, the tokenizer, the trajectories.

Run: `python tests/flood_router.py MODEL_DIR`. It prints {"url": ...}, then answers commands, one JSON line each
on stdin, with one JSON line on stdout:
  {"open": n}     -> {"sessions": [[id, api_key], ...]}   n new sessions
  {"close": true} -> {"texts": {id: text}}                 every session closed; the decoded text of each
                                                          trajectory (every segment, special tokens kept)
  {"rss": true}   -> {"rss": bytes, "peak": bytes,        now, the peak since the last "rss" (VmHWM), and the
                      "alive": n}                          Session objects still alive (after a gc)
"""
import asyncio
import gc
import json
import random
import re
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import agentflow  # noqa: E402
import chat  # noqa: E402
import rollout  # noqa: E402
import transfermesh  # noqa: E402

NONCE = re.compile(r"n\d{4}x[0-9a-f]{6} t\d")


def echo_engine(pool: rollout.EnginePool, fmt: chat.ChatFormat) -> None:
    async def generate(input_ids, sampling_params, rid, prefer=None, batch="", on_chunk=None):
        await asyncio.sleep(random.uniform(0.01, 0.05))  # generation time
        text = NONCE.findall(fmt.decode(list(input_ids)))[-1] + " ok"
        ids = fmt.encode(text) + [fmt.eos_id]
        for n in range(1, len(ids)) if on_chunk else ():
            on_chunk({"output_ids": ids[:n], "meta_info": {"finish_reason": None, "prompt_tokens": len(input_ids)}})
            await asyncio.sleep(0)
        return "echo", {"text": text, "output_ids": ids, "meta_info": {
            "finish_reason": {"type": "stop"}, "weight_version": "0",
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}}
    pool.generate = generate


async def main(model_dir: str) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per session in flight
    fmt = chat.ChatFormat(model_dir)
    pool = rollout.EnginePool(["http://127.0.0.1:9"])  # never called: the echo engine answers
    echo_engine(pool, fmt)
    router = agentflow.Router(pool, fmt)
    print(json.dumps({"url": await router.start()}), flush=True)
    loop, opened = asyncio.get_running_loop(), []
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        if "open" in cmd:
            opened += [router.open_session(sampling=dict(temperature=1.0, max_new_tokens=16), max_context_len=512,
                                           max_turns=8) for _ in range(cmd["open"])]
            answer = {"sessions": [[s.id, s.api_key] for s in opened[-cmd["open"]:]]}
        elif "close" in cmd:
            await asyncio.gather(*(router.close_session(s) for s in opened))
            answer = {"texts": {s.id: "".join(fmt.decode(seg["prompt_ids"] + seg["response_ids"], False)
                                              for seg in s.trajectory(0.0).segments) for s in opened}}
            opened = []
        else:
            gc.collect()
            answer = {"rss": transfermesh.rss_bytes(), "peak": transfermesh.peak_rss_bytes(),
                      "alive": sum(type(o) is agentflow.Session for o in gc.get_objects())}
            transfermesh.reset_peak_rss()
        print(json.dumps(answer), flush=True)
        del answer
    await router.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
