"""The asynchronous benchmark's arithmetic (tests.bench.async_pools.summarize), on made-up runs."""

import pytest

from tests.bench.async_pools import Settings, summarize

pytestmark = pytest.mark.unit


def _run(steps, evals, generate=(), train=()):
    return {"step_seconds": steps, "eval": evals, "generate_seconds": list(generate), "train_seconds": list(train)}


def test_floor_ratio_speedup_and_spread():
    s = Settings(steps=4, eval_every=2, seeds=(0, 1), warmup_steps=2)
    runs = {
        "sync": [_run([9, 9, 10, 10], [(0, 0.1), (2, 0.2), (4, 0.30)]),
                 _run([9, 9, 12, 12], [(0, 0.1), (2, 0.3), (4, 0.50)])],
        "async": [_run([9, 8, 6, 6.6], [(0, 0.1), (2, 0.1), (4, 0.35)], generate=[5, 5, 5, 6], train=[4, 4, 6, 6]),
                  _run([9, 8, 6, 6.6], [(0, 0.1), (2, 0.2), (4, 0.45)], generate=[5, 5, 5, 6], train=[4, 4, 6, 6])],
    }
    out = summarize(s, runs)
    assert out["sync"]["median_step_seconds"] == 11.0  # median of 10, 10, 12, 12
    assert out["async"]["median_step_seconds"] == pytest.approx(6.3)
    assert out["async"]["median_step_over_floor"] == pytest.approx(1.05)  # 6/6 = 1.0, 6.6/6 = 1.1
    assert out["speedup"] == pytest.approx(11.0 / 6.3)
    # step 2: async mean 0.15 is below sync's 0.2..0.3; step 4: 0.40 within 0.30..0.50
    assert out["async_mean_within_sync_spread"] == {"0": True, "2": False, "4": True}
    assert out["async_mean_at_least_sync_min"] == {"0": True, "2": False, "4": True}
    assert out["final_step"] == 4


def test_an_async_mean_above_syncs_spread_is_outside_it_but_not_below_it():
    s = Settings(steps=2, eval_every=2, seeds=(0, 1), warmup_steps=0)
    runs = {"sync": [_run([1, 1], [(0, 0.1), (2, 0.2)]), _run([1, 1], [(0, 0.1), (2, 0.3)])],
            "async": [_run([1, 1], [(0, 0.1), (2, 0.4)], [1, 1], [1, 1]),
                      _run([1, 1], [(0, 0.1), (2, 0.36)], [1, 1], [1, 1])]}
    out = summarize(s, runs)
    assert out["async_mean_within_sync_spread"]["2"] is False  # 0.38 > 0.3
    assert out["async_mean_at_least_sync_min"]["2"] is True
    # the targets table's row names the seed count the result was measured with
    from dataclasses import asdict

    from tests.bench.notes import async_target_rows

    converge = async_target_rows({"settings": asdict(s), "runs": runs})[1]
    assert converge == ["async held-out score mean within sync's seed spread at every eval step (2 seeds each)",
                        "within at 1 of 2 eval steps (outside at 2: above, none below)", "**missed**"]
