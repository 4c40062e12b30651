"""A real Kubernetes control plane for the operator and e2e test tiers.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok run as
local processes built from pinned Go modules (see build.sh, versions.env);
kwok turns annotated Node objects into fake GPU nodes and moves bound pods
from Pending to Running. No containers run: tests (or the e2e harness) write
terminal pod phases themselves with :meth:`ControlPlane.set_pod_phase`.

A component that exits on its own is started again with the same arguments,
as a real cluster's kubelet (static pods) or systemd does: kube-scheduler, for
one, exits by design when its cache finds a pod on another node than it had
it on, which a watch gap makes happen (a node pod deleted and re-created under
the same name while the API server was down). Each such exit is recorded in
:attr:`ControlPlane.restarts`.

Approach after envtest (controller-runtime) and kwok's own kwokctl "binary"
runtime; see the repository's testbed notes.
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
KWOK_STAGES = HERE / "kwok-stages.yaml"
REQUIRED_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
SERVICE_CIDR = "10.96.0.0/16"
FRONT_PROXY_CLIENT = "front-proxy-client"
"""CN of the certificate the API server presents to extension API servers (APIService backends)."""
HPA_SYNC_PERIOD_S = 2
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
TERMINAL_EXIT_CODES = {"Succeeded": 0, "Failed": 1}
SUPERVISE_INTERVAL_S = 0.5
MIN_RUN_BEFORE_RESTART_S = 1.0
"""A component that exits is started again no sooner than this after its last start."""


class ControlPlaneError(RuntimeError):
    """A component did not start; the message carries the tail of its log."""


def run_build_script(script: Path, timeout_s: float = 3600.0) -> Path:
    """Run a build script (a no-op when its cache is warm) and return its last stdout line as a path.

    Raises:
        ControlPlaneError: the build failed; the message has its output tail.
    """
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise ControlPlaneError(f"{script.name} failed (exit {proc.returncode}):\n{tail}")
    return Path(lines[-1])


def _terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns once the process is gone."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def build_binaries(timeout_s: float = 3600.0) -> Path:
    """Run build.sh and return the bin dir (see ``run_build_script``)."""
    return run_build_script(BUILD_SCRIPT, timeout_s)


def missing_binaries(bin_dir: Path | None) -> list[str]:
    """Names from REQUIRED_BINARIES that are not executable files in bin_dir."""
    if bin_dir is None:
        return list(REQUIRED_BINARIES)
    return [b for b in REQUIRED_BINARIES if not os.access(Path(bin_dir) / b, os.X_OK)]


def http_ok(url: str) -> bool:
    """Whether GET ``url`` answers 200 within 2 s (a readiness probe)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    # Children die if the test process is killed without running stop(). SIGKILL:
    # a kube-apiserver whose etcd got SIGTERM too retries instead of exiting.
    # Runs between fork and exec: no imports, no allocation-heavy Python here.
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pdeathsig_hook():
    # PDEATHSIG fires when the forking *thread* exits, so only from the main thread or the
    # supervisor, which lives until ControlPlane.stop() has stopped every process.
    thread = threading.current_thread()
    long_lived = thread is threading.main_thread() or thread.name == SUPERVISOR_THREAD
    return _die_with_parent if long_lived else None


SUPERVISOR_THREAD = "controlplane-supervisor"


@dataclass
class _Component:
    name: str
    args: list[str]
    proc: subprocess.Popen
    log_path: Path
    started_at: float


