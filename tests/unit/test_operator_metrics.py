"""The operator's custom Prometheus collector: values, and a deleted job's series disappear."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from distflow_operator.config import OperatorConfig
from distflow_operator.metrics import JobProgress, JobSample, OperatorMetrics

pytestmark = pytest.mark.unit


@pytest.fixture
def scrape():
    metrics = OperatorMetrics()
    registry = CollectorRegistry()
    registry.register(metrics)
    return metrics, lambda name, **labels: registry.get_sample_value(name, labels or None)


def test_jobs_are_counted_per_phase_with_zero_for_empty_phases(scrape):
    metrics, value = scrape
    metrics.record_job("a", "j1", JobSample("Running", 0, 2, 2))
    metrics.record_job("a", "j2", JobSample("Running", 1, 1, 2))
    metrics.record_job("b", "j3", JobSample("Failed", 3, 0, 4))
    assert value("distflow_operator_jobs", phase="Running") == 2
    assert value("distflow_operator_jobs", phase="Failed") == 1
    assert value("distflow_operator_jobs", phase="Suspended") == 0


def test_per_job_series_carry_phase_restarts_and_nodes(scrape):
    metrics, value = scrape
    metrics.record_job("a", "j1", JobSample("Restarting", 2, 1, 4))
    assert value("distflow_operator_job_phase", namespace="a", job_name="j1", phase="Restarting") == 1
    assert value("distflow_operator_job_restarts_total", namespace="a", job_name="j1") == 2
    assert value("distflow_operator_job_nodes_ready", namespace="a", job_name="j1") == 1
    assert value("distflow_operator_job_nodes_desired", namespace="a", job_name="j1") == 4


def test_a_forgotten_job_leaves_no_series_behind(scrape):
    metrics, value = scrape
    metrics.record_job("a", "gone", JobSample("Running", 1, 2, 2))
    metrics.record_job("a", "kept", JobSample("Running", 0, 2, 2))
    metrics.forget_job("a", "gone")
    registry = CollectorRegistry()
    registry.register(metrics)
    text = generate_latest(registry).decode()
    assert 'job_name="gone"' not in text and 'job_name="kept"' in text
    assert value("distflow_operator_jobs", phase="Running") == 1


def test_time_to_running_histogram_buckets_are_cumulative(scrape):
    metrics, value = scrape
    for seconds in (0.5, 3.0, 3.0, 4000.0):
        metrics.observe_time_to_running(seconds)
    assert value("distflow_operator_time_to_running_seconds_bucket", le="1.0") == 1
    assert value("distflow_operator_time_to_running_seconds_bucket", le="5.0") == 3
    assert value("distflow_operator_time_to_running_seconds_bucket", le="3600.0") == 3
    assert value("distflow_operator_time_to_running_seconds_bucket", le="+Inf") == 4
    assert value("distflow_operator_time_to_running_seconds_count") == 4
    assert value("distflow_operator_time_to_running_seconds_sum") == 4006.5


def test_reconcile_and_restart_counters(scrape):
    metrics, value = scrape
    metrics.record_reconcile(failed=False)
    metrics.record_reconcile(failed=True)
    metrics.record_gang_restarts(2)
    assert value("distflow_operator_reconciles_total") == 2
    assert value("distflow_operator_reconcile_errors_total") == 1
    assert value("distflow_operator_gang_restarts_total") == 2


def test_operator_config_from_env_validates_numbers():
    config = OperatorConfig.from_env({"DISTFLOW_OPERATOR_METRICS_PORT": "9100",
                                      "DISTFLOW_OPERATOR_PROGRESS_INTERVAL": "0.5"})
    assert (config.metrics_port, config.progress_interval_s, config.resync_interval_s) == (9100, 0.5, 60.0)
    with pytest.raises(ValueError, match="DISTFLOW_OPERATOR_API_WORKERS='many'"):
        OperatorConfig.from_env({"DISTFLOW_OPERATOR_API_WORKERS": "many"})
    with pytest.raises(ValueError, match="metrics_port=70000"):
        OperatorConfig(metrics_port=70000)


def test_the_environment_sets_what_no_flag_gives_and_a_flag_wins(monkeypatch):
    from distflow_operator.__main__ import _parser

    monkeypatch.setenv("DISTFLOW_OPERATOR_LEADER_ELECTION_NAMESPACE", "distflow-system")
    monkeypatch.setenv("DISTFLOW_OPERATOR_LEASE_DURATION", "20")
    monkeypatch.setenv("DISTFLOW_OPERATOR_RESYNC_INTERVAL", "30")
    args = _parser().parse_args([])
    assert (args.leader_election_namespace, args.lease_duration, args.resync_interval, args.metrics_port) == (
        "distflow-system", 20.0, 30.0, 8080)
    args = _parser().parse_args(["--resync-interval=5", "--leader-election-namespace=ops"])
    assert (args.leader_election_namespace, args.resync_interval) == ("ops", 5.0)


def test_reconcile_duration_histogram_and_queue_depth(scrape):
    metrics, value = scrape
    for seconds in (0.004, 0.03, 0.03, 0.7, 90.0):
        metrics.record_reconcile(failed=False, seconds=seconds)
    assert value("distflow_operator_reconcile_duration_seconds_bucket", le="0.005") == 1
    assert value("distflow_operator_reconcile_duration_seconds_bucket", le="0.05") == 3
    assert value("distflow_operator_reconcile_duration_seconds_bucket", le="1.0") == 4
    assert value("distflow_operator_reconcile_duration_seconds_bucket", le="60.0") == 4
    assert value("distflow_operator_reconcile_duration_seconds_bucket", le="+Inf") == 5
    assert value("distflow_operator_reconcile_duration_seconds_sum") == pytest.approx(90.764)
    metrics.set_queue_depth(7)
    assert value("distflow_operator_work_queue_depth") == 7


def test_api_errors_are_counted_by_status_code(scrape):
    metrics, value = scrape
    for code in (409, 409, 500, 403, None):
        metrics.record_api_error(code)
    assert value("distflow_operator_api_errors_total", code="409") == 2
    assert value("distflow_operator_api_errors_total", code="500") == 1
    assert value("distflow_operator_api_errors_total", code="403") == 1
    assert value("distflow_operator_api_errors_total", code="none") == 1
    assert value("distflow_operator_api_errors_total", code="404") is None


def test_pods_received_by_watch_and_list_are_counted(scrape):
    metrics, value = scrape
    metrics.record_pods_received(events=1)
    metrics.record_pods_received(events=1)
    metrics.record_pods_received(listed=16)
    assert value("distflow_operator_pod_events_total") == 2
    assert value("distflow_operator_pods_listed_total") == 16


def test_only_the_leader_exports_job_series_and_says_it_leads(scrape):
    metrics, value = scrape
    leading = [True]
    metrics.is_leader = lambda: leading[0]
    metrics.record_job("a", "j1", JobSample("Running", 0, 2, 2))
    assert value("distflow_operator_leader") == 1
    assert value("distflow_operator_job_phase", namespace="a", job_name="j1", phase="Running") == 1
    leading[0] = False  # the Lease went to another replica: its scrape is the one that counts
    assert value("distflow_operator_leader") == 0
    assert value("distflow_operator_job_phase", namespace="a", job_name="j1", phase="Running") is None
    assert value("distflow_operator_jobs", phase="Running") == 0


def test_a_new_leader_starts_its_job_series_from_nothing(scrape):
    metrics, value = scrape
    metrics.record_job("a", "deleted-while-standing-by", JobSample("Running", 0, 2, 2))
    metrics.forget_jobs()
    assert value("distflow_operator_jobs", phase="Running") == 0


def test_job_roll_up_gives_step_seconds_and_tokens_per_second_of_the_whole_job(scrape):
    metrics, value = scrape
    body = {"spec": {"cluster": {"numNodes": 2, "procsPerNode": 4}},
            "status": {"progress": {"step": 9, "stepSeconds": 6.5, "tokensPerSecond": 250.0}}}
    metrics.record_job("a", "j1", JobSample("Running", 0, 2, 2))
    metrics.record_progress("a", "j1", JobProgress.from_body(body))
    labels = {"namespace": "a", "job_name": "j1"}
    assert value("distflow_operator_job_step", **labels) == 9
    assert value("distflow_operator_job_step_duration_seconds", **labels) == 6.5
    assert value("distflow_operator_job_throughput_tokens_per_second", **labels) == 250.0
    assert value("distflow_operator_job_tokens_per_second", **labels) == 2000.0


def test_job_roll_up_waits_for_the_phase_and_goes_with_the_job(scrape):
    metrics, value = scrape
    labels = {"namespace": "a", "job_name": "j1"}
    metrics.record_progress("a", "j1", JobProgress(step=3, step_seconds=1.0, tokens_per_second=10.0, num_workers=2))
    assert value("distflow_operator_job_step", **labels) is None
    metrics.record_job("a", "j1", JobSample("Running", 0, 2, 2))
    assert value("distflow_operator_job_tokens_per_second", **labels) == 20.0
    metrics.forget_job("a", "j1")
    assert value("distflow_operator_job_step_duration_seconds", **labels) is None
    assert JobProgress.from_body({"metadata": {}}) == JobProgress(num_workers=1)
