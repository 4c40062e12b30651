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
    distflow_operator_job_step{namespace,job_name}            last training step (status.progress.step)
    distflow_operator_job_step_duration_seconds{...}          wall time of the last step (status.progress.stepSeconds)
    distflow_operator_job_throughput_tokens_per_second{...}   tokens/s per accelerator (status.progress.tokensPerSecond)
    distflow_operator_job_tokens_per_second{...}              tokens/s of the whole job: the above x workers
    distflow_operator_gang_restarts_total                     gang restarts this operator performed
    distflow_operator_time_to_running_seconds                 histogram: (re)start -> every node running
    distflow_operator_reconciles_total
    distflow_operator_reconcile_errors_total
    distflow_operator_reconcile_duration_seconds              histogram: one reconcile pass, API calls included
    distflow_operator_work_queue_depth                        jobs marked for a reconcile that has not started
    distflow_operator_api_errors_total{code}                  API answers >= 400 by HTTP status ("none": no answer)
    distflow_operator_pod_events_total                        pod watch events received (distflow's pods only)
    distflow_operator_pods_listed_total                       pods received from LISTs (resyncs)
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from distflow_operator.status import PHASES

TIME_TO_RUNNING_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""Seconds; pods on warm GPU nodes start in seconds, cold image pulls take minutes."""
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds; controller-runtime's reconcile_time buckets, up to the API's request timeout."""


class _Histogram:
    """Bucket counts and sum of one histogram; the caller holds the lock."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip(list(self.bounds) + [float("inf")], self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.sum)


@dataclass(frozen=True)
class JobSample:
    phase: str
    restarts: int
    ready_nodes: int
    desired_nodes: int


@dataclass(frozen=True)
class JobProgress:
    """A job's roll-up for autoscalers, from its status.progress (what node 0 reported)."""

    step: int | None = None
    step_seconds: float | None = None
    """Wall time of the last step."""
    tokens_per_second: float | None = None
    """Prompt+response tokens per second per accelerator (verl's definition)."""
    num_workers: int = 0
    """spec.cluster.numNodes x procsPerNode, the accelerators of verl's definition: the job's
    tokens/s is tokens_per_second times this."""

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobProgress:
        """From an RLPostTrainJob object (dict); missing fields stay None."""
        progress = (body.get("status") or {}).get("progress") or {}
        cluster = (body.get("spec") or {}).get("cluster") or {}
        return cls(step=progress.get("step"), step_seconds=progress.get("stepSeconds"),
                   tokens_per_second=progress.get("tokensPerSecond"),
                   num_workers=int(cluster.get("numNodes", 1)) * int(cluster.get("procsPerNode", 1)))


class OperatorMetrics:
    """Thread-safe state behind the collector: the event loop writes, the HTTP thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], JobSample] = {}
        self._progress: dict[tuple[str, str], JobProgress] = {}
        self._gang_restarts = 0
        self._reconciles = 0
        self._errors = 0
        self._time_to_running = _Histogram(TIME_TO_RUNNING_BUCKETS)
        self._reconcile_time = _Histogram(RECONCILE_BUCKETS)
        self._queue_depth = 0
        self._api_errors: dict[str, int] = {}
        self._pod_events = 0
        self._pods_listed = 0
        self.is_leader: Callable[[], bool] = lambda: True
        """Set by leader election: only the leader exports job series, so a dashboard that sums
        over every replica's scrape counts each job once, and a replica that lost its Lease stops
        exporting what it can no longer keep current."""

    def record_job(self, namespace: str, name: str, sample: JobSample) -> None:
        with self._lock:
            self._jobs[(namespace, name)] = sample

    def record_progress(self, namespace: str, name: str, progress: JobProgress) -> None:
        """The job's roll-up; exported while the job's phase is recorded (``record_job``)."""
        with self._lock:
            self._progress[(namespace, name)] = progress

    def forget_job(self, namespace: str, name: str) -> None:
        """Drop the job's series (it was deleted)."""
        with self._lock:
            self._jobs.pop((namespace, name), None)
            self._progress.pop((namespace, name), None)

    def forget_jobs(self) -> None:
        """Drop every job's series: a newly elected leader records them anew from the API's state,
        without the jobs deleted while it stood by."""
        with self._lock:
            self._jobs.clear()
            self._progress.clear()

    def record_gang_restarts(self, count: int) -> None:
        with self._lock:
            self._gang_restarts += count

    def record_reconcile(self, failed: bool, seconds: float = 0.0) -> None:
        """One reconcile pass that took ``seconds`` (wall clock, API calls included)."""
        with self._lock:
            self._reconciles += 1
            self._errors += int(failed)
            self._reconcile_time.observe(seconds)

    def observe_time_to_running(self, seconds: float) -> None:
        with self._lock:
            self._time_to_running.observe(seconds)

    def set_queue_depth(self, depth: int) -> None:
        self._queue_depth = depth  # one int store: atomic, read once per scrape

    def record_pods_received(self, events: int = 0, listed: int = 0) -> None:
        """Pods the operator was sent: by its pod watch (events) or its LISTs (listed)."""
        with self._lock:
            self._pod_events += events
            self._pods_listed += listed

    def record_api_error(self, code: int | None) -> None:
        """An API call answered ``code`` >= 400 (expected ones too: a 409 on create), or no answer (None)."""
        label = str(code) if code is not None else "none"
        with self._lock:
            self._api_errors[label] = self._api_errors.get(label, 0) + 1

    def collect(self) -> Iterator[Metric]:
        """prometheus_client Collector protocol."""
        leading = self.is_leader()
        with self._lock:
            jobs = dict(self._jobs) if leading else {}
            progress = {key: p for key, p in self._progress.items() if key in jobs}
            restarts, reconciles, errors = self._gang_restarts, self._reconciles, self._errors
            time_to_running = self._time_to_running.family(
                "distflow_operator_time_to_running_seconds", "From pods created (or gang restart) to every node running")
            reconcile_time = self._reconcile_time.family(
                "distflow_operator_reconcile_duration_seconds", "One reconcile pass of one job, API calls included")
            api_errors = dict(self._api_errors)
            pod_events, pods_listed = self._pod_events, self._pods_listed
        yield GaugeMetricFamily("distflow_operator_leader", "1 on the replica that reconciles (the Lease holder, "
                                "or the only replica without election)", value=int(leading))
        yield from self._job_families(jobs)
        yield from self._progress_families(progress)
        yield CounterMetricFamily("distflow_operator_gang_restarts",
                                  "Gang restarts this operator performed", value=restarts)
        yield CounterMetricFamily("distflow_operator_reconciles", "Reconciles run", value=reconciles)
        yield CounterMetricFamily("distflow_operator_reconcile_errors",
                                  "Reconciles that raised (retried with backoff)", value=errors)
        yield time_to_running
        yield reconcile_time
        yield GaugeMetricFamily("distflow_operator_work_queue_depth",
                                "Jobs marked for a reconcile that has not started yet", value=self._queue_depth)
        by_code = CounterMetricFamily("distflow_operator_api_errors", "API answers >= 400 by HTTP status",
                                      labels=["code"])
        for code, count in sorted(api_errors.items()):
            by_code.add_metric([code], count)
        yield by_code
        yield CounterMetricFamily("distflow_operator_pod_events", "Pod watch events received", value=pod_events)
        yield CounterMetricFamily("distflow_operator_pods_listed", "Pods received from LISTs", value=pods_listed)

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

    @staticmethod
    def _progress_families(jobs: dict[tuple[str, str], JobProgress]) -> Iterator[Metric]:
        """The autoscaler's per-job roll-up; a series is absent while node 0 has not reported it."""
        labels = ["namespace", "job_name"]
        step = GaugeMetricFamily("distflow_operator_job_step", "Last training step node 0 reported", labels=labels)
        seconds = GaugeMetricFamily("distflow_operator_job_step_duration_seconds", "Wall time of the last step",
                                    labels=labels)
        per_accelerator = GaugeMetricFamily("distflow_operator_job_throughput_tokens_per_second",
                                            "Prompt+response tokens per second per accelerator", labels=labels)
        total = GaugeMetricFamily("distflow_operator_job_tokens_per_second",
                                  "Prompt+response tokens per second of the whole job", labels=labels)
        for (namespace, name), p in sorted(jobs.items()):
            if p.step is not None:
                step.add_metric([namespace, name], p.step)
            if p.step_seconds is not None:
                seconds.add_metric([namespace, name], p.step_seconds)
            if p.tokens_per_second is not None:
                per_accelerator.add_metric([namespace, name], p.tokens_per_second)
                total.add_metric([namespace, name], p.tokens_per_second * p.num_workers)
        yield from (step, seconds, per_accelerator, total)
