"""Kueue's controller manager, with its admission webhooks, next to the test control plane.

build_kueue.sh builds ``sigs.k8s.io/kueue/cmd/kueue`` at the version pinned in
kueue.env and keeps the module's CRDs and webhook configurations beside it.
:class:`Kueue` runs that binary as Kueue's Deployment would, with three changes
so that the webhooks work without a Service network:

- TLS: a serving certificate for 127.0.0.1 signed by the control plane's CA
  (Kueue's own cert rotator issues one for ``kueue-webhook-service.<ns>.svc``,
  which nothing here resolves), so internal cert management is off;
- the webhook configurations call ``https://127.0.0.1:<port>/<path>`` (URL
  clientConfig) with that CA, and only for namespaces labelled
  ``KUEUE_NAMESPACE_LABEL``, so the other tests sharing the API server never
  pass through Kueue (they are deleted again on exit);
- Kueue reads its metrics certificate from the fixed path
  /etc/kueue/metrics/certs when internal cert management is off, so the
  process runs in a private mount namespace (``unshare``) with a tmpfs on /etc
  holding that certificate; nothing is written to the machine's /etc.

Only the plain ``pod`` integration is enabled; leader election, the visibility
server and metrics are off.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import yaml

from tests.controlplane.addon import Addon, issue_local_cert
from tests.controlplane.cluster import ControlPlane, ControlPlaneError, free_port, http_ok, run_build_script

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build_kueue.sh"
MANAGED_LABEL = "kueue.x-k8s.io/managed"
MANAGED_FINALIZER = "kueue.x-k8s.io/managed"
"""The label of the pods Kueue manages, and the finalizer it holds them by."""
KUEUE_NAMESPACE_LABEL = ("distflow.io/kueue-test", "enabled")
WEBHOOK_PREFIX = "distflow-test-kueue"
SERVED_GROUPS = {"", "kueue.x-k8s.io"}
"""Webhooks kept: core pods (the pod integration) and Kueue's own kinds. The
others target integrations that are off here and would refuse every call."""


def build_kueue(timeout_s: float = 3600.0) -> Path:
    """Run build_kueue.sh and return the kueue binary (see ``cluster.run_build_script``)."""
    return run_build_script(BUILD_SCRIPT, timeout_s)


def local_webhooks(manifests: list[dict[str, Any]], port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """Kueue's webhook configurations pointed at 127.0.0.1:port and at labelled namespaces only."""
    key, value = KUEUE_NAMESPACE_LABEL
    out = []
    for doc in manifests:
        hooks = [h for h in doc["webhooks"] if {g for r in h["rules"] for g in r["apiGroups"]} <= SERVED_GROUPS]
        for hook in hooks:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                    "caBundle": base64.b64encode(ca_pem).decode()}
            hook["namespaceSelector"] = {"matchLabels": {key: value}}
        kind = doc["kind"].removesuffix("WebhookConfiguration").lower()
        out.append({**doc, "metadata": {"name": f"{WEBHOOK_PREFIX}-{kind}"}, "webhooks": hooks})
    return out


def kueue_config(webhook_port: int, probe_port: int, cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{probe_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["pod"]},
    }


class Kueue(Addon):
    """Kueue running against `control_plane`; a context manager that stops it by pid.

    Raises:
        ControlPlaneError: from start(), Kueue exited or was not ready in time
            (the message has its log tail), or ``unshare`` is refused here.
    """

    name = "kueue"

    def __init__(self, binary: Path, control_plane: ControlPlane, start_timeout_s: float = 120.0) -> None:
        super().__init__(control_plane, start_timeout_s)
        self.binary = Path(binary)
        self.config_dir = self.binary.parent.parent / "config"

    def start(self) -> None:
        certs = self.prepare()
        issue_local_cert(certs, self.cp.workdir, "kueue-webhook")
        webhook_port, probe_port = free_port(), free_port()
        (self.workdir / "config.yaml").write_text(yaml.safe_dump(kueue_config(webhook_port, probe_port, certs)))
        self.apply_crds(sorted((self.config_dir / "crd").glob("*.yaml")))
        self.cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                      "metadata": {"name": "kueue-system"}}, expect=(201, 409))
        self._start_process(certs)
        self.wait("readyz", lambda: http_ok(f"http://127.0.0.1:{probe_port}/readyz"))
        manifests = list(yaml.safe_load_all((self.config_dir / "webhook.yaml").read_text()))
        hooks = local_webhooks([m for m in manifests if m], webhook_port, (self.cp.workdir / "ca.crt").read_bytes())
        out = self.cp.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(h) for h in hooks))
        if out.returncode != 0:
            raise ControlPlaneError(f"kueue webhook configurations: {out.stderr}")

    def _start_process(self, certs: Path) -> None:
        # A tmpfs on /etc in a private mount namespace: Kueue's fixed metrics-cert path, nowhere else.
        script = ("mount -t tmpfs tmpfs /etc && mkdir -p /etc/kueue/metrics/certs && "
                  f"cp {certs}/tls.crt {certs}/tls.key /etc/kueue/metrics/certs/ && exec \"$@\"")
        # As root, no user namespace: the credentials stay, and with them the parent-death signal.
        userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        cmd = ["unshare", *userns, "--mount", "--propagation", "private", "sh", "-c", script, "kueue", str(self.binary), f"--config={self.workdir / 'config.yaml'}",
               "--feature-gates=VisibilityOnDemand=false", f"--kubeconfig={self.cp.kubeconfig}"]
        self.spawn("kueue", cmd)

    def stop(self) -> None:
        """Remove the webhook configurations first (pods must not wait on a stopped webhook), then Kueue,
        then Kueue's finalizer from the pods it still held: the last test's namespace is still being
        deleted, and a pod that keeps the finalizer stays Terminating on its node, with its GPUs,
        for every later test of the session."""
        for kind in ("mutating", "validating"):
            self.cp.kubectl("delete", "--ignore-not-found", f"{kind}webhookconfiguration",
                            f"{WEBHOOK_PREFIX}-{kind}")
        super().stop()
        _, pods = self.cp.request("GET", f"/api/v1/pods?labelSelector={MANAGED_LABEL}%3Dtrue", expect=(200,))
        for pod in pods.get("items", []):
            meta = pod["metadata"]
            kept = [f for f in meta.get("finalizers") or [] if f != MANAGED_FINALIZER]
            if kept != (meta.get("finalizers") or []):
                self.cp.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                {"metadata": {"finalizers": kept, "resourceVersion": meta["resourceVersion"]}},
                                content_type="application/merge-patch+json", expect=(200, 404, 409))