@dataclass(frozen=True)
class ComponentExit:
    """A control plane component that exited on its own and was started again."""

    name: str
    returncode: int
    at: float
    """time.time() when the exit was seen."""
    log_tail: str
    """The last lines of its log before the exit."""

    def __str__(self) -> str:
        last = self.log_tail.splitlines()[-1] if self.log_tail else ""
        return f"{self.name} exited {self.returncode} at {time.strftime('%H:%M:%S', time.gmtime(self.at))}: {last}"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def generate_pki(directory: Path) -> None:
    """Write ca.{crt,key}, apiserver.{crt,key} (CA-signed, SANs for 127.0.0.1),
    the service-account key pair sa.{key,pub}, and for the aggregation layer a
    front-proxy-ca.{crt,key} with the client certificate the API server presents
    to extension API servers, front-proxy-client.{crt,key}; all EC P-256 (fast to make).

    Raises:
        subprocess.CalledProcessError: openssl failed.
    """
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
             "-subj", "/CN=distflow-test-ca", cwd=directory)
    _openssl("req", "-new", *ec, "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=directory)
    (directory / "apiserver.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
        "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n")
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-set_serial", "2", "-days", "3650", "-extfile", "apiserver.ext",
             "-out", "apiserver.crt", cwd=directory)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=directory)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)
    # A CA of its own, as kubeadm does: a certificate of the cluster CA must not pass as the front proxy.
    _openssl("req", "-x509", *ec, "-keyout", "front-proxy-ca.key", "-out", "front-proxy-ca.crt", "-days", "3650",
             "-subj", "/CN=distflow-test-front-proxy-ca", cwd=directory)
    _openssl("req", "-new", *ec, "-keyout", "front-proxy-client.key", "-out", "front-proxy-client.csr",
             "-subj", f"/CN={FRONT_PROXY_CLIENT}", cwd=directory)
    (directory / "front-proxy-client.ext").write_text("basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", "front-proxy-client.csr", "-CA", "front-proxy-ca.crt",
             "-CAkey", "front-proxy-ca.key", "-set_serial", "2", "-days", "3650",
             "-extfile", "front-proxy-client.ext", "-out", "front-proxy-client.crt", cwd=directory)


def kubeconfig_text(server: str, ca_file: Path, token: str, user: str = "admin") -> str:
    """A kubeconfig (YAML) for one cluster, one token user, one context."""
    ca = base64.b64encode(Path(ca_file).read_bytes()).decode()
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "distflow-test",
        "clusters": [{"name": "distflow-test",
                      "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "distflow-test",
                      "context": {"cluster": "distflow-test", "user": user}}],
    })


