"""The Grafana dashboard against a real Prometheus that scraped a real run.

Prometheus (Debian's package; .ci/setup --tests installs it) scrapes, every second, the
two node exporters of a local `distflow run` (a tiny model, 2 nodes) and the
operator's /metrics while the operator takes a job on the test control plane
through a gang restart. Every PromQL expression of
helm/distflow/dashboards/distflow.json must then return at least one series
with a value through Prometheus' HTTP API, and the panels are drawn from
those results into a PNG (DISTFLOW_DASHBOARD_PNG=path keeps it, e.g.
docs/images/dashboard.png).

The metric-name and label checks at the top need no Prometheus and no cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.controlplane.cluster import free_port
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    REPO,
    Api,
    crd,
    example_job,
    operator_kubeconfig_path,
    operator_running,
    wait_for,
)

DASHBOARD = REPO / "helm" / "distflow" / "dashboards" / "distflow.json"
OPERATIONS_DOC = REPO / "docs" / "operations.md"
RUN_NAME = "dashboard-run"
SCRAPE_INTERVAL_S = 1
NOT_A_VALUE = ("NaN", "+Inf", "-Inf")
# Grafana's $__rate_interval is max(4 x scrape interval, step + scrape interval).
VARIABLES = {"$__rate_interval": f"{5 * SCRAPE_INTERVAL_S}s", "$job": ".*", "$reference": RUN_NAME}
RUN_SPEC = {
    "model": {"path": "tiny"},
    # Wide operands give prompts of different token counts, so balancing moves samples.
    "data": {"train": {"path": "arithmetic", "size": 512, "minOperand": 1, "maxOperand": 999999},
             "trainBatchSize": 4, "maxPromptLength": 128, "maxResponseLength": 8,
             "rewardFn": "dashboard_reward:response_chars_reward"},
    "rollout": {"n": 4},
    "actor": {"lr": 1.0e-4},
    "cluster": {"numNodes": 2, "procsPerNode": 1, "device": "cpu"},
    "trainer": {"totalSteps": 12},
    "checkpoint": {"saveEverySteps": 4},
}
REWARD_MODULE = '''
def response_chars_reward(response, ground_truth, extra_info=None):
    """A toy reward with a spread on a random model's text, so that advantages,
    losses, gradients and KL are not all zero: characters in the response, capped."""
    return min(1.0, len(response) / 100.0)
'''


def dashboard_panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) for every target of every panel."""
    return [(p["title"], t["refId"], t["expr"]) for p in dashboard_panels() for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bdistflow_\w+", expr))


def observed_families() -> list:
    """The runtime's and the operator's metric families after one step, a checkpoint and a job."""
    from distflow.exporter import STEP_GAUGES, NodeExporter
    from distflow_operator.metrics import JobProgress, JobSample, OperatorMetrics
    from prometheus_client import CollectorRegistry

    node = NodeExporter("j", 0, port=0)
    node.observe_step(1, {**dict.fromkeys(STEP_GAUGES, 1.0), "timing_s/rollout": 1.0},
                      {(0, "rollout->actor"): 1.0}, num_tokens=1.0, cache_hits=0.0, exchanges=1.0)
    node.observe_checkpoint(1)
    operator = OperatorMetrics()
    operator.record_job("ns", "j", JobSample("Running", 0, 1, 1))
    operator.record_progress("ns", "j", JobProgress(step=1, step_seconds=1.0, tokens_per_second=1.0, num_workers=1))
    operator.observe_time_to_running(1.0)
    registry = CollectorRegistry()
    registry.register(operator)
    return [family for reg in (node.registry, registry) for family in reg.collect()]


def exported_families() -> dict[str, str]:
    """Metric family -> type, declared by the runtime's and the operator's collectors."""
    return {family.name: family.type for family in observed_families()}


def exported_series_labels() -> dict[str, set[str]]:
    """Series name (with its _total, _bucket ... suffix) -> the label names it carries."""
    labels: dict[str, set[str]] = {}
    for family in observed_families():
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def query_labels(expr: str, legend_format: str) -> set[str]:
    """Label names a target groups by, matches on or shows in its legend."""
    grouped = {name.strip() for by in re.findall(r"\bby \(([^)]*)\)", expr) for name in by.split(",")}
    matched = {name for selector in re.findall(r"\{([^}]*)\}", expr)
               for name in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector)}
    return grouped | matched | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend_format))


SERIES_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                   "gauge": ("",)}


def exported_series_names() -> set[str]:
    return {name + suffix for name, kind in exported_families().items() for suffix in SERIES_SUFFIXES[kind]}


