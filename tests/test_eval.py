"""Eval metrics by hand: the unbiased pass@k estimator and mean@k over groups of k samples."""
import math

import pytest

import algos
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
