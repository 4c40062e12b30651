"""Prometheus metrics of one node, served by the node's first worker.

All series carry ``job_name`` (the RLPostTrainJob or run name) and ``node``
labels. Per-rank transfer counters carry ``rank`` too. Names follow
Prometheus conventions: ``_total`` for counters, ``_seconds`` / ``_bytes``
units in the name, ``_ratio`` for shares in [0, 1].

The series an autoscaler reads (docs/operations.md, "Scaling metrics"):
``distflow_node_throughput_tokens_per_second`` (this node's share of the
step's tokens over the step's wall time), ``distflow_stage_duration_seconds``
by stage, ``distflow_role_wait_ratio`` by role and, in asynchronous mode,
``distflow_async_in_flight_samples``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

STEP_GAUGES = {
    "perf/throughput": ("distflow_throughput_tokens_per_second",
                        "Tokens (prompt+response) per second per accelerator (verl's definition)"),
    "critic/score/mean": ("distflow_reward_mean", "Mean reward of the step's responses"),
    "actor/kl_loss": ("distflow_kl", "KL(actor || reference) loss of the step"),
    "actor/entropy": ("distflow_entropy", "Mean token entropy of the actor"),
    "actor/pg_loss": ("distflow_policy_loss", "Policy-gradient loss of the step"),
    "actor/grad_norm": ("distflow_grad_norm", "Global gradient norm before clipping"),
    "response_length/mean": ("distflow_response_length_tokens",
                             "Mean response length: the model's own tokens (tool outputs excluded)"),
    "data/balance_imbalance": ("distflow_balance_imbalance_ratio",
                               "Max/mean token cost per dp rank after balancing"),
    "timing_s/step": ("distflow_step_duration_seconds", "Wall time of the last step"),
    "training/policy_version": ("distflow_policy_version", "Optimizer steps of the trainer's weights (async mode)"),
    "async/staleness_max": ("distflow_policy_staleness_max",
                            "Most policy versions a sample of the last step lagged the trainer (async mode)"),
    "async/in_flight_samples": ("distflow_async_in_flight_samples",
                                "Samples the rollout pool has generated that are not trained yet: its lead"),
    "async/trainer_wait_s": ("distflow_async_trainer_wait_seconds",
                             "Time the trainer pool waited for samples and the weight sync in the last step"),
}

ROLE_WAITS = {"trainer": "async/trainer_wait_s"}
"""Role -> step metric of the seconds it waited in the step. Only the asynchronous trainer pool
waits on another role (for samples and the weight sync); in synchronous mode every rank runs
every stage in turn, so no role waits and the ratio is not exported."""


def role_wait_ratios(metrics: dict[str, float]) -> dict[str, float]:
    """Share of the step's wall time each role waited, clipped to [0, 1].

    Args:
        metrics: one step's global metrics (``timing_s/step`` and the ``ROLE_WAITS`` keys, seconds).

    Returns:
        {role: ratio} for the roles whose wait the step measured; empty without a step time.
    """
    step_s = metrics.get("timing_s/step", 0.0)
    if step_s <= 0:
        return {}
    return {role: min(1.0, max(0.0, metrics[key] / step_s)) for role, key in ROLE_WAITS.items() if key in metrics}


class NodeExporter:
    """Registers distflow_* series and serves them on ``port`` (0: not served)."""

    _serving: dict[tuple[str, int, int], "NodeExporter"] = {}

    @classmethod
    def serving(cls, job: str, node: int, port: int) -> "NodeExporter":
        """This process's exporter for ``(job, node, port)``, created at the first call: a worker
        built again in the same process (``distflow.gang_resize``) goes on with the series and the
        port the first one serves (a second server could not bind it)."""
        key = (job, node, port)
        if key not in cls._serving:
            cls._serving[key] = cls(job, node, port)
        return cls._serving[key]

    def __init__(self, job: str, node: int, port: int):
        self.registry = CollectorRegistry()
        self.labels = {"job_name": job, "node": str(node)}
        names = list(self.labels)
        self.step = Gauge("distflow_step", "Last completed training step", names, registry=self.registry)
        self.tokens = Counter("distflow_tokens", "Prompt+response tokens trained on (whole job)",
                              names, registry=self.registry)
        self.node_throughput = Gauge(
            "distflow_node_throughput_tokens_per_second",
            "Prompt+response tokens of the last step this node trained on, per second of the step",
            names, registry=self.registry)
        self.role_wait = Gauge("distflow_role_wait_ratio", "Share of the last step's wall time a role waited",
                               names + ["role"], registry=self.registry)
        self.stage = Gauge("distflow_stage_duration_seconds", "Wall time of a stage in the last step",
                           names + ["stage"], registry=self.registry)
        self.gauges = {key: Gauge(name, doc, names, registry=self.registry)
                       for key, (name, doc) in STEP_GAUGES.items()}
        self.bytes = Counter("distflow_redistributed_bytes", "Bytes sent by a rank's data plane",
                             names + ["rank", "edge"], registry=self.registry)
        self.checkpoint_step = Gauge("distflow_checkpoint_step", "Step of the last complete checkpoint",
                                     names, registry=self.registry)
        self.cache_hits = Counter("distflow_local_cache_hits", "Edges that moved zero bytes",
                                  names, registry=self.registry)
        self.exchanges = Counter("distflow_edge_exchanges", "Edges crossed (cache hit or transfer)",
                                 names, registry=self.registry)
        self.resize_pause = Gauge("distflow_resize_pause_seconds",
                                  "Seconds the gang trained nothing in its last in-place resize", names,
                                  registry=self.registry)
        if port:
            start_http_server(port, registry=self.registry)

    def observe_resize_pause(self, seconds: float) -> None:
        """The gang's last in-place resize (``distflow.gang_resize``): seconds from its step boundary to
        training again (checkpoint, re-form, model build, checkpoint load)."""
        self.resize_pause.labels(**self.labels).set(seconds)

    def observe_step(self, step: int, metrics: dict[str, float], rank_bytes: dict[tuple[int, str], float],
                     num_tokens: float, cache_hits: float, exchanges: float) -> None:
        """Update every series from one step's global metrics and this node's ranks' bytes.

        ``num_tokens`` is this node's share of the step's prompt+response tokens.
        """
        lab = self.labels
        self.step.labels(**lab).set(step)
        self.tokens.labels(**lab).inc(num_tokens)
        if metrics.get("timing_s/step", 0.0) > 0:
            self.node_throughput.labels(**lab).set(num_tokens / metrics["timing_s/step"])
        for role, ratio in role_wait_ratios(metrics).items():
            self.role_wait.labels(**lab, role=role).set(ratio)
        for key, value in metrics.items():
            if key.startswith("timing_s/"):
                self.stage.labels(**lab, stage=key.removeprefix("timing_s/")).set(value)
        for key, gauge in self.gauges.items():
            if key in metrics:
                gauge.labels(**lab).set(metrics[key])
        for (rank, edge), value in rank_bytes.items():
            self.bytes.labels(**lab, rank=str(rank), edge=edge).inc(value)
        self.cache_hits.labels(**lab).inc(cache_hits)
        self.exchanges.labels(**lab).inc(exchanges)

    def observe_checkpoint(self, step: int) -> None:
        self.checkpoint_step.labels(**self.labels).set(step)
