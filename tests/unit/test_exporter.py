"""A node's Prometheus endpoint serves the step's metrics under distflow_* names."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from distflow.exporter import NodeExporter, role_wait_ratios
from distflow.launcher import free_port

pytestmark = pytest.mark.unit


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_node_exporter_serves_step_metrics():
    port = free_port()
    exporter = NodeExporter("quickstart", node=1, port=port)
    metrics = {"perf/throughput": 123.5, "critic/score/mean": 0.25, "timing_s/rollout": 2.0,
               "timing_s/actor_update": 3.0, "actor/kl_loss": 0.01, "data/balance_imbalance": 1.02}
    exporter.observe_step(7, metrics, {(2, "advantage->actor_update"): 4096.0}, 1000.0, 3.0, 4.0)
    exporter.observe_step(8, metrics, {(2, "advantage->actor_update"): 1024.0}, 500.0, 1.0, 4.0)
    got = _scrape(port)
    job = (("job_name", "quickstart"), ("node", "1"))
    assert got[("distflow_step", job)] == 8
    assert got[("distflow_tokens_total", job)] == 1500.0
    assert got[("distflow_throughput_tokens_per_second", job)] == 123.5
    assert got[("distflow_reward_mean", job)] == 0.25
    assert got[("distflow_stage_duration_seconds", tuple(sorted(job + (("stage", "rollout"),))))] == 2.0
    key = tuple(sorted(job + (("edge", "advantage->actor_update"), ("rank", "2"))))
    assert got[("distflow_redistributed_bytes_total", key)] == 5120.0
    assert got[("distflow_local_cache_hits_total", job)] == 4.0
    assert got[("distflow_balance_imbalance_ratio", job)] == 1.02


def test_scaling_series_give_node_throughput_and_trainer_wait_share():
    port = free_port()
    exporter = NodeExporter("elastic", node=0, port=port)
    metrics = {"timing_s/step": 4.0, "timing_s/generate": 2.5, "timing_s/train": 1.0,
               "async/trainer_wait_s": 1.0, "async/in_flight_samples": 64.0}
    exporter.observe_step(3, metrics, {}, 2000.0, 0.0, 0.0)
    got = _scrape(port)
    job = (("job_name", "elastic"), ("node", "0"))
    assert got[("distflow_node_throughput_tokens_per_second", job)] == 500.0
    assert got[("distflow_role_wait_ratio", job + (("role", "trainer"),))] == 0.25
    assert got[("distflow_async_in_flight_samples", job)] == 64.0
    assert got[("distflow_stage_duration_seconds", tuple(sorted(job + (("stage", "generate"),))))] == 2.5
    assert got[("distflow_step_duration_seconds", job)] == 4.0


def test_role_wait_ratio_is_clipped_and_absent_without_a_step_time():
    assert role_wait_ratios({"timing_s/step": 2.0, "async/trainer_wait_s": 3.0}) == {"trainer": 1.0}
    assert role_wait_ratios({"async/trainer_wait_s": 3.0}) == {}
    assert role_wait_ratios({"timing_s/step": 2.0}) == {}
