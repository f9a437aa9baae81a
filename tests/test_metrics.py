"""Metrics: the unbiased pass@k estimator and mean@k by hand; every sink of the Logger (JSONL, TensorBoard, W&B
offline, MLflow file store) receives the same numbers, read back from each (TensorBoard's scalars as float32, and
the per-token lags, which only TensorBoard gets, as histograms)."""
import glob
import json
import math
import struct
import time

import pytest

import algos
import config
import fleet
import loongsage


def test_pass_at_k_by_hand():
    # n=4 samples, c=1 passes: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; pass@4 = 1
    assert algos.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert algos.pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert algos.pass_at_k(4, 1, 4) == 1.0
    assert algos.pass_at_k(5, 0, 3) == 0.0
    # n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert algos.pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    with pytest.raises(ValueError, match="0 < k <= n"):
        algos.pass_at_k(2, 1, 3)


def test_eval_metrics_mean_and_pass_at_k():
    trajs = [{"group_id": g, "reward": r, "response_ids": [1] * (g + 1)}
             for g, rs in enumerate([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0.5, 1]]) for r in rs]
    m = loongsage.eval_metrics(trajs, 4, "eval/x/")
    assert m["eval/x/accuracy"] == pytest.approx(4.5 / 12)  # mean@4 counts partial rewards
    assert m["eval/x/pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)  # 0.5 does not pass
    assert m["eval/x/pass@2"] == pytest.approx((0.5 + 0 + 1.0) / 3)
    assert m["eval/x/pass@4"] == pytest.approx(2 / 3)
    assert set(k for k in m if "pass@" in k) == {"eval/x/pass@1", "eval/x/pass@2", "eval/x/pass@4"}
    assert "eval/pass@1" not in loongsage.eval_metrics(trajs[:1], 1)  # k = 1: mean only
    assert m["eval/x/multi_turn_frac"] == 0.0  # no metadata: one turn each
    for t, turns in zip(trajs, [2, 1, 3] + [1] * 9):  # an agent's samples: 2 of 12 spoke more than once
        t["metadata"] = {"turns": turns}
    assert loongsage.eval_metrics(trajs, 4)["eval/multi_turn_frac"] == pytest.approx(2 / 12)


def read_wandb_offline(path: str) -> list[dict]:
    """History rows of an offline W&B run file (`run-*.wandb`: a 7-byte header, then records in 32 KiB blocks,
    each chunk `crc32c(4) length(2) type(1)`, type 1 full / 2 first / 3 middle / 4 last; a record is a
    wandb_internal Record protobuf)."""
    from wandb.proto import wandb_internal_pb2 as pb
    raw, pos, block, chunks, rows = open(path, "rb").read(), 7, 32768, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        chunks, pos = chunks + raw[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


@pytest.mark.slow
def test_every_tracker_gets_the_same_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config.load_config(None, [f"output_dir={tmp_path}/run", "trackers=[wandb, mlflow]", "tracker_project=t"])
    logger = fleet.Logger(cfg)
    for step in range(3):
        logger.log(step, {"train/loss": 1.0 / (step + 1), "eval/pass@2": 0.25 * step, "rollout/lag": [0, 1, 1]})
    logger.close()
    want = [{"train/loss": 1.0 / (s + 1), "eval/pass@2": 0.25 * s} for s in range(3)]
    jsonl = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [{k: r[k] for k in want[0]} for r in jsonl] == want and all("rollout/lag" not in r for r in jsonl)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(tmp_path / "run/tb"), size_guidance={"histograms": 0}).Reload()  # 0: keep every one
    for k in want[0]:
        assert [(e.step, e.value) for e in tb.Scalars(k)] == [(s, pytest.approx(w[k], rel=1e-6)) for s, w in
                                                              enumerate(want)], k
    assert [(h.step, h.histogram_value.num, h.histogram_value.sum) for h in tb.Histograms("rollout/lag")] == \
        [(s, 3, 2) for s in range(3)]
    [wb] = glob.glob(str(tmp_path / "run/wandb/offline-run-*/run-*.wandb"))
    rows = read_wandb_offline(wb)
    assert [{k: r[k] for k in want[0]} for r in rows] == want and [r["_step"] for r in rows] == [0, 1, 2]
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=(tmp_path / "run/mlruns").resolve().as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.data.params["tracker_project"] == "t"
    hist = client.get_metric_history(run.info.run_id, "eval/pass_at_2")  # '@' is not allowed in MLflow names
    assert [(m.step, m.value) for m in hist] == [(s, 0.25 * s) for s in range(3)]


def test_every_row_carries_its_wall_clock_time(tmp_path):
    """Every row, in memory and in metrics.jsonl, carries `time/wall`: seconds from the run's start to the row's
    write, so a step can be timed from outside the run's own timers. Rows logged as train() logs them (each step's
    own timing/step measured inside it) give intervals no shorter than the step they close, and the first row's
    value counts from `start`, not from when the Logger opened (train() opens it after the actors start)."""
    start = time.perf_counter()
    time.sleep(0.05)  # the actors' start-up, before the Logger opens
    logger = fleet.Logger(config.load_config(None, [f"output_dir={tmp_path}/run"]), start=start)
    logger.log(0, {"eval/accuracy": 0.5})  # eval before training: a row without timing/step
    for step in range(3):
        t_step = time.perf_counter()
        time.sleep(0.02 * (step + 1))  # the step's work
        logger.log(step, {"timing/step": time.perf_counter() - t_step})
        time.sleep(0.01)  # what follows the row (the log line, a checkpoint) belongs to the next interval
    logger.close()
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["time/wall"] for r in rows] == [r["time/wall"] for r in logger.history]
    wall = [r["time/wall"] for r in rows]
    assert wall[0] >= 0.05 and all(b > a for a, b in zip(wall, wall[1:])), wall
    for prev, row in zip(rows[1:], rows[2:]):  # a step's interval holds its timing/step and the 0.01 s after it
        assert row["time/wall"] - prev["time/wall"] >= row["timing/step"] + 0.01 > 0.02, (prev, row)
    assert time.perf_counter() - start >= wall[-1] + 0.01


def test_unknown_or_missing_tracker_is_a_config_error():
    with pytest.raises(ValueError, match="'wandbb' is not a tracker.*did you mean 'wandb'"):
        config.load_config(None, ["trackers=[wandbb]"])
