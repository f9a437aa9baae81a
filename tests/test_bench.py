"""bench.py smoke runs: each benchmark through its command line (bench.main), at a tiny size, on the real parts
(the CPU engine and transformers generate; an engine process behind the router and the official OpenAI client).
They prove the benchmarks run and report what they say, not any speed: speed targets are ratios the
benchmarks print, never timed tests."""
import re

import pytest

import bench


def _numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+\.?\d*", line)]


def test_bench_rollout_smoke(capsys):
    bench.main(["rollout", "--batch", "3", "--new-tokens", "3", "--prompt-len", "5", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "batch 3, prompt 5, new tokens 3" in out
    for workload in ("fixed", "varied"):  # both workloads ran, every figure positive
        [line] = [x for x in out.splitlines() if x.strip().startswith(workload)]
        hf, engine, ratio = _numbers(line.split("transformers generate")[1])[:3]
        assert hf > 0 and engine > 0 and ratio == pytest.approx(engine / hf, rel=0.02), line
    assert re.search(r"fixed +lengths \(3-3 tokens\)", out)  # every request exactly new_tokens long


def test_bench_router_smoke(capsys):
    bench.main(["router", "--requests", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "router: 4 request pairs" in out
    p50, p99 = _numbers(out.split("router overhead per request:")[1].splitlines()[0])[1::2][:2]
    assert p50 <= p99


def test_bench_unknown_name():
    with pytest.raises(SystemExit, match="unknown benchmark 'nope'"):
        bench.main(["nope"])
