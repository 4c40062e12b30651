"""Chaos-tier helpers: operator replicas as processes that can be SIGKILLed, a pod observer
that counts duplicate children, and bad RLPostTrainJobs generated from the CRD schema."""

from __future__ import annotations

import copy
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

from tests.controlplane.cluster import free_port
from tests.operator._helpers import REPO

LEASE_S = 3.0


class Replicas:
    """distflow-operator processes electing a leader through a Lease in ``namespace``."""

    def __init__(self, control_plane: Any, kubeconfig: Path, namespace: str, log_dir: Path):
        self.cp, self.kubeconfig, self.ns, self.log_dir = control_plane, kubeconfig, namespace, log_dir
        self.procs: list[subprocess.Popen] = []
        self.metrics_ports: dict[int, int] = {}
        """pid -> the replica's /metrics port."""
        self.kills = 0

    def start(self) -> subprocess.Popen:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "operator"),
                                              os.environ.get("PYTHONPATH", "")])}
        log = open(self.log_dir / f"operator-{len(self.procs)}.log", "w")  # noqa: SIM115 (closed with the process)
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "distflow_operator", "-n", self.ns, "--metrics-port", str(port), "--liveness-port",
             "0", "--resync-interval", "2", "--leader-election-namespace", self.ns,
             "--lease-duration", str(LEASE_S)], env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.metrics_ports[proc.pid] = port
        return proc

    def pods_received(self) -> float:
        """Pods the live replicas were sent, watch events and LISTs together (their own metrics)."""
        total = 0.0
        for proc in self.procs:
            if proc.poll() is not None:
                continue
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[proc.pid]}/metrics", timeout=5) as r:
                text = r.read().decode()
            total += sum(float(line.split()[-1]) for line in text.splitlines()
                         if line.startswith(("distflow_operator_pod_events_total ",
                                             "distflow_operator_pods_listed_total ")))
        return total

    def leader_pid(self) -> int | None:
        status, lease = self.cp.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases/"
                                               "distflow-operator")
        holder = (lease.get("spec") or {}).get("holderIdentity") if status == 200 else None
        return int(holder.rsplit("-", 2)[1]) if holder else None

    def live_leader(self) -> subprocess.Popen | None:
        """The replica holding the Lease, if it is alive (a killed one holds it until it expires)."""
        pid = self.leader_pid()
        return next((p for p in self.procs if p.pid == pid and p.poll() is None), None)

    def kill_leader(self) -> bool:
        proc = self.live_leader()
        if proc is None:
            return False
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.kills += 1
        return True

    def rss_mib(self) -> float:
        return max(psutil.Process(p.pid).memory_info().rss for p in self.procs if p.poll() is None) / 2**20

    def crashed(self) -> list[str]:
        """Log tails of replicas that exited on their own (not SIGKILLed by the test, not stopped by it)."""
        bad = []
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None and proc.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM):
                bad.append((self.log_dir / f"operator-{i}.log").read_text(errors="replace")[-3000:])
        return bad

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class PodObserver(threading.Thread):
    """Polls a namespace's pods; a (job, attempt, rank) seen with two uids is a duplicate child."""

    def __init__(self, control_plane: Any, namespace: str, interval_s: float = 0.1):
        super().__init__(daemon=True)
        self.cp, self.ns, self.interval_s = control_plane, namespace, interval_s
        self.uids: dict[tuple[str, str, str], set[str]] = defaultdict(set)
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                status, body = self.cp.request("GET", f"/api/v1/namespaces/{self.ns}/pods")
            except OSError:  # the API server is restarting
                status, body = 0, {}
            for pod in body.get("items", []) if status == 200 else []:
                labels = pod["metadata"].get("labels") or {}
                if "distflow.io/job-name" in labels:
                    key = (labels["distflow.io/job-name"], labels.get("distflow.io/attempt", "?"),
                           labels.get("distflow.io/node-rank", "?"))
                    self.uids[key].add(pod["metadata"]["uid"])
            time.sleep(self.interval_s)

    def duplicates(self) -> int:
        self._done.set()
        self.join(timeout=5)
        return sum(len(uids) - 1 for uids in self.uids.values())


def _leaves(schema: dict, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict]]:
    """(path, schema) of every property below ``schema``, objects included, arrays not entered."""
    out = []
    for name, sub in (schema.get("properties") or {}).items():
        out.append(((*path, name), sub))
        if sub.get("type") == "object":
            out.extend(_leaves(sub, (*path, name)))
    return out


def _set(doc: dict, path: tuple[str, ...], value: Any) -> dict:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node.get(key, {}), dict) else {}
    node[path[-1]] = value
    return doc


def bad_specs(crd: dict, example_spec: dict, count: int, seed: int = 0) -> list[tuple[str, dict]]:
    """``count`` specs the schema must reject: wrong types, values past minimum/maximum, values
    outside an enum, unknown fields (rejected under strict field validation)."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    candidates: list[tuple[str, dict]] = []
    wrong = {"integer": "seven", "number": "many", "boolean": "maybe", "string": {"an": "object"},
             "object": "flat", "array": {"not": "a list"}}
    for path, sub in _leaves(schema):
        where = ".".join(path)
        kind = sub.get("type")
        if kind in wrong and not sub.get("x-kubernetes-int-or-string") and not sub.get("anyOf"):
            candidates.append((f"{where}: wrong type", _set(example_spec, path, wrong[kind])))
        if "minimum" in sub:
            candidates.append((f"{where}: below minimum", _set(example_spec, path, sub["minimum"] - 1)))
        if "maximum" in sub:
            candidates.append((f"{where}: above maximum", _set(example_spec, path, sub["maximum"] + 1)))
        if "enum" in sub:
            candidates.append((f"{where}: not in enum", _set(example_spec, path, "not-a-choice")))
        if kind == "object" and sub.get("properties") and not sub.get("x-kubernetes-preserve-unknown-fields") \
                and not sub.get("additionalProperties"):
            candidates.append((f"{where}: unknown field", _set(example_spec, (*path, "notAField"), 1)))
    random.Random(seed).shuffle(candidates)
    return (candidates * (count // max(len(candidates), 1) + 1))[:count]
