"""bench.py smoke runs: each benchmark through its command line (bench.main), at a tiny size, on the real parts
(the CPU engine and transformers generate, and vLLM where .venv-vllm exists; an engine process behind the router and the official OpenAI client;
every weight transport; LoongSage's own training loop).
They prove the benchmarks run and report what they say, not any speed: speed targets are ratios the
benchmarks print, never timed tests."""
import math
import os
import pstats
import re
import time

import pytest

import bench
import vllm_engine


def _numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.?\d*", line)]  # signed: an overhead may measure below 0


@pytest.mark.slow
def test_bench_rollout_smoke(capsys):
    """Both workloads run; the ratio is the engine's tok/s over transformers' of the same measurements (computed
    from the unrounded figures the benchmark returns, not the printed, rounded ones), and the printed line shows
    exactly those figures. With .venv-vllm, vLLM is a third column and one weight update is timed on both engines
    (the core vLLM's model runner uses said); without it, the column is left out saying why."""
    have_vllm = os.path.exists(os.environ.get("LOONGSAGE_VLLM_PYTHON") or vllm_engine.VENV / "bin" / "python")
    r = bench.main(["rollout", "--batch", "3", "--new-tokens", "3", "--prompt-len", "5", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "batch 3, prompt 5, new tokens 3" in out
    for workload in ("fixed", "varied"):
        w = r[workload]
        assert w["hf_tok_s"] > 0 and w["engine_tok_s"] > 0 and ("vllm_tok_s" in w) == have_vllm
        assert w["ratio"] == pytest.approx(w["engine_tok_s"] / w["hf_tok_s"], rel=1e-9)
        [line] = [x for x in out.splitlines() if x.strip().startswith(workload)]
        assert (f"generate {w['hf_tok_s']:7.0f} tok/s, CPU engine {w['engine_tok_s']:7.0f} tok/s, "
                f"ratio {w['ratio']:.2f}x" + (f"; vLLM {w['vllm_tok_s']:7.0f} tok/s" if have_vllm else "")) in line
    if have_vllm:
        assert r["update"]["engine"] > 0 and r["update"]["vllm"] > 0
        assert re.search(r"vLLM's model runner: core ids=\[\d+(, \d+)*\] of \d+ cores", out), out
    else:
        assert "no vLLM column: engine=vllm needs" in out
    assert re.search(r"fixed +lengths \(3-3 tokens\)", out)  # every request exactly new_tokens long


@pytest.mark.slow
def test_bench_router_smoke(capsys, tmp_path):
    """Wall and CPU overheads are reported in each view, and they nest: per request the router's own overhead is
    what is outside the engine call less the SDK's own work, so (the SDK taking time) every order statistic of it is
    below the outside one; the profile of the measured pairs holds the router's handler."""
    r = bench.main(["router", "--requests", "8", "--repeats", "1", "--profile", str(tmp_path / "router.prof")])
    out = capsys.readouterr().out
    assert "router: 8 request pairs" in out and "engine on 1 torch thread(s)" in out
    p50, p99 = _numbers(out.split("router overhead per request")[1].splitlines()[0])[1::2][:2]  # after "p50", "p99"
    assert p50 == pytest.approx(r["router_wall_p50_s"] * 1e3, abs=0.006) and p50 <= p99
    for view in ("pair", "outside", "sdk", "router"):
        for clock in ("wall", "cpu"):
            assert r[f"{view}_{clock}_p50_s"] <= r[f"{view}_{clock}_p99_s"], (view, clock)
    assert r["sdk_cpu_p50_s"] > 0
    for q in ("p50", "p99"):
        assert r[f"router_wall_{q}_s"] < r[f"outside_wall_{q}_s"] and r[f"router_cpu_{q}_s"] < r[f"outside_cpu_{q}_s"]
        assert r[f"router_ratio_{q}"] == pytest.approx(r[f"router_wall_{q}_s"] / r["gen64_s"])
    assert "where the routed request's CPU over the direct one went" in out
    assert 0 < r["app_alone_cpu_p50_s"] <= r["app_alone_cpu_p99_s"] and "the router's own code (its app" in out
    assert any(fn == "chat_completions" for _, _, fn in pstats.Stats(str(tmp_path / "router.prof")).stats)


def test_bench_unknown_name():
    with pytest.raises(SystemExit, match="unknown benchmark 'nope'"):
        bench.main(["nope"])


@pytest.mark.slow
def test_sync_bench_measures_every_transport_and_the_fixed_cost():
    r = bench.main(["sync", "--quick", "--repeats", "1"])
    assert sorted(k for k in r if isinstance(k, int)) == [1, 4]  # --quick sizes, in MB
    for mb in (1, 4):
        assert set(r[mb]) == {"memcpy", "shm", "broadcast", "disk", "pickle_http"}
        assert all(0 < v < math.inf for v in r[mb].values())
    assert 0 < r["fixed_s"] < math.inf and 0 < r["tiny_sync_s"] < math.inf  # measured, whatever the machine's speed


@pytest.mark.slow
def test_step_bench_times_both_sides_from_outside(capsys):
    """bench step --quick (4 steps each): TRL's GRPOTrainer in its own venv, then loongsage.py on the recipe in
    both modes. Each side's s/step is the median of its own wall-clock intervals over steps 2..3, the ratio printed
    is theirs; LoongSage's interval holds its timing/step, the trainer's phases fit in its train phase, and the
    run's process tree shows the trainer, the engine and AgentFlow at work."""
    if not (bench.data.default_cache_dir() / f"venv-{bench.TRL.replace('==', '-')}" / "ready").exists():
        pytest.skip("TRL's venv is absent: `python bench.py step --quick` builds it (pip, from PyPI)")
    r = bench.main(["step", "--quick"])
    out = capsys.readouterr().out
    for side in ("trl", "sync", "async"):
        assert len(r[side]["steps"]) == 2 and r[side]["step_s"] == pytest.approx(sum(r[side]["steps"]) / 2)
        assert r[side]["load"] >= 0 and r[side]["wall_s"] > sum(r[side]["steps"])
    for mode in ("sync", "async"):
        ph, cpu = r[mode]["phases"], r[mode]["cpu"]
        assert ph["step"] > 0 and ph["after timing/step: engine metrics, logging"] >= 0
        assert 0 < ph["trainer_step"] <= ph["train"] and ph["trainer_forward"] + ph["trainer_backward"] > 0
        assert cpu["ray::TrainerWorker"] > 0 and cpu["ray::RolloutEngine"] > 0 and cpu["ray::AgentFlow"] > 0
        assert f"{r[mode]['step_s'] / r['trl']['step_s']:.2f}x TRL's" in out


def test_longtail_task_has_a_tail_and_its_labels_earn_the_reward(tiny_model_dir):
    """bench async's long-tail task: three answers in four are short, the rest count down from the prompt's letter
    (so the length follows a rule the warm start can teach), and every noise-free label ends with the answer, so
    it earns the reward the RL runs use (data.last_number_match)."""
    import data
    tok = data.load_tokenizer(tiny_model_dir)
    samples = bench.longtail_samples(400, seed=3)
    lens = []
    for s in samples:
        t = bench.longtail_sft(tok, s, None, 0.0)
        text = tok.decode(t["response_ids"][:-1])
        letter = s["messages"][0]["content"].split()[-1]
        assert text.split() == [chr(c) for c in range(ord(letter), ord("a") - 1, -1)] + [s["answer"]]
        assert data.last_number_match(text, s) == 1.0 and t["loss_mask"] == [1] * len(t["response_ids"])
        lens.append(len(t["response_ids"]))
    short = sum(n <= 5 for n in lens) / len(lens)
    assert 0.65 < short < 0.85 and max(lens) >= 35 and min(n for n in lens if n > 5) >= 15


@pytest.mark.slow
def test_teachers_bench_3_teachers_fit_in_the_memory_of_1(tmp_path, capsys, ray_session):  # the session's Ray
    """Three 13M-parameter teachers (52 MB each): a group holding 3 peaks within 1.3x of a group holding 1,
    both in total RSS and in what the teachers add over the process's RSS before any model, and with a batch
    routed to all 3 each loads at most once (swaps = 2: the resident one needs none). Holding all three resident
    would add 2 x 52 MB to the ~140 MB one teacher adds (ratio ~1.74); the swap's transient buffers and the
    snapshot file's mapped pages measured 1.00-1.21 over repeated runs, hence 1.3."""
    out = bench.main(["teachers", "--workdir", str(tmp_path)])
    assert out["params_per_teacher"] > 10_000_000
    assert out[3]["swaps"] == 2 and out[1]["swaps"] == 0  # batch routed to all 3: each loaded at most once
    assert out["peak_ratio"] <= 1.3 and out["added_ratio"] <= 1.3, out
    assert f"{out['peak_ratio']:.2f}x" in capsys.readouterr().out
    # top-k targets: the full path holds a second copy of the 512 MB of logits; the chunked one a 64 MB chunk or two
    t = out["targets"]
    assert t["full_mb"] >= 0.9 * t["logits_mb"] and t["chunked_mb"] <= 0.35 * t["logits_mb"], t


def test_pack_bench_smoke():
    """bench pack runs every layout on one trainer rank and reports what it says: no padding computed when packed,
    some with length-sorted micro-batches of 8, >= 60% with one micro-batch of every row (the target's baseline),
    and the ratios against the packed layout's tokens/s. No speed is asserted."""
    out = bench.main(["pack", "--quick", "--repeats", "1"])
    assert out["packed"]["pad_frac"] == 0.0 and 0.0 < out["padded_mb8"]["pad_frac"] < out["padded_mb16"]["pad_frac"]
    assert out["padded_mb16"]["pad_frac"] >= 0.6
    for k in ("padded_mb8", "padded_mb16"):
        assert out[k]["ratio"] == pytest.approx(out["packed"]["tokens_per_s"] / out[k]["tokens_per_s"])


def test_calc_tool_latency_is_the_lognormal_asked_for():
    """The calc agent's calculator waits what bench agentic asks for: over 20,000 draws at median 0.3 s and
    p99 5 s (sigma from bench's formula) the median lands within 3% of 0.3 and the 99th percentile within 10% of 5,
    and a (seed, question, draw) always waits the same while another seed or draw does not, so sync and async runs
    of the same questions wait alike whatever order their trajectories reach the tool."""
    import statistics
    from recipes import calc
    sigma = math.log(5.0 / 0.3) / 2.3263
    lat = {"median": 0.3, "sigma": sigma, "seed": 0}
    draws = sorted(calc.tool_seconds(lat, "q", i) for i in range(20000))
    assert statistics.median(draws) == pytest.approx(0.3, rel=0.03)
    assert draws[int(0.99 * len(draws))] == pytest.approx(5.0, rel=0.10)
    assert calc.tool_seconds(lat, "q", 7) == calc.tool_seconds(lat, "q", 7)
    assert calc.tool_seconds(lat, "q", 7) != calc.tool_seconds({**lat, "seed": 1}, "q", 7)
    assert calc.tool_seconds(lat, "q", 7) != calc.tool_seconds(lat, "q", 8)


def test_calc_agent_waits_on_the_slow_tool():
    """With `tool_latency` (sigma 0: every call takes exactly 0.2 s) the calc agent sleeps before each tool result
    and reports what it waited; without it, it answers the bare reply as before. The model's side is a scripted
    client (a tool call, then an answer): the agent's loop is what is tested here; through the real router and
    engine it runs in test_bench_agentic_smoke and tests/test_agentflow.py."""
    import asyncio
    import types
    from recipes import calc
    replies = []

    async def create(model, messages, tools):
        call = types.SimpleNamespace(id="c1", function=types.SimpleNamespace(name="calculator",
                                                                            arguments='{"expression": "6*7"}'))
        first = not any(m["role"] == "tool" for m in messages)
        replies.append(list(messages))  # as sent: the agent appends to its list after
        msg = types.SimpleNamespace(content="" if first else "42", tool_calls=[call] if first else None)
        return types.SimpleNamespace(choices=[types.SimpleNamespace(message=msg)])
    client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=types.SimpleNamespace(create=create)))
    sample = {"messages": [{"role": "user", "content": "6*7"}], "answer": "42"}
    t0 = time.perf_counter()
    out = asyncio.run(calc.agent(client, {**sample, "tool_latency": {"median": 0.2, "sigma": 0.0, "seed": 0}}))
    assert time.perf_counter() - t0 >= 0.2 and out == {"answer": "42", "tool_s": pytest.approx(0.2)}
    assert replies[-1][-1] == {"role": "tool", "tool_call_id": "c1", "content": "42"}  # the tool ran, then answered
    assert asyncio.run(calc.agent(client, sample)) == "42"


