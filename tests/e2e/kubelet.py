"""A local kubelet for the e2e tier: runs the pods the operator created as local processes.

The control plane has no kubelet (kwok only fakes nodes), so this one plays it
for the pods of one namespace that the scheduler has bound to a node:

- **image**: this interpreter and the ``distflow`` package it imports (its
  directory on an absolute PYTHONPATH); the container command ``distflow`` is
  ``python -m distflow.cli`` (the image's entry point).
- **env**: the pod's own env, ``valueFrom.fieldRef`` resolved, over the image's
  environment minus any Kubernetes credentials (the pods run without a token).
- **volumes**: a ConfigMap volume is written to a directory per pod and kept
  up to date while the pod runs (each key replaced by a rename, a removed key
  deleted), as the kubelet syncs it (here every pass, not every minute); an
  emptyDir is a fresh directory (one at /dev/shm is this host's /dev/shm);
  ``terminationMessagePath`` is a file per pod. Env values and command args
  under a mount path are rewritten to the local path.
- **network**: each pod gets its own loopback address (127.0.0.2, .3, ...) as
  its pod IP. Processes all share this host's port space, so each declared
  ``containerPort`` is bound by the process on a free host port and forwarded
  from ``podIP:containerPort`` (what the operator scrapes and the readiness
  probe reads). Names are resolved from the API, as cluster DNS would:
  ``MASTER_ADDR`` (``<hostname>.<subdomain>.<ns>.svc``) names a pod, so it
  becomes this host and ``MASTER_PORT`` that pod's host port for the
  rendezvous port (a pod is not started before the pod it names exists);
  ``DISTFLOW_METRICS_PORT`` becomes the pod's own host port.
- **status**: Running with podIP and a running container once started, Ready
  once the readiness probe answers, then Succeeded/Failed with the container's
  exit code (128 + signal when killed) and termination message
  (``FallbackToLogsOnError``: the log tail when the file is empty and the code
  is non-zero), as the kubelet writes them.
- **deletion**: a pod that is deleted (or replaced by a new uid) has its
  process group sent SIGTERM, then SIGKILL after the grace period.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import distflow
from tests.controlplane.cluster import ControlPlaneError, free_port

ENTRYPOINTS = {"distflow": [sys.executable, "-m", "distflow.cli"]}
"""Container command[0] -> what runs it here (this interpreter is the image)."""
HOST_ENV_DROPPED_PREFIXES = ("KUBECONFIG", "KUBERNETES_", "DISTFLOW_OPERATOR_")
DEFAULT_TERMINATION_PATH = "/dev/termination-log"
HOST_SHM = "/dev/shm"
MAX_GRACE_S = 5.0
"""Cap on terminationGracePeriodSeconds: tests should not wait 30 s for a SIGTERM."""


def _write_config_map(directory: Path, data: dict[str, str]) -> None:
    """The volume's files: one per key, each replaced whole (a reader never sees half a file)."""
    for key, text in data.items():
        path = directory / key
        if not path.is_file() or path.read_text() != text:
            tmp = directory / f".{key}.tmp"
            tmp.write_text(text)
            tmp.rename(path)
    for path in directory.iterdir():
        if not path.name.startswith(".") and path.name not in data:
            path.unlink()


def _image_env() -> dict[str, str]:
    """This process's environment as the image's: no cluster credentials, and an absolute
    PYTHONPATH that finds distflow (containers start in their own working directory)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(HOST_ENV_DROPPED_PREFIXES)}
    paths = [str(Path(distflow.__file__).resolve().parents[1])]
    paths += [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class ContainerExit:
    """How one pod's container ended, as reported into its status."""

    pod: str
    uid: str
    attempt: str
    exit_code: int
    message: str
    log: Path


@dataclass(frozen=True)
class ContainerEvent:
    """A moment of one container's life as this kubelet saw it (benchmarks time phases with these)."""

    time_s: float
    """``time.time()`` when seen: the process spawned, the probe answered, the exit reaped (each within
    one pass, ``poll_s`` plus an API round trip, of the moment itself)."""
    pod: str
    attempt: str
    what: str
    """``started``, ``ready`` or ``exited``."""


