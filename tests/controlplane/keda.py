"""KEDA's operator and metrics API server next to the test control plane.

build_keda.sh builds ``./cmd/operator`` and ``./cmd/adapter`` of
``github.com/kedacore/keda/v2`` at the version pinned in keda.env and keeps
the module's CRDs beside them. :class:`Keda` runs both as local processes, as
KEDA's two Deployments would, with these changes so that they work without a
Service network or mounted secrets:

- the gRPC link between them (the metrics server asks the operator, which
  runs the scalers) uses one certificate for 127.0.0.1, signed by the control
  plane's CA, in a directory both read (``ca.crt``, ``tls.crt``, ``tls.key``;
  KEDA's cert rotation, webhook and APIService patching are off);
- the metrics server is registered with the aggregation layer as the
  APIService ``v1beta1.external.metrics.k8s.io`` whose Service is of type
  ExternalName ``localhost``: without ``--enable-aggregator-routing`` the API
  server's aggregator dials ``<externalName>:<APIService port>`` for such a
  Service (ClusterIP Services need a routable cluster IP, and Endpoints may
  not hold loopback addresses). TLS to it is not verified
  (``insecureSkipTLSVerify``, as KEDA's chart does by default); the metrics
  server authenticates the aggregator's front-proxy certificate against the
  request-header CA the API server publishes (kube-system's
  extension-apiserver-authentication ConfigMap).

The control plane's kube-controller-manager runs the HorizontalPodAutoscaler
controller that KEDA's ScaledObjects create HPAs for. Admission webhooks are
not run. Stop order: the APIService first (so discovery does not wait on a
stopped server), then both processes, by pid.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.controlplane.addon import Addon, issue_local_cert
from tests.controlplane.cluster import ControlPlane, ControlPlaneError, free_port, http_ok

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build_keda.sh"
KEDA_NAMESPACE = "keda"
METRICS_SERVICE = "keda-metrics-apiserver"
EXTERNAL_METRICS_API = "v1beta1.external.metrics.k8s.io"


def cached_keda_bin() -> tuple[Path | None, str]:
    """(bin directory, "") when build_keda.sh's cache holds the binaries, else (None, why).
    DISTFLOW_KEDA_BIN names a directory of prebuilt ``keda-operator`` and ``keda-adapter``."""
    prebuilt = os.environ.get("DISTFLOW_KEDA_BIN")
    if prebuilt:
        bin_dir = Path(prebuilt)
    else:
        out = subprocess.run(["bash", str(BUILD_SCRIPT), "--cached"], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            return None, out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        bin_dir = Path(out.stdout.strip().splitlines()[-1])
    missing = [b for b in ("keda-operator", "keda-adapter") if not os.access(bin_dir / b, os.X_OK)]
    return (None, f"missing {', '.join(missing)} in {bin_dir}") if missing else (bin_dir, "")


def metrics_api_objects(port: int) -> list[dict]:
    """The ExternalName Service and the APIService that route external.metrics.k8s.io to 127.0.0.1:port."""
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": METRICS_SERVICE, "namespace": KEDA_NAMESPACE},
         "spec": {"type": "ExternalName", "externalName": "localhost"}},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": EXTERNAL_METRICS_API},
         "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1", "groupPriorityMinimum": 100,
                  "versionPriority": 100, "insecureSkipTLSVerify": True,
                  "service": {"name": METRICS_SERVICE, "namespace": KEDA_NAMESPACE, "port": port}}},
    ]


class Keda(Addon):
    """KEDA running against `control_plane`; a context manager that stops it by pid.

    Raises:
        ControlPlaneError: from start(), a process exited or was not ready in time (the message
            has its log tail), or the API server did not mark the external metrics API Available.
    """

    name = "keda"

    def __init__(self, bin_dir: Path, control_plane: ControlPlane, start_timeout_s: float = 120.0) -> None:
        super().__init__(control_plane, start_timeout_s)
        self.bin_dir = Path(bin_dir)
        self.config_dir = self.bin_dir.parent / "config"

    def start(self) -> None:
        certs = self.prepare()
        # Both ends of KEDA's mutual-TLS gRPC link present it and trust the CA next to it.
        issue_local_cert(certs, self.cp.workdir, "keda-operator", "serverAuth,clientAuth")
        shutil.copy(self.cp.workdir / "ca.crt", certs / "ca.crt")
        self.apply_crds(sorted((self.config_dir / "crd").glob("*.yaml")))
        self.cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                      "metadata": {"name": KEDA_NAMESPACE}}, expect=(201, 409))
        env = {**os.environ, "KUBECONFIG": str(self.cp.kubeconfig), "POD_NAMESPACE": KEDA_NAMESPACE,
               "KEDA_CLUSTER_OBJECT_NAMESPACE": KEDA_NAMESPACE, "WATCH_NAMESPACE": ""}
        grpc_port, probe_port, secure_port = free_port(), free_port(), free_port()
        self.spawn("keda-operator", [
            str(self.bin_dir / "keda-operator"), f"--metrics-service-bind-address=127.0.0.1:{grpc_port}",
            f"--health-probe-bind-address=127.0.0.1:{probe_port}", "--metrics-bind-address=0",
            f"--cert-dir={certs}", "--enable-cert-rotation=false", "--enable-webhook-patching=false",
            "--enable-apiservice-patching=false", "--leader-elect=false", "--zap-log-level=info"], env)
        self.wait("operator", lambda: http_ok(f"http://127.0.0.1:{probe_port}/readyz"))
        self.spawn("keda-adapter", [
            str(self.bin_dir / "keda-adapter"), f"--metrics-service-address=127.0.0.1:{grpc_port}",
            f"--port={free_port()}", f"--secure-port={secure_port}", "--bind-address=127.0.0.1",
            f"--cert-dir={certs}", f"--tls-cert-file={certs / 'tls.crt'}",
            f"--tls-private-key-file={certs / 'tls.key'}",
            f"--lister-kubeconfig={self.cp.kubeconfig}", f"--authentication-kubeconfig={self.cp.kubeconfig}",
            f"--authorization-kubeconfig={self.cp.kubeconfig}", "--v=2"], env)
        out = self.cp.kubectl("apply", "-f", "-",
                              input="\n---\n".join(yaml.safe_dump(o) for o in metrics_api_objects(secure_port)))
        if out.returncode != 0:
            raise ControlPlaneError(f"keda APIService: {out.stderr}")
        self.wait("external metrics APIService", self._metrics_api_available)

    def _metrics_api_available(self) -> bool:
        code, body = self.cp.request("GET", f"/apis/apiregistration.k8s.io/v1/apiservices/{EXTERNAL_METRICS_API}")
        conditions = ((body.get("status") or {}).get("conditions") or []) if code == 200 else []
        return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)

    def stop(self) -> None:
        """The APIService first: discovery must not wait on a stopped server."""
        self.cp.kubectl("delete", "--ignore-not-found", "apiservice", EXTERNAL_METRICS_API)
        super().stop()