@pytest.mark.slow
def test_bench_agentic_smoke(capsys, ray_session):  # the session's Ray: no start-up per mode
    """bench agentic runs its three runs (sync at B, sync at C prompts, async) through the calc agent on the untrained
    tiny model, small, and reports what it says: every run's eval curve finite and in [0, 1], the same trained
    samples in each, async's lag within its bound of 2 and sync's 0, every line of the report, the headline naming
    the best sync baseline. No speed is asserted."""
    r = bench.main(["agentic", "--steps", "2", "--prompts", "2", "--stale-steps", "1", "--warmstart-steps", "0",
                    "--tool-median", "0.05", "--tool-p99", "0.5", "--eval-prompts", "8", "--eval-every", "1",
                    "--lrs", "1e-3", "--target", "0.5"])
    out = capsys.readouterr().out
    assert "bench agentic: calc agent, calculator lognormal (median 0.05 s, p99 0.5 s, seed 0), 2 steps x 2 prompts" \
        in out and "target 0.5 on 8 prompts x 2 samples" in out
    assert set(r["runs"]) == {("sync", "1e-3"), ("sync-4", "1e-3"), ("async", "1e-3")}
    for name in ("sync", "sync-4", "async"):
        m = r[name]
        assert m["trained"] == 2 * 2 * 8 and m["lr"] == 1e-3
        assert len(m["curve"]) >= 2 and all(math.isfinite(a) and 0 <= a <= 1 for _, _, a in m["curve"])
        assert m["curve"][-1][0] == m["trained"] and m["curve"][-1][1] == pytest.approx(m["wall_s"])
        assert m["lag_max"] <= (2 if name == "async" else 0) and m["generate_s"] > 0 and m["tool_s"] >= 0
        assert m["time"]["generate"] + m["time"]["train"] + m["time"]["sync"] <= m["wall_s"] + 1e-6
        assert f"  {name} lr 1e-3: eval (samples, s, accuracy) (0, 0, " in out
        assert f"RL loop {m['wall_s']:.1f} s for {m['trained']:.0f} trained samples" in out
        assert f"{name:>8s} (lr 0.001): eval {m['eval_start']:.3f} -> {m['eval_end']:.3f}, time to 0.5 " in out
    assert r["best_sync"] in ("sync", "sync-4") and out.count("s waiting on the calculator + ") == 3
    assert re.search(r"async reaches 0\.5 (\d+\.\d\dx sooner than|-- \(one of them never did\) --) the best sync "
                     r"baseline \(sync(-4)?\), at \d+\.\d\dx its trained samples/s .*; at most \d+\.\d\dx here: "
                     r"sync(-4)?'s RL loop \d+ s over async's training \d+ s", out)
    assert r["ceiling"] == pytest.approx(min(r["sync"]["wall_s"], r["sync-4"]["wall_s"]) / r["async"]["time"]["train"])
    fits = [r[n]["fit_s"] for n in ("sync", "sync-4", "async")]  # a line fitted to the evals: None where none rose
    assert r["fitted"] == (pytest.approx(min(fits[:2]) / fits[2]) if all(fits) else None)
    assert re.search(r"  fitted: (async \d+\.\d\dx sooner than the best sync baseline \(async \d|"
                     r"-- \(a run's evals)", out)
