"""kopf handlers: thin glue from watch events to the reconciler.

Only index and event handlers are used (the pods go to the reconciler's own
cache, which a periodic LIST corrects; see podcache.py): neither makes kopf add a finalizer or
write bookkeeping, so a job can always be deleted, with or without a running
operator (timers and daemons would need a finalizer; there is no delete
handler). The storages are still set to the ``distflow.io`` annotation prefix
so that any change handler added later keeps its state under the project's
own keys and never in ``status``.

Load with ``kopf run -m distflow_operator.handlers`` (or ``distflow-operator``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

from distflow_operator import API_GROUP, API_VERSION, MANAGER, PLURAL
from distflow_operator.config import OperatorConfig
from distflow_operator.kube import KubeApi, TokenBucket, client_configuration, kopf_login
from distflow_operator.leader import LeaderElector
from distflow_operator.metrics import JobProgress, OperatorMetrics
from distflow_operator.podcache import PodCache
from distflow_operator.reconcile import Reconciler
from distflow_operator.render import LABEL_JOB, LABEL_MANAGED_BY

NODE_POD_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGER},{LABEL_JOB}"
"""distflow's node pods, selected by the API server for the watch and every LIST: other pods never
reach the operator. The pod handler has no client-side filter on top, so that the events it counts
(distflow_operator_pod_events_total) are what the watch delivered."""


@dataclass
class OperatorRuntime:
    """What one operator run owns; kept in kopf's operator-level memo."""

    api: KubeApi
    reconciler: Reconciler
    metrics: OperatorMetrics
    tasks: list[asyncio.Task] = field(default_factory=list)
    metrics_server: Any = None
    elector: LeaderElector | None = None

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.elector is not None:
            await self.elector.stop()
        await self.reconciler.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        self.api.close()


def configure(settings: kopf.OperatorSettings) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{API_GROUP}/kopf-finalizer"
    # Our own Events come from the reconciler; kopf posts only its warnings and errors.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = MANAGER
    # kopf logs every event handler's success at INFO: one line per pod event is noise.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # Watches end and re-list every few minutes: a silently stalled stream heals itself.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.watching.label_selectors["v1", "pods"] = NODE_POD_SELECTOR
    # No kopf peering: several replicas elect a leader through a Lease instead (leader.py).
    settings.peering.standalone = True


def _serve_metrics(port: int, metrics: OperatorMetrics) -> Any:
    registry = CollectorRegistry()
    registry.register(metrics)
    ProcessCollector(registry=registry)
    server, _thread = start_http_server(port, registry=registry)
    return server


@kopf.on.login()
def login(**kwargs: Any) -> Any:
    return kopf_login(**kwargs)


@kopf.on.startup()
async def start_operator(settings: kopf.OperatorSettings, memo: kopf.Memo, rljob_index: kopf.Index,
                         logger: logging.Logger, **_: Any) -> None:
    configure(settings)
    config = memo.get("config") or OperatorConfig.from_env()
    metrics = OperatorMetrics()
    api = KubeApi(client_configuration(), pool_size=config.api_workers,
                  rate_limit=TokenBucket(config.api_qps, config.api_burst), record_error=metrics.record_api_error)
    reconciler = Reconciler(api, rljob_index, PodCache(), metrics, api_workers=config.api_workers,
                            pod_selector=NODE_POD_SELECTOR)
    runtime = OperatorRuntime(api, reconciler, metrics)
    runtime.tasks = [asyncio.create_task(reconciler.resync_forever(config.resync_interval_s)),
                     asyncio.create_task(reconciler.scrape_forever(config.progress_interval_s))]
    if config.leader_election_namespace:
        lease_api = KubeApi(client_configuration(), pool_size=1, record_error=metrics.record_api_error)
        elector = LeaderElector(lease_api, config.leader_election_namespace,
                                lease_duration_s=config.lease_duration_s, on_elected=reconciler.elected)
        reconciler.is_leader = metrics.is_leader = lambda: elector.is_leader
        runtime.elector = elector
        runtime.tasks.append(asyncio.create_task(elector.run()))
    if config.metrics_port:
        runtime.metrics_server = _serve_metrics(config.metrics_port, metrics)
    memo["runtime"] = runtime
    logger.info("distflow operator started: %s", config)


@kopf.on.cleanup()
async def stop_operator(memo: kopf.Memo, **_: Any) -> None:
    runtime = memo.get("runtime")
    if runtime is not None:
        await runtime.stop()


@kopf.index(API_GROUP, API_VERSION, PLURAL)
def rljob_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    # A snapshot: kopf's Body is a live view that later events replace in place.
    return {(namespace, name): copy.deepcopy(dict(body))}


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def job_changed(type: str | None, namespace: str, name: str, body: kopf.Body,  # noqa: A002
                      memo: kopf.Memo, **_: Any) -> None:
    runtime = memo["runtime"]
    if type != "DELETED":
        # The autoscaler's roll-up follows the status the reconciler wrote (node 0's progress).
        runtime.metrics.record_progress(namespace, name, JobProgress.from_body(body))
    runtime.reconciler.kick((namespace, name))


@kopf.on.event("pods")
async def node_pod_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:  # noqa: A002
    runtime = memo.get("runtime")
    if runtime is None:
        return  # startup not finished: the first resync lists these pods
    runtime.metrics.record_pods_received(events=1)
    key = runtime.reconciler.pods.observe(type, body)
    if key is not None:
        runtime.reconciler.kick(key)


@kopf.on.probe(id="jobs")
def jobs_known(memo: kopf.Memo, **_: Any) -> int:
    """Liveness payload: how many jobs the operator tracks."""
    runtime = memo.get("runtime")
    return runtime.reconciler.num_jobs if runtime is not None else 0