def fake_node(name: str, gpus: int = 8) -> dict[str, Any]:
    """A Node object kwok manages: 64 CPU, 512Gi, 110 pods, `gpus` nvidia.com/gpu."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": dict([KWOK_NODE_ANNOTATION]),
                     "labels": {"type": "kwok", "kubernetes.io/hostname": name,
                                "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
        "status": {"allocatable": resources, "capacity": resources},
    }


class ControlPlane:
    """etcd + kube-apiserver + controller-manager + scheduler + kwok on 127.0.0.1.

    Use as a context manager; on exit every process it started is stopped by
    pid (SIGTERM, then SIGKILL after `stop_timeout_s`) and its work dir removed
    (kept when DISTFLOW_KEEP_CONTROLPLANE=1). Component logs are
    `<workdir>/<component>.log`.

    Args:
        bin_dir: directory holding REQUIRED_BINARIES (see build_binaries).
        nodes: number of fake kwok nodes `kwok-node-<i>` to create.
        pods_become_running: when False, kwok leaves pod phases alone except
            for deleting terminating pods, so a harness sets every phase.
        start_timeout_s: seconds each component may take to become ready.

    Raises:
        ControlPlaneError: from start(), a component exited or was not ready in
            time; the message has its log tail and the work dir.
    """

    def __init__(self, bin_dir: str | Path, *, nodes: int = 2, pods_become_running: bool = True,
                 start_timeout_s: float = 60.0, stop_timeout_s: float = 10.0) -> None:
        missing = missing_binaries(Path(bin_dir))
        if missing:
            raise ValueError(f"bin_dir {bin_dir} lacks {missing}; run {BUILD_SCRIPT} first")
        self.bin_dir = Path(bin_dir)
        self.node_names = [f"kwok-node-{i}" for i in range(nodes)]
        self.pods_become_running = pods_become_running
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.workdir: Path | None = None
        self.token = base64.b32encode(os.urandom(20)).decode().lower()
        self.server = ""
        self.kubeconfig = Path()
        self.ca_file = Path()
        self._components: list[_Component] = []
        self._lock = threading.RLock()
        self._starting: set[str] = set()
        """Components a caller is waiting for (``_wait``): it, not the supervisor, handles their exit."""
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()
        self.restarts: list[ComponentExit] = []
        """Every exit of a component that the test did not cause, oldest first."""
        self._ssl: ssl.SSLContext | None = None

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- lifecycle -------------------------------------------------------

    def start(self) -> ControlPlane:
        """Start all components, create the fake nodes, wait until they are Ready."""
        self.workdir = Path(tempfile.mkdtemp(prefix="distflow-cp-"))
        atexit.register(self.stop)
        try:
            generate_pki(self.workdir)
            self.ca_file = self.workdir / "ca.crt"
            self._ssl = ssl.create_default_context(cafile=str(self.ca_file))
            self._start_etcd()
            self._start_apiserver()
            self._start_controllers()
            for name in self.node_names:
                self.request("POST", "/api/v1/nodes", fake_node(name), expect=(201,))
            self._wait_nodes_ready()
        except BaseException:
            self.stop(keep_workdir=True)
            raise
        self._stopping.clear()
        self._supervisor = threading.Thread(target=self._supervise, name=SUPERVISOR_THREAD, daemon=True)
        self._supervisor.start()
        return self

    def stop(self, keep_workdir: bool = False) -> None:
        """Stop every started process by pid, newest first; idempotent.

        One at a time, so the API server drains while etcd is still up
        (with etcd gone it retries until killed).
        """
        self._stopping.set()
        with self._lock:  # the supervisor, seeing _stopping under this lock, starts nothing more
            for component in reversed(self._components):
                if component.proc.poll() is None:
                    _terminate(component.proc, self.stop_timeout_s)
            self._components.clear()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None
        atexit.unregister(self.stop)
        keep = keep_workdir or os.environ.get("DISTFLOW_KEEP_CONTROLPLANE") == "1"
        if self.workdir is not None and not keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        assert self.workdir is not None
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([str(self.bin_dir / name), *args], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.workdir, preexec_fn=_pdeathsig_hook())  # noqa: PLW1509
        with self._lock:
            self._components.append(_Component(name, args, proc, log_path, time.monotonic()))
        return proc

    def pid(self, name: str) -> int:
        """The process id of component ``name`` (e.g. "kube-scheduler")."""
        with self._lock:
            return next(c.proc.pid for c in self._components if c.name == name)

    def _take(self, name: str) -> subprocess.Popen:
        """Remove component ``name`` from supervision (the caller stops it) and return its process."""
        with self._lock:
            component = next(c for c in self._components if c.name == name)
            self._components.remove(component)
        return component.proc

    def _supervise(self) -> None:
        """Start again every component that exited on its own (see the module docstring)."""
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            with self._lock:
                if self._stopping.is_set():
                    return
                for component in list(self._components):
                    if component.proc.poll() is None or component.name in self._starting:
                        continue
                    if time.monotonic() - component.started_at < MIN_RUN_BEFORE_RESTART_S:
                        continue  # a crash loop restarts once a second at most
                    tail = "\n".join(component.log_path.read_text(errors="replace").splitlines()[-5:])
                    self.restarts.append(ComponentExit(component.name, component.proc.returncode, time.time(), tail))
                    self._components.remove(component)
                    with open(component.log_path, "a") as log:
                        log.write(f"\n--- exited {component.proc.returncode}; started again by the test harness\n")
                    self._spawn(component.name, component.args)

    def _fail(self, name: str, why: str) -> ControlPlaneError:
        log = self.workdir / f"{name}.log" if self.workdir else None
        tail = ""
        if log is not None and log.exists():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        return ControlPlaneError(f"{name} {why} (work dir {self.workdir}); log tail:\n{tail}")

    def _wait(self, name: str, ready, timeout_s: float | None = None) -> None:
        """Poll ``ready()`` until true; raise if a component exits meanwhile (only ``name`` once the
        supervisor runs: it starts the others again) or at the timeout."""
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        with self._lock:
            self._starting.add(name)
        try:
            while time.monotonic() < deadline:
                with self._lock:
                    watched = [c for c in self._components if self._supervisor is None or c.name == name]
                for component in watched:
                    if component.proc.poll() is not None:
                        raise self._fail(component.name, f"exited with code {component.proc.returncode}")
                try:
                    if ready():
                        return
                except (OSError, urllib.error.URLError, ssl.SSLError):
                    pass
                time.sleep(0.1)
            raise self._fail(name, f"not ready after {timeout_s or self.start_timeout_s:.0f} s")
        finally:
            with self._lock:
                self._starting.discard(name)

    # -- components ------------------------------------------------------

    def _start_etcd(self) -> None:
        client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        self._spawn("etcd", [
            "--name=default", f"--data-dir={self.workdir / 'etcd-data'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}", "--unsafe-no-fsync", "--log-level=warn",
            "--quota-backend-bytes=2147483648",
        ])
        self._etcd_url = client

        def healthy() -> bool:
            with urllib.request.urlopen(f"{client}/health", timeout=2) as r:
                return json.load(r).get("health") == "true"

        self._wait("etcd", healthy)

    def _start_apiserver(self, port: int | None = None) -> None:
        assert self.workdir is not None
        port = port or free_port()
        self.server = f"https://127.0.0.1:{port}"
        (self.workdir / "tokens.csv").write_text(f'{self.token},admin,admin-uid,"system:masters"\n')
        w = self.workdir
        self._spawn("kube-apiserver", [
            f"--etcd-servers={self._etcd_url}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--tls-cert-file={w / 'apiserver.crt'}", f"--tls-private-key-file={w / 'apiserver.key'}",
            f"--client-ca-file={w / 'ca.crt'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={w / 'sa.pub'}",
            f"--service-account-signing-key-file={w / 'sa.key'}",
            f"--token-auth-file={w / 'tokens.csv'}", "--authorization-mode=Node,RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            # As on hardened clusters: setting blockOwnerDeletion needs update on the owner's finalizers.
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            # A loopback advertise address is refused by the endpoint reconciler;
            # nothing runs in-cluster, so the `kubernetes` Service needs no endpoints.
            "--endpoint-reconciler-type=none", "--v=1",
            # The aggregation layer (APIService), for extension API servers such as KEDA's metrics server.
            f"--requestheader-client-ca-file={w / 'front-proxy-ca.crt'}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={w / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={w / 'front-proxy-client.key'}",
        ])
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.kubeconfig.write_text(kubeconfig_text(self.server, self.ca_file, self.token))
        self._wait("kube-apiserver", lambda: self.request("GET", "/readyz")[0] == 200)

    def restart_apiserver(self, while_down: Any = None) -> None:
        """Stop kube-apiserver (SIGTERM), run ``while_down()`` if given, start it again on the same
        port and wait for /readyz. Clients keep their kubeconfig; their watches break."""
        _terminate(self._take("kube-apiserver"), self.stop_timeout_s)
        if while_down is not None:
            while_down()
        self._start_apiserver(port=int(self.server.rsplit(":", 1)[1]))

    def etcd(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call to etcd's v3 JSON gateway, e.g. ``etcd("kv/range", {"key": b64})``: tests use it to
        change storage behind the API server's back (a missed delete, a compaction)."""
        req = urllib.request.Request(f"{self._etcd_url}/v3/{method}", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.load(resp)

    def _start_controllers(self) -> None:
        assert self.workdir is not None
        w, kc = self.workdir, f"--kubeconfig={self.kubeconfig}"
        # secure-port=0: no serving endpoints, so no port clashes and no
        # delegated-authn lookups; the tests never scrape these components.
        self._spawn("kube-controller-manager", [
            kc, "--leader-elect=false", "--secure-port=0", "--controllers=*",
            f"--service-account-private-key-file={w / 'sa.key'}", f"--root-ca-file={w / 'ca.crt'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--v=1",
            # HorizontalPodAutoscalers (KEDA's) act within seconds, not the default 15 s.
            f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD_S}s",
        ])
        self._spawn("kube-scheduler", [kc, "--leader-elect=false", "--secure-port=0", "--v=1"])
        stages = [s for s in yaml.safe_load_all(KWOK_STAGES.read_text())
                  if self.pods_become_running or s["metadata"]["name"] != "pod-ready"]
        (w / "kwok.yaml").write_text(yaml.safe_dump_all(stages))
        self.start_kwok()

    def start_kwok(self) -> None:
        """Start kwok, the kubelet of every fake node (again, after :meth:`stop_kwok`)."""
        assert self.workdir is not None
        key, value = KWOK_NODE_ANNOTATION
        self._spawn("kwok", [
            f"--kubeconfig={self.kubeconfig}", f"--config={self.workdir / 'kwok.yaml'}",
            "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={key}={value}",
            "--node-lease-duration-seconds=40",
        ])

    def stop_kwok(self) -> None:
        """Kill kwok: the nodes' kubelets are gone, so deleted pods stay Terminating.

        Unlike a paused (SIGSTOP) kwok, a restarted one starts from a fresh LIST:
        kwok deletes pods by name, without the uid precondition a kubelet uses, so a
        paused kwok's backlog would delete a new pod that reuses a deleted one's name.
        """
        proc = self._take("kwok")
        proc.kill()
        proc.wait()

    def _wait_nodes_ready(self) -> None:
        def all_ready() -> bool:
            _, body = self.request("GET", "/api/v1/nodes?labelSelector=type%3Dkwok")
            ready = {n["metadata"]["name"] for n in body.get("items", [])
                     if any(c["type"] == "Ready" and c["status"] == "True"
                            for c in n.get("status", {}).get("conditions", []))}
            return ready >= set(self.node_names)

        self._wait("kwok", all_ready)

    # -- clients ---------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, token: str | None = None,
                content_type: str = "application/json",
                expect: tuple[int, ...] | None = None) -> tuple[int, dict[str, Any]]:
        """One API call; returns (HTTP status, decoded JSON body or {}).

        Args:
            path: API path with query, e.g. "/api/v1/namespaces/ns/pods".
            token: bearer token; the admin token when None.
            content_type: e.g. "application/merge-patch+json" for PATCH.
            expect: statuses that count as success; others raise.

        Raises:
            ControlPlaneError: status not in `expect`.
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {token or self.token}", "Content-Type": content_type,
            "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self._ssl, timeout=30) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            decoded = json.loads(raw) if raw else {}
        except ValueError:
            decoded = {"raw": raw.decode(errors="replace")}
        if expect is not None and status not in expect:
            raise ControlPlaneError(f"{method} {path} -> {status}: {decoded}")
        return status, decoded

    def kubectl(self, *args: str, token: str | None = None, input: str | None = None,
                check: bool = False, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster (admin unless `token`); text output."""
        cmd = [KUBECTL, f"--kubeconfig={self.kubeconfig}", *args]
        if token is not None:
            cmd.insert(2, f"--token={token}")
        return subprocess.run(cmd, input=input, capture_output=True, text=True,
                              check=check, timeout=timeout_s)

    def make_token_for_serviceaccount(self, namespace: str, name: str,
                                      expiration_seconds: int = 3600) -> str:
        """A bound token for ServiceAccount namespace/name via the TokenRequest API.

        Raises:
            ControlPlaneError: the ServiceAccount does not exist (404) or the call failed.
        """
        _, body = self.request(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": expiration_seconds}}, expect=(200, 201))
        return body["status"]["token"]

    def write_kubeconfig(self, path: str | Path, token: str, user: str = "user") -> Path:
        """Write a kubeconfig for `token` (e.g. a ServiceAccount's) to `path`."""
        path = Path(path)
        path.write_text(kubeconfig_text(self.server, self.ca_file, token, user))
        return path

    def api_client(self, token: str | None = None):
        """A `kubernetes.client.ApiClient` for this cluster (admin unless `token`)."""
        from kubernetes import config

        path = self.kubeconfig
        if token is not None:
            assert self.workdir is not None
            path = self.write_kubeconfig(self.workdir / f"token-{abs(hash(token))}.kubeconfig", token)
        return config.new_client_from_config(config_file=str(path))

    def set_pod_phase(self, namespace: str, name: str, phase: str,
                      exit_code: int | None = None) -> dict[str, Any]:
        """Write a pod's status.phase as a kubelet would; returns the updated pod.

        Terminal phases ("Succeeded", "Failed") also mark every container
        terminated with `exit_code` (default 0 / 1) and the pod not Ready.

        Raises:
            ValueError: phase not one of Pending, Running, Succeeded, Failed.
            ControlPlaneError: the API rejected the update.
        """
        if phase not in ("Pending", "Running", "Succeeded", "Failed"):
            raise ValueError(f"phase={phase!r}: use Pending, Running, Succeeded or Failed")
        base = f"/api/v1/namespaces/{namespace}/pods/{name}"
        _, pod = self.request("GET", base, expect=(200,))
        status: dict[str, Any] = {"phase": phase}
        if phase in TERMINAL_EXIT_CODES:
            code = TERMINAL_EXIT_CODES[phase] if exit_code is None else exit_code
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            status["containerStatuses"] = [{
                "name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False,
                "restartCount": 0, "started": False,
                # null drops kwok's running/waiting state: one state per container.
                "state": {"running": None, "waiting": None,
                          "terminated": {"exitCode": code, "startedAt": now, "finishedAt": now,
                                         "reason": "Completed" if code == 0 else "Error"}},
            } for c in pod["spec"]["containers"]]
            status["conditions"] = [
                {"type": t, "status": "False", "lastTransitionTime": now, "reason": "PodCompleted"}
                for t in ("Ready", "ContainersReady")]
        _, updated = self.request("PATCH", base + "/status", {"status": status},
                                  content_type="application/strategic-merge-patch+json",
                                  expect=(200,))
        return updated
