"""Reduced versions of the benchmarks with the issue's targets as assertions.

    PYTHONPATH=worker_image:operator:. python -m pytest -m bench tests/bench

The full measurements, with every table and plot, come from
``python -m tests.bench.report`` (docs/benchmarks.md). Targets the runtime
misses today are ``xfail(strict=False)`` with the reason measured in the
report, so a fix shows up as XPASS instead of going unnoticed.
"""

import json

import pytest

from tests.bench import balancer, double_buffer, funnel, render, report, scaling_model

pytestmark = [pytest.mark.bench, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def funnel_at_8_ranks():
    return funnel.run(world_sizes=(8,), nominals=(16384,), repeats=5)


def test_busiest_rank_moves_at_most_1_25_over_n_of_the_centralized_bytes(funnel_at_8_ranks):
    (row,) = render.funnel_rows(funnel_at_8_ranks)
    assert row["identical"]
    assert row["bytes_ratio"] <= 1.25 / 8


@pytest.mark.xfail(strict=False, reason="on 2 shared cores the bare collectives themselves give ~2-3x; "
                                        "3 metadata all-gathers and replicated planning dilute it further "
                                        "(docs/benchmarks.md, section 1)")
def test_distributed_edge_is_5x_faster_than_centralized_at_8_ranks_16k_tokens(funnel_at_8_ranks):
    (row,) = render.funnel_rows(funnel_at_8_ranks)
    assert row["speedup"] >= 5


def test_no_rank_holds_the_batch_during_a_distributed_edge(funnel_at_8_ranks):
    per_rank = funnel_at_8_ranks["memory"]["per_rank"]
    dist_growth = [r["distflow"] for r in per_rank]
    assert max(dist_growth) < 2 * min(dist_growth) + (1 << 20)
    assert per_rank[0]["centralized"] > 3 * max(dist_growth)


def test_lpt_is_within_1_percent_of_the_bound_at_16_samples_per_rank_and_beats_kk_at_4():
    rows = balancer.imbalance_table(seeds=2, dp_sizes=(8, 64), per_rank=(4, 16))
    dense = [r for r in rows if r["method"] == "lpt" and r["per_rank"] == 16]
    assert max(r["vs_bound_worst"] for r in dense) <= 1.01
    kk = {(r["dataset"], r["dp"]): r["vs_bound_mean"] for r in rows
          if r["method"] == "karmarkar_karp" and r["per_rank"] == 4}
    for r in rows:
        if r["method"] == "lpt" and r["per_rank"] == 4:
            assert r["vs_bound_mean"] <= kk[(r["dataset"], r["dp"])] + 1e-9


def test_runtime_plans_4096_samples_over_64_ranks_in_under_10_ms():
    timings = balancer.planning_times(repeats=5)["seconds"]
    assert max(t["lpt"] for t in timings.values()) < 0.010


def test_double_buffer_swap_is_flat_and_frees_in_the_background():
    rows = double_buffer.run(repeats=3, sizes=(1 << 20, 1 << 28))["rows"]
    assert max(r["swap_seconds"] for r in rows) < 1e-3
    big = rows[-1]
    assert big["inline_free_seconds"] > 10 * big["swap_seconds"]
    assert big["rss_returned_bytes"] > 0.9 * big["bytes"]


def _saved_results() -> dict:
    if not report.RESULTS.exists():
        pytest.skip("no docs/benchmarks/results.json: run python -m tests.bench.report first")
    return json.loads(report.RESULTS.read_text())


def test_projected_efficiency_at_512_gpus_is_at_least_95_percent():
    results = _saved_results()
    stale = [n for n in ("funnel", "balancer") if render.stale_reason(n, results.get(n, {}).get("result", {}))]
    if stale:
        pytest.skip(f"saved {', '.join(stale)} results predate the current runtime: re-run "
                    f"python -m tests.bench.report --only {','.join(stale)}")
    m = report.measured_inputs(results)
    if m is None:
        pytest.skip("needs saved funnel and balancer results")
    rows = scaling_model.scaling_table(scaling_model.WORKLOADS, scaling_model.Hardware(), m)
    assert min(r["efficiency"] for r in rows if r["mode"] == "distributed" and r["num_gpus"] == 512) >= 0.95


@pytest.mark.xfail(strict=False, reason="0.89x on 2 CPU cores: the two-process FSDP split pays gloo collectives "
                   "and a weight sync that TRL's single process does not (docs/benchmarks.md, section 5)")
def test_distflow_grpo_step_throughput_is_at_least_twice_trl():
    pytest.importorskip("trl")
    from tests.bench import e2e_trl

    out = e2e_trl.run(e2e_trl.Settings(steps=2), rounds=1, single_worker_check=False)
    assert out["speedup"] >= 2


def test_quickstart_workers_peak_within_10_percent_of_the_median():
    from tests.bench import memory

    out = memory.run(steps=2)
    assert out["summary"]["distributed"]["max_over_median"] <= 1.10


@pytest.mark.xfail(strict=False, reason="2.67x: ~0.7 GiB of torch/transformers imports, activations and "
                   "glibc's heap on top of the 1.5 GiB of state (docs/benchmarks.md, section 6)")
def test_quickstart_workers_peak_within_1_5x_what_they_hold():
    from tests.bench import memory

    out = memory.run(steps=2)
    assert max(out["summary"]["distributed"]["peak_rss"]) <= 1.5 * out["need_bytes"]