@pytest.mark.unit
def test_every_dashboard_query_uses_metric_names_the_code_exports():
    exported = exported_series_names()
    for title, ref, expr in dashboard_queries():
        unknown = metric_names(expr) - exported
        assert not unknown, f"panel {title!r} {ref}: {sorted(unknown)} not exported; exported: {sorted(exported)}"


@pytest.mark.unit
def test_every_dashboard_query_uses_labels_its_metrics_carry():
    # Prometheus' own target labels do not count: `job` there is the scrape job, not the RLPostTrainJob.
    carried = exported_series_labels()
    for panel in dashboard_panels():
        for target in panel["targets"]:
            available = set().union(*(carried.get(name, set()) for name in metric_names(target["expr"])))
            used = query_labels(target["expr"], target["legendFormat"])
            assert used <= available, (f"panel {panel['title']!r} {target['refId']}: labels {sorted(used - available)} "
                                       f"not on {sorted(metric_names(target['expr']))}")


@pytest.mark.unit
def test_operations_doc_lists_every_exported_metric():
    doc = OPERATIONS_DOC.read_text()
    documented = {name for name, kind in exported_families().items()
                  if f"`{name}{'_total' if kind == 'counter' else ''}`" in doc}
    assert documented == set(exported_families()), f"docs/operations.md lacks {set(exported_families()) - documented}"


# -- Prometheus ------------------------------------------------------------

def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        message = "prometheus not installed (apt-get install -y --no-install-recommends prometheus)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