@dataclass
class _Running:
    pod: str
    uid: str
    attempt: str
    proc: subprocess.Popen
    pod_ip: str
    probe_url: str | None
    container: dict[str, Any]
    log: Path
    termination_file: Path
    fallback_to_logs: bool
    started_at: str
    forwarders: list[_Forwarder] = field(default_factory=list)
    ready: bool = False
    config_maps: dict[str, Path] = field(default_factory=dict)
    """ConfigMap name -> the local directory its volume is written to."""


class _Forwarder:
    """TCP forwarding from ``listen_ip:listen_port`` to ``127.0.0.1:target_port`` (the pod network)."""

    def __init__(self, listen_ip: str, listen_port: int, target_port: int):
        self.target_port = target_port
        self._server = socket.create_server((listen_ip, listen_port))
        self._server.settimeout(0.5)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"fwd-{listen_ip}:{listen_port}").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()  # nothing listens yet: the connection is refused, as it would be
                continue
            upstream.settimeout(None)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._server.close()


class LocalKubelet:
    """Runs the bound pods of ``namespace`` as local processes; a context manager.

    Args:
        control_plane: a ``tests.controlplane.cluster.ControlPlane`` (admin access).
        namespace: only pods of this namespace are run.
        workdir: per-pod directories (volumes, logs, termination messages) go here.
        poll_s: how often the pods are listed and the processes checked.

    ``exits`` lists every container that ended (also ones stopped by deletion);
    ``events`` when each container started, became ready and exited; ``kill`` injects a crash. An error inside the kubelet's loop is raised
    from ``stop()``.
    """

    def __init__(self, control_plane: Any, namespace: str, workdir: Path, poll_s: float = 0.25):
        self.cp, self.ns, self.workdir, self.poll_s = control_plane, namespace, Path(workdir), poll_s
        self.exits: list[ContainerExit] = []
        self.events: list[ContainerEvent] = []
        self._running: dict[str, _Running] = {}  # by pod uid
        self._done: set[str] = set()  # uids that ran (a kubelet never restarts a restartPolicy=Never pod)
        self._host_ports: dict[tuple[str, int], int] = {}  # (uid, containerPort) -> host port
        self._outbox: list[tuple[str, str, dict[str, Any]]] = []  # (pod, uid, status patch), oldest first
        self._next_ip = 2
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.api_errors: list[str] = []
        """Failed API calls that were retried (diagnostics)."""

    def __enter__(self) -> LocalKubelet:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="local-kubelet")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the loop and every container still running; re-raise a loop error."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            for run in list(self._running.values()):
                self._terminate(run, grace_s=2.0)
            self._running.clear()
            self._outbox.clear()
        if self.error is not None:
            raise RuntimeError(f"local kubelet failed: {self.error!r}") from self.error

    def kill(self, pod: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the container of pod ``pod`` (chaos: the OOM killer, a crashed node).

        Raises:
            KeyError: no container of that pod is running.
        """
        with self._lock:
            run = next((r for r in self._running.values() if r.pod == pod), None)
            if run is None:
                raise KeyError(f"pod {pod}: no running container")
            os.killpg(run.proc.pid, sig)

    def log_tails(self, lines: int = 30) -> str:
        """The end of every container log so far, for assertion messages."""
        out = []
        for log in sorted(self.workdir.glob("*/container.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.parent.name}\n" + "\n".join(tail))
        if self.api_errors:
            out.append(f"--- retried API errors: {self.api_errors[-5:]}")
        return "\n".join(out)

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._sync()
                except (OSError, ControlPlaneError) as err:
                    # A loaded API server times out now and then: retry, as the real kubelet does
                    # (the test's own deadline decides when the cluster is too slow).
                    self.api_errors.append(repr(err))
                self._stop.wait(self.poll_s)
        except Exception as err:  # noqa: BLE001  (surfaced by stop(); a silently dead kubelet hangs the test)
            self.error = err

    def _sync(self) -> None:
        with self._lock:
            self._flush()
        _, body = self.cp.request("GET", f"/api/v1/namespaces/{self.ns}/pods", expect=(200,))
        pods = {p["metadata"]["uid"]: p for p in body["items"]}
        with self._lock:
            for uid, run in list(self._running.items()):
                pod = pods.get(uid)
                if pod is None or pod["metadata"].get("deletionTimestamp"):
                    grace = (pod or {}).get("spec", {}).get("terminationGracePeriodSeconds", 30)
                    self._terminate(run, grace_s=min(float(grace), MAX_GRACE_S))
                    self._finish(run, report=pod is not None)
                elif run.proc.poll() is not None:
                    self._finish(run, report=True)
                elif not run.ready:
                    self._probe(run)
            for uid, pod in sorted(pods.items(), key=lambda item: item[1]["metadata"]["name"]):
                if (uid not in self._running and uid not in self._done and pod["spec"].get("nodeName")
                        and not pod["metadata"].get("deletionTimestamp")
                        and pod.get("status", {}).get("phase", "Pending") == "Pending"):
                    self._start(pod, pods.values())
            self._refresh_config_maps()
            self._flush()

    # -- starting a container ----------------------------------------------------------------

    def _host_port(self, uid: str, container_port: int) -> int:
        key = (uid, container_port)
        if key not in self._host_ports:
            self._host_ports[key] = free_port()
        return self._host_ports[key]

    def _pod_ip(self) -> str:
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip = self._next_ip + 1 if self._next_ip < 254 else 2
        return ip

    def _volumes(self, pod: dict[str, Any], pod_dir: Path) -> tuple[dict[str, str], dict[str, Path]]:
        """Materialise the pod's volumes; returns ({mountPath: local path} for its container,
        {ConfigMap name: local directory})."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        mounts: dict[str, str] = {}
        config_maps: dict[str, Path] = {}
        for mount in pod["spec"]["containers"][0].get("volumeMounts") or []:
            volume, path = volumes[mount["name"]], mount["mountPath"]
            if "emptyDir" in volume and path == HOST_SHM:
                continue  # this host's /dev/shm is the memory-backed emptyDir
            local = pod_dir / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                name = volume["configMap"]["name"]
                _, cm = self.cp.request("GET", f"/api/v1/namespaces/{self.ns}/configmaps/{name}", expect=(200,))
                _write_config_map(local, cm.get("data") or {})
                config_maps[name] = local
            elif "emptyDir" not in volume:
                raise ValueError(f"pod {pod['metadata']['name']}: volume {mount['name']} kind not supported "
                                 f"by the local kubelet (configMap, emptyDir only)")
            mounts[path.rstrip("/")] = str(local)
        return mounts, config_maps

    def _refresh_config_maps(self) -> None:
        """Bring the ConfigMap volumes of running pods up to date (one LIST per pass)."""
        if not any(run.config_maps for run in self._running.values()):
            return
        _, body = self.cp.request("GET", f"/api/v1/namespaces/{self.ns}/configmaps", expect=(200,))
        data = {cm["metadata"]["name"]: cm.get("data") or {} for cm in body["items"]}
        for run in self._running.values():
            for name, local in run.config_maps.items():
                if name in data:
                    _write_config_map(local, data[name])

    @staticmethod
    def _rewrite_path(value: str, mounts: dict[str, str]) -> str:
        for path in sorted(mounts, key=len, reverse=True):
            if value == path or value.startswith(path + "/"):
                return mounts[path] + value[len(path):]
        return value

    @staticmethod
    def _field_ref(pod: dict[str, Any], path: str) -> str:
        meta = pod["metadata"]
        simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "spec.nodeName": pod["spec"].get("nodeName", ""),
                  "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
                  "status.hostIP": "127.0.0.1"}
        if path in simple:
            return simple[path]
        for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
            if path.startswith(prefix + "['") and path.endswith("']"):
                return (meta.get(source) or {}).get(path[len(prefix) + 2:-2], "")
        raise ValueError(f"pod {meta['name']}: fieldRef {path} not supported by the local kubelet")

    def _resolve(self, host: str, pods: Any) -> dict[str, Any] | None:
        """The pod a `<hostname>.<subdomain>.<ns>.svc[.cluster.local]` name points at."""
        parts = host.split(".")
        if len(parts) < 4 or parts[3] != "svc":
            return None
        for pod in pods:
            spec = pod["spec"]
            if pod["metadata"].get("deletionTimestamp"):
                continue
            if (spec.get("hostname"), spec.get("subdomain"), pod["metadata"]["namespace"]) == tuple(parts[:3]):
                return pod
        return None

    def _env(self, pod: dict[str, Any], pods: Any, pod_ip: str, mounts: dict[str, str]) -> dict[str, str]:
        container = pod["spec"]["containers"][0]
        env = _image_env()
        pod_env: dict[str, str] = {}
        for item in container.get("env") or []:
            if "value" in item:
                pod_env[item["name"]] = item["value"]
            else:
                ref = item["valueFrom"]["fieldRef"]["fieldPath"]
                pod_env[item["name"]] = pod_ip if ref == "status.podIP" else self._field_ref(pod, ref)
        uid = pod["metadata"]["uid"]
        if "MASTER_ADDR" in pod_env:
            master = self._resolve(pod_env["MASTER_ADDR"], pods)
            assert master is not None, "_start checks that MASTER_ADDR resolves"
            pod_env["MASTER_ADDR"] = "127.0.0.1"
            if "MASTER_PORT" in pod_env:
                pod_env["MASTER_PORT"] = str(self._host_port(master["metadata"]["uid"], int(pod_env["MASTER_PORT"])))
        if "DISTFLOW_METRICS_PORT" in pod_env:
            pod_env["DISTFLOW_METRICS_PORT"] = str(self._host_port(uid, int(pod_env["DISTFLOW_METRICS_PORT"])))
        env.update({k: self._rewrite_path(v, mounts) for k, v in pod_env.items()})
        return env

    def _start(self, pod: dict[str, Any], pods: Any) -> None:
        meta, container = pod["metadata"], pod["spec"]["containers"][0]
        master = next((e.get("value") for e in container.get("env") or [] if e["name"] == "MASTER_ADDR"), None)
        if master is not None and self._resolve(master, pods) is None:
            return  # the pod it rendezvous with does not exist yet: try on a later pass
        uid = meta["uid"]
        pod_dir = self.workdir / f"{meta['name']}-{uid[:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)  # a start that failed on an API call is retried
        termination_path = container.get("terminationMessagePath") or DEFAULT_TERMINATION_PATH
        termination_file = pod_dir / "termination-log"
        termination_file.write_text("")
        volumes, config_maps = self._volumes(pod, pod_dir)
        mounts = {**volumes, termination_path: str(termination_file)}
        pod_ip = self._pod_ip()
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        argv = ENTRYPOINTS.get(argv[0], argv[:1]) + [self._rewrite_path(a, mounts) for a in argv[1:]]
        env = self._env(pod, pods, pod_ip, mounts)
        forwarders, probe_url = [], None
        try:
            for port in container.get("ports") or []:
                forwarders.append(_Forwarder(pod_ip, port["containerPort"], self._host_port(uid, port["containerPort"])))
        except OSError:
            for forwarder in forwarders:
                forwarder.close()
            raise
        probe = (container.get("readinessProbe") or {}).get("httpGet")
        if probe:
            named = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
            port = named.get(probe["port"], probe["port"])
            probe_url = f"http://{pod_ip}:{port}{probe.get('path', '/')}"
        log = pod_dir / "container.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, cwd=pod_dir, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        run = _Running(meta["name"], uid, meta.get("labels", {}).get("distflow.io/attempt", ""), proc, pod_ip,
                       probe_url, container, log, termination_file,
                       container.get("terminationMessagePolicy") == "FallbackToLogsOnError", _now(), forwarders,
                       config_maps=config_maps)
        self._running[uid] = run
        self._event(run, "started")
        self._patch_status(run, {"phase": "Running", "hostIP": "127.0.0.1", "podIP": pod_ip,
                                 "podIPs": [{"ip": pod_ip}], "startTime": run.started_at,
                                 "conditions": self._conditions(ready=False, reason="ContainersNotReady"),
                                 "containerStatuses": [self._container_status(run, {
                                     "running": {"startedAt": run.started_at}})]})

    # -- status --------------------------------------------------------------------------------

    @staticmethod
    def _conditions(ready: bool, reason: str) -> list[dict[str, Any]]:
        now = _now()
        out = [{"type": "Initialized", "status": "True", "lastTransitionTime": now}]
        for ctype in ("ContainersReady", "Ready"):
            item = {"type": ctype, "status": "True" if ready else "False", "lastTransitionTime": now}
            if not ready:
                item["reason"] = reason
            out.append(item)
        return out

    @staticmethod
    def _container_status(run: _Running, state: dict[str, Any]) -> dict[str, Any]:
        # null for the other states: the kubelet reports one state per container.
        full = {"waiting": None, "running": None, "terminated": None, **state}
        return {"name": run.container["name"], "image": run.container.get("image", ""), "imageID": "",
                "containerID": f"local://{run.proc.pid}", "ready": run.ready, "restartCount": 0,
                "started": "running" in state, "state": full}

    def _event(self, run: _Running, what: str) -> None:
        self.events.append(ContainerEvent(time.time(), run.pod, run.attempt, what))

    def _patch_status(self, run: _Running, status: dict[str, Any]) -> None:
        """Queue a status update of the pod; sent in order, retried until the API answers."""
        self._outbox.append((run.pod, run.uid, status))

    def _flush(self) -> None:
        while self._outbox:
            pod, uid, status = self._outbox[0]
            # The uid is a precondition (immutable: 422 when a newer pod took the name). 404: the pod
            # is gone (kwok finalises deletions); either way nothing is left to report on.
            self.cp.request("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{pod}/status",
                            {"metadata": {"uid": uid}, "status": status},
                            content_type="application/strategic-merge-patch+json", expect=(200, 404, 409, 422))
            self._outbox.pop(0)

    def _probe(self, run: _Running) -> None:
        if run.probe_url is None:
            run.ready = True
        else:
            try:
                with urllib.request.urlopen(run.probe_url, timeout=1) as response:
                    run.ready = response.status == 200
            except OSError:
                return
        if run.ready:
            self._event(run, "ready")
            self._patch_status(run, {"conditions": self._conditions(ready=True, reason=""),
                                     "containerStatuses": [self._container_status(run, {
                                         "running": {"startedAt": run.started_at}})]})

    def _terminate(self, run: _Running, grace_s: float) -> None:
        if run.proc.poll() is None:
            try:
                os.killpg(run.proc.pid, signal.SIGTERM)
                run.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                return
        try:
            os.killpg(run.proc.pid, signal.SIGKILL)  # the rest of the container's processes
        except ProcessLookupError:
            pass
        run.proc.wait()

    def _message(self, run: _Running, code: int) -> str:
        text = run.termination_file.read_text(errors="replace")[-4096:]
        if not text.strip() and code != 0 and run.fallback_to_logs:
            lines = run.log.read_text(errors="replace").splitlines()[-80:]
            text = "\n".join(lines)[-2048:]
        return text

    def _finish(self, run: _Running, report: bool) -> None:
        """The container ended: report it (unless its pod is gone) and free its ports."""
        self._terminate(run, grace_s=0.0)  # reap strays of the group (the kubelet kills the cgroup)
        code = run.proc.returncode if run.proc.returncode >= 0 else 128 - run.proc.returncode
        message = self._message(run, code)
        for forwarder in run.forwarders:
            forwarder.close()
        self._running.pop(run.uid, None)
        self._done.add(run.uid)
        self.exits.append(ContainerExit(run.pod, run.uid, run.attempt, code, message, run.log))
        self._event(run, "exited")
        run.ready = False
        if report:
            terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                          "startedAt": run.started_at, "finishedAt": _now(),
                          "containerID": f"local://{run.proc.pid}"}
            if message:
                terminated["message"] = message
            self._patch_status(run, {
                "phase": "Succeeded" if code == 0 else "Failed",
                "conditions": self._conditions(ready=False, reason="PodCompleted"),
                "containerStatuses": [self._container_status(run, {"terminated": terminated})]})
