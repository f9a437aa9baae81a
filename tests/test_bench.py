"""Smoke runs of bench.py's commands at tiny sizes: each runs end to end on the real parts and returns numbers
that hang together. Speed targets are not asserted here (the machines are shared); bench.py prints them."""
import math

import bench


def test_rollout_bench_runs_both_workloads():
    r = bench.main(["rollout", "--batch", "4", "--new-tokens", "4", "--prompt-len", "4", "--repeats", "1"])
    for name in ("fixed", "varied"):  # inside, each side is checked to produce exactly the planned lengths
        assert r[name]["hf_tok_s"] > 0 and r[name]["engine_tok_s"] > 0
        assert math.isclose(r[name]["ratio"], r[name]["engine_tok_s"] / r[name]["hf_tok_s"], rel_tol=1e-9)


def test_sync_bench_measures_every_transport_and_the_fixed_cost():
    r = bench.main(["sync", "--quick", "--repeats", "1"])
    assert sorted(k for k in r if isinstance(k, int)) == [1, 4]  # --quick sizes, in MB
    for mb in (1, 4):
        assert set(r[mb]) == {"memcpy", "shm", "broadcast", "disk", "pickle_http"}
        assert all(0 < v < math.inf for v in r[mb].values())
    assert 0 < r["fixed_s"] < 60 and 0 < r["tiny_sync_s"] < 60


def test_step_bench_reports_phases_within_the_step():
    r = bench.main(["step", "--quick"])
    for mode in ("sync", "async"):
        ph = r[mode]
        assert ph["step"] > 0 and ph["train"] > 0 and ph["sync"] > 0
        # the phases are parts of the step (medians of each over the same steps: allow a little slack)
        assert ph["generate"] + ph["train"] + ph["sync"] <= ph["step"] * 1.05 + 0.05
    assert "trl" not in r or r["trl"] > 0