class Prometheus:
    """A Prometheus server on 127.0.0.1 with a throwaway TSDB, scraping fixed targets."""

    def __init__(self, workdir: Path, jobs: dict[str, list[int]]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # No honor_labels: no label the code exports collides with a target label of these scrapes.
        scrape_configs = [{"job_name": name, "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}
                          for name, ports in jobs.items()]
        config = {"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                             "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"}, "scrape_configs": scrape_configs}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [prometheus_binary(), f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: self._ready(), 30, 0.2, what="prometheus /-/ready")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                        step=f"{SCRAPE_INTERVAL_S}s")["result"]

    def stop(self) -> None:
        stop_process(self.proc)


def scraped(prometheus: Prometheus, job: str, num_targets: int) -> bool:
    """Whether the last scrape of every one of ``num_targets`` targets of ``job`` succeeded."""
    up = prometheus.api("query", query=f'count(up{{job="{job}"}} == 1)')["result"]
    return bool(up) and int(up[0]["value"][1]) == num_targets


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def substitute(expr: str, range_s: int) -> str:
    """Grafana's variables as a dashboard with job=All and a reference job would send them."""
    expr = expr.replace("$__range", f"{range_s}s")
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def start_local_run(workdir: Path, metrics_port: int) -> subprocess.Popen:
    spec = {**RUN_SPEC, "trainer": {**RUN_SPEC["trainer"], "metricsPort": metrics_port,
                                    "logDir": str(workdir / "run")},
            "checkpoint": {**RUN_SPEC["checkpoint"], "dir": str(workdir / "checkpoints")}}
    config = workdir / "run.yaml"
    config.write_text(yaml.safe_dump(spec))
    (workdir / "dashboard_reward.py").write_text(REWARD_MODULE)
    env = {**os.environ, "DISTFLOW_JOB_NAME": RUN_NAME,
           "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "operator"), str(workdir)])}
    with open(workdir / "run.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "distflow.cli", "run", str(config), "--no-resume"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)


def drive_operator_job(control_plane, api: Api, namespace: str) -> None:
    """A job through one gang restart, left Running: every operator series gets a value."""
    status, body = api.create_job(example_job("dash-job", runPolicy={"maxRestarts": 3, "backoffSeconds": 0}))
    assert status == 201, body
    api.wait_running_gang("dash-job", attempt=1, num_nodes=2, timeout_s=60)
    control_plane.set_pod_phase(namespace, "dash-job-node-0", "Failed", exit_code=1)
    api.wait_running_gang("dash-job", attempt=2, num_nodes=2, timeout_s=60)
    api.wait_phase("dash-job", "Running", attempt=2)


@pytest.mark.operator
def test_every_dashboard_query_returns_series_from_a_scraped_run(control_plane, k8s_namespace,
                                                                 operator_kubeconfig_path, tmp_path):
    node_port, operator_port = free_port(), free_port()
    while node_port + 1 == operator_port:
        operator_port = free_port()
    prometheus = Prometheus(tmp_path, {"distflow-nodes": [node_port, node_port + 1],
                                       "distflow-operator": [operator_port]})
    run = start_local_run(tmp_path, node_port)
    start = time.time()
    try:
        # The operator runs while the run trains, not while it loads: short enough that no
        # watch of kopf's reaches its server timeout and reconnects.
        wait_for(lambda: run.poll() is not None or scraped(prometheus, "distflow-nodes", 2), 600, 0.5,
                 what="Prometheus scraped both nodes of the run")
        with operator_running(operator_kubeconfig_path, k8s_namespace, METRICS_PORT=str(operator_port)):
            # Counters' increases count from the first scrape: the job starts after it.
            wait_for(lambda: scraped(prometheus, "distflow-operator", 1), 30, 0.2,
                     what="Prometheus scraped the operator")
            drive_operator_job(control_plane, Api(control_plane, k8s_namespace), k8s_namespace)
            assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(2 * SCRAPE_INTERVAL_S)
        end = time.time()
        range_s = int(end - start) + 1
        up = prometheus.query_range(f"max by (job) (max_over_time(up[{range_s}s]))", start, end)
        assert {s["metric"]["job"] for s in up if s["values"][-1][1] == "1"} == {"distflow-nodes",
                                                                                  "distflow-operator"}
        results = {}
        for title, ref, expr in dashboard_queries():
            series = prometheus.query_range(substitute(expr, range_s), start, end)
            with_values = [s for s in series if any(v[1] not in NOT_A_VALUE for v in s["values"])]
            assert with_values, f"panel {title!r} {ref}: no series with a value for {expr}"
            results[(title, ref)] = with_values
        restarts = results[("Gang restarts per job", "A")]
        assert [s["metric"] for s in restarts] == [{"namespace": k8s_namespace, "job_name": "dash-job"}]
    finally:
        stop_process(run)
        prometheus.stop()
    png = Path(os.environ.get("DISTFLOW_DASHBOARD_PNG") or tmp_path / "dashboard.png")
    render_dashboard(results, start, end, png)
    assert png.stat().st_size > 20_000


# -- the picture -----------------------------------------------------------

UNIT_LABELS = {"s": "seconds", "Bps": "bytes/s", "ops": "per second", "percentunit": "ratio",
               "suffix: tok/s": "tokens/s", "short": ""}


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() or "value"


def render_dashboard(results: dict, start: float, end: float, path: Path) -> None:
    """Draw every panel at its gridPos (24 columns) from the query results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard_panels()
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(24, rows * 0.62), facecolor="#111217")
    grid = fig.add_gridspec(rows, 24, hspace=2.2, wspace=2.0, left=0.03, right=0.99, top=0.97, bottom=0.02)
    for panel in panels:
        pos = panel["gridPos"]
        ax = fig.add_subplot(grid[pos["y"]:pos["y"] + pos["h"] - 1, pos["x"]:pos["x"] + pos["w"]])
        draw_panel(ax, panel, results, start)
        ax.set_xlim(0, end - start)  # one time range for every panel, as in Grafana
    fig.suptitle("distflow — Grafana dashboard panels from Prometheus (local 2-node run + operator)",
                 color="white", fontsize=14)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=60, facecolor=fig.get_facecolor())
    plt.close(fig)


def draw_panel(ax, panel: dict, results: dict, start: float) -> None:
    """One Grafana time series panel: lines, or areas stacked in query order (not the dashed totals)."""
    import numpy as np

    ax.set_facecolor("#181b1f")
    for spine in ax.spines.values():
        spine.set_color("#333")
    ax.tick_params(colors="#ccc", labelsize=8)
    stacked = panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    stack_top = None
    for target in panel["targets"]:
        for series in results[(panel["title"], target["refId"])]:
            points = np.array([(float(t) - start, float(v)) for t, v in series["values"] if v not in NOT_A_VALUE])
            label = legend(target["legendFormat"], series["metric"])
            dashed = label.endswith((" step", " desired", " checkpoint"))
            if stacked and not dashed:
                seconds = np.arange(0, points[-1, 0] + 1)
                values = np.interp(seconds, points[:, 0], points[:, 1], left=0.0, right=0.0)
                if stack_top is None:
                    stack_top = np.zeros_like(values)
                values = np.pad(values, (0, max(0, len(stack_top) - len(values))))
                stack_top = np.pad(stack_top, (0, max(0, len(values) - len(stack_top))))
                seconds = np.arange(len(values))
                ax.fill_between(seconds, stack_top, stack_top + values, alpha=0.55, label=label, step="post")
                stack_top = stack_top + values
            else:
                ax.plot(points[:, 0], points[:, 1], label=label, linewidth=1.6, linestyle="--" if dashed else "-")
    ax.set_title(panel["title"], color="white", fontsize=11, loc="left")
    ax.set_ylabel(UNIT_LABELS.get(panel["fieldConfig"]["defaults"]["unit"], ""), color="#ccc", fontsize=8)
    ax.set_xlabel("seconds since start", color="#888", fontsize=7)
    ax.legend(fontsize=7, loc="upper left", facecolor="#181b1f", labelcolor="#ddd", framealpha=0.6)
