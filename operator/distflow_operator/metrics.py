"""The operator's own Prometheus metrics, as one custom collector.

A collector (rather than labelled Gauge objects) renders the series from the
operator's current view at scrape time, so a job's series exist exactly while
the operator knows the job: forgetting a deleted job removes them, with no
label children to clean up. Aggregates (restarts performed, reconciles, time to
running) are plain counters and a histogram kept here.

Series:

    distflow_operator_jobs{phase}                             jobs per phase (every phase, 0 too)
    distflow_operator_job_phase{namespace,job_name,phase}     1 for the job's current phase
    distflow_operator_job_restarts_total{namespace,job_name}  the job's gang restarts (status.restarts)
    distflow_operator_job_nodes_ready{namespace,job_name}     ready node pods
    distflow_operator_job_nodes_desired{namespace,job_name}   spec.cluster.numNodes
    distflow_operator_gang_restarts_total                     gang restarts this operator performed
    distflow_operator_time_to_running_seconds                 histogram: (re)start -> every node running
    distflow_operator_reconciles_total
    distflow_operator_reconcile_errors_total
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from distflow_operator.status import PHASES

TIME_TO_RUNNING_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""Seconds; pods on warm GPU nodes start in seconds, cold image pulls take minutes."""


@dataclass(frozen=True)
class JobSample:
    phase: str
    restarts: int
    ready_nodes: int
    desired_nodes: int


class OperatorMetrics:
    """Thread-safe state behind the collector: the event loop writes, the HTTP thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], JobSample] = {}
        self._gang_restarts = 0
        self._reconciles = 0
        self._errors = 0
        self._bucket_counts = [0] * (len(TIME_TO_RUNNING_BUCKETS) + 1)
        self._running_sum = 0.0

    def record_job(self, namespace: str, name: str, sample: JobSample) -> None:
        with self._lock:
            self._jobs[(namespace, name)] = sample

    def forget_job(self, namespace: str, name: str) -> None:
        """Drop the job's series (it was deleted)."""
        with self._lock:
            self._jobs.pop((namespace, name), None)

    def record_gang_restarts(self, count: int) -> None:
        with self._lock:
            self._gang_restarts += count

    def record_reconcile(self, failed: bool) -> None:
        with self._lock:
            self._reconciles += 1
            self._errors += int(failed)

    def observe_time_to_running(self, seconds: float) -> None:
        with self._lock:
            self._bucket_counts[bisect.bisect_left(TIME_TO_RUNNING_BUCKETS, seconds)] += 1
            self._running_sum += seconds

    def collect(self) -> Iterator[Metric]:
        """prometheus_client Collector protocol."""
        with self._lock:
            jobs = dict(self._jobs)
            restarts, reconciles, errors = self._gang_restarts, self._reconciles, self._errors
            counts, total = list(self._bucket_counts), self._running_sum
        yield from self._job_families(jobs)
        yield CounterMetricFamily("distflow_operator_gang_restarts",
                                  "Gang restarts this operator performed", value=restarts)
        yield CounterMetricFamily("distflow_operator_reconciles", "Reconciles run", value=reconciles)
        yield CounterMetricFamily("distflow_operator_reconcile_errors",
                                  "Reconciles that raised (retried with backoff)", value=errors)
        cumulative, buckets = 0, []
        for bound, count in zip(list(TIME_TO_RUNNING_BUCKETS) + [float("inf")], counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily("distflow_operator_time_to_running_seconds",
                                    "From pods created (or gang restart) to every node running",
                                    buckets=buckets, sum_value=total)

    @staticmethod
    def _job_families(jobs: dict[tuple[str, str], JobSample]) -> Iterator[Metric]:
        by_phase = GaugeMetricFamily("distflow_operator_jobs", "Jobs per phase", labels=["phase"])
        for phase in PHASES:
            by_phase.add_metric([phase], sum(s.phase == phase for s in jobs.values()))
        yield by_phase
        labels = ["namespace", "job_name"]
        phase = GaugeMetricFamily("distflow_operator_job_phase", "1 for the job's current phase",
                                  labels=labels + ["phase"])
        restarts = CounterMetricFamily("distflow_operator_job_restarts", "Gang restarts of the job",
                                       labels=labels)
        ready = GaugeMetricFamily("distflow_operator_job_nodes_ready", "Ready node pods", labels=labels)
        desired = GaugeMetricFamily("distflow_operator_job_nodes_desired", "spec.cluster.numNodes",
                                    labels=labels)
        for (namespace, name), sample in sorted(jobs.items()):
            phase.add_metric([namespace, name, sample.phase], 1)
            restarts.add_metric([namespace, name], sample.restarts)
            ready.add_metric([namespace, name], sample.ready_nodes)
            desired.add_metric([namespace, name], sample.desired_nodes)
        yield from (phase, restarts, ready, desired)
