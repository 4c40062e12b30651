"""The helm chart with real Helm against the test control plane.

- ``helm lint --strict`` and ``helm template`` for each mode (cluster-wide,
  watchNamespaces, batchScheduler, monitors); the values schema rejects bad choices.
- NOTES.txt and docs/operations.md both apply the CRD before ``helm upgrade``.
- The chart's grant is exactly ``distflow_operator.rbac`` (no more, no less).
- ``kubectl apply --dry-run=server`` of every rendered object.
- ``helm install``; the operator then runs as the Deployment would run it (its
  args, the chart ServiceAccount's token, RBAC on), takes a job through a gang
  restart to Succeeded and TTL deletion, and is refused (403) outside its grant.
- ``helm uninstall`` leaves nothing of the release but the CRD.

Helm comes from the control plane build (tests/controlplane/build.sh).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from distflow_operator import API_GROUP, API_VERSION, CRD_NAME, PLURAL
from distflow_operator.__main__ import _parser as operator_cli
from distflow_operator.rbac import KOPF_DISCOVERY_RULES, LEADER_ELECTION_RULES, OPERATOR_RULES

from tests.controlplane.cluster import free_port
from tests.operator._helpers import REPO, Api, example_job, wait_for

pytestmark = pytest.mark.operator

CHART = REPO / "helm" / "distflow"
VERSIONS = REPO / "tests" / "controlplane" / "versions.env"
POD_GROUP_API = {"volcano": "scheduling.volcano.sh", "scheduler-plugins": "scheduling.x-k8s.io"}
MODES = {
    "cluster-wide": [],
    "namespaced+volcano": ["--set", "watchNamespaces={team-a,team-b}", "--set", "batchScheduler=volcano"],
    "scheduler-plugins+monitors": ["--set", "batchScheduler=scheduler-plugins",
                                   "--set", "metrics.serviceMonitor.enabled=true",
                                   "--set", "metrics.podMonitor.enabled=true"],
}


def kube_version() -> str:
    env = dict(line.split("=", 1) for line in VERSIONS.read_text().splitlines()
               if "=" in line and not line.startswith("#"))
    return env["KUBERNETES_VERSION"].lstrip("v")


class Helm:
    """The helm binary with its caches in a temp dir and one kubeconfig."""

    def __init__(self, binary: Path, home: Path, kubeconfig: Path | None = None):
        self.binary, self.kubeconfig = binary, kubeconfig
        self.env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"),
                    "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}

    def __call__(self, *args: str, check: bool = True, timeout_s: float = 300) -> subprocess.CompletedProcess:
        cmd = [str(self.binary), *args]
        if self.kubeconfig is not None:
            cmd.append(f"--kubeconfig={self.kubeconfig}")
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout_s, check=False)
        if check:
            assert out.returncode == 0, f"{' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out

    def template(self, *values: str, namespace: str = "distflow-system", crds: bool = False) -> list[dict]:
        args = ["template", "distflow", str(CHART), "-n", namespace, f"--kube-version={kube_version()}", *values]
        out = self(*args, *(["--include-crds"] if crds else []))
        return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def helm_binary(control_plane_bin_dir: Path) -> Path:
    binary = control_plane_bin_dir / "helm"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"helm missing in {control_plane_bin_dir} (tests/controlplane/build.sh builds it)")
    return binary


@pytest.fixture(scope="module")
def helm(helm_binary: Path, tmp_path_factory) -> Helm:
    return Helm(helm_binary, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="module")
def cluster_helm(helm_binary: Path, control_plane, tmp_path_factory) -> Helm:
    return Helm(helm_binary, tmp_path_factory.mktemp("helm-home"), control_plane.kubeconfig)


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def grant(rules: list[dict]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples a list of PolicyRules allows."""
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def expected_grants(batch_scheduler: str, cluster_wide: bool) -> tuple[set, set]:
    """(grant in each watched namespace, grant at cluster scope) per distflow_operator.rbac."""
    wanted = {POD_GROUP_API.get(batch_scheduler)}
    operator = {t for t in grant(OPERATOR_RULES) if t[1] != "podgroups" or t[0] in wanted}
    discovery = grant(KOPF_DISCOVERY_RULES)
    return (set(), operator | discovery) if cluster_wide else (operator, discovery)


# -- rendering, no cluster -------------------------------------------------

@pytest.mark.parametrize("mode", list(MODES))
def test_chart_lints_strictly(helm, mode):
    out = helm("lint", "--strict", str(CHART), f"--kube-version={kube_version()}", *MODES[mode])
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_values_schema_rejects_an_unknown_batch_scheduler(helm):
    out = helm("template", "x", str(CHART), f"--kube-version={kube_version()}",
               "--set", "batchScheduler=kueue", check=False)
    assert out.returncode != 0 and "batchScheduler" in out.stderr


def test_chart_crd_is_the_generated_crd():
    chart_crd = CHART / "crds" / f"{CRD_NAME}.yaml"
    assert chart_crd.read_bytes() == (REPO / "crds" / f"{CRD_NAME}.yaml").read_bytes(), (
        "helm/distflow/crds/ is stale; run: python -m distflow_operator.crdgen "
        f"--output helm/distflow/crds/{CRD_NAME}.yaml")


@pytest.mark.parametrize("doc", ["helm/distflow/templates/NOTES.txt", "docs/operations.md"])
def test_upgrade_instructions_apply_the_crd_before_helm_upgrade(doc):
    text = (REPO / doc).read_text()
    commands = [line.strip() for line in text.splitlines()
                if line.strip().startswith(("kubectl apply --server-side", "helm upgrade "))]
    assert [c.split()[0] for c in commands] == ["kubectl", "helm"], commands
    assert "crds/" in commands[0], commands[0]
    assert "after `helm upgrade`" not in text.lower()


@pytest.mark.parametrize("mode", list(MODES))
def test_rbac_grants_exactly_the_operator_rules(helm, mode):
    docs = helm.template(*MODES[mode])
    values = dict(v.split("=", 1) for v in MODES[mode][1::2])
    scheduler = values.get("batchScheduler", "none")
    namespaces = values.get("watchNamespaces", "").strip("{}").split(",") if "watchNamespaces" in values else []
    operator_roles = [d for d in by_kind(docs, "ClusterRole") + by_kind(docs, "Role")
                      if not d["metadata"]["name"].endswith(("-edit", "-view", "-leader-election"))]
    cluster_roles = [d for d in operator_roles if d["kind"] == "ClusterRole"]
    roles = [d for d in operator_roles if d["kind"] == "Role"]
    in_namespace, cluster_scope = expected_grants(scheduler, cluster_wide=not namespaces)
    assert len(cluster_roles) == 1 and grant(cluster_roles[0]["rules"]) == cluster_scope
    assert sorted(d["metadata"]["namespace"] for d in roles) == sorted(namespaces)
    for role in roles:
        assert grant(role["rules"]) == in_namespace
    (leader,) = [d for d in by_kind(docs, "Role") if d["metadata"]["name"].endswith("-leader-election")]
    assert leader["metadata"]["namespace"] == "distflow-system" and leader["rules"] == LEADER_ELECTION_RULES
    bindings = by_kind(docs, "RoleBinding") + by_kind(docs, "ClusterRoleBinding")
    assert sorted((b["roleRef"]["kind"], b["metadata"].get("namespace", "")) for b in bindings) == sorted(
        [("ClusterRole", ""), ("Role", "distflow-system")] + [("Role", ns) for ns in namespaces])
    sa = by_kind(docs, "ServiceAccount")[0]["metadata"]
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]
    updates = {t[1] for t in grant(OPERATOR_RULES) if t[2] == "update"}
    assert updates == {"rlposttrainjobs/finalizers"} and not {t for t in grant(OPERATOR_RULES) if t[1] == "secrets"}
    assert not {t for t in grant(OPERATOR_RULES) if t[1] == "leases"}  # never cluster-wide or in job namespaces


def test_deployment_runs_two_hardened_replicas_that_elect_a_leader_with_flags_the_cli_accepts(helm):
    docs = helm.template("--set", "watchNamespaces={team-a,team-b}", "--set", "logging.level=debug")
    deploy = by_kind(docs, "Deployment")[0]["spec"]
    assert (deploy["replicas"], deploy["strategy"]) == (
        2, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}})
    pod = deploy["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = operator_cli({}).parse_args(container["args"])
    assert (args.namespace, args.verbose) == (["team-a", "team-b"], True)
    assert (args.metrics_port, args.liveness_port) == (ports["metrics"], ports["health"]) == (8080, 8081)
    assert (args.leader_election_namespace, args.lease_duration) == ("distflow-system", 15.0)
    assert (args.api_qps, args.api_burst) == (20.0, 30)
    assert container["image"] == "distflow/operator:0.1.0"
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"minAvailable": 1, "selector": deploy["selector"]}
    (spread,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname",
                                         "labelSelector": {"matchLabels": deploy["selector"]["matchLabels"]}}


def test_a_budget_that_would_block_every_drain_is_refused_and_a_given_affinity_wins(helm):
    out = helm("template", "x", str(CHART), f"--kube-version={kube_version()}",
               "--set", "podDisruptionBudget.minAvailable=2", check=False)
    assert out.returncode != 0 and "podDisruptionBudget.minAvailable must be below replicas" in out.stderr
    docs = helm.template("--set", "replicas=3", "--set", "podDisruptionBudget.minAvailable=2",
                         "--set", "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                                  ".nodeSelectorTerms[0].matchExpressions[0].key=pool",
                         "--set", "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                                  ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists")
    pod = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    assert list(pod["affinity"]) == ["nodeAffinity"]
    assert by_kind(docs, "PodDisruptionBudget")[0]["spec"]["minAvailable"] == 2


def test_without_leader_election_the_chart_runs_one_replica_and_refuses_more(helm):
    docs = helm.template("--set", "leaderElection.enabled=false")
    deploy = by_kind(docs, "Deployment")[0]["spec"]
    assert (deploy["replicas"], deploy["strategy"]) == (1, {"type": "Recreate"})
    assert operator_cli({}).parse_args(deploy["template"]["spec"]["containers"][0]["args"]
                                       ).leader_election_namespace == ""
    assert not by_kind(docs, "PodDisruptionBudget")
    assert not [d for d in by_kind(docs, "Role") if d["metadata"]["name"].endswith("-leader-election")]
    out = helm("template", "x", str(CHART), f"--kube-version={kube_version()}",
               "--set", "leaderElection.enabled=false", "--set", "replicas=3", check=False)
    assert out.returncode != 0 and "leaderElection.enabled" in out.stderr


def test_an_upgrade_reusing_values_of_a_release_without_the_ha_values_renders_one_operator(helm):
    # `helm upgrade --reuse-values` takes the old release's values, not the new chart's defaults.
    docs = helm.template(*[a for key in ("leaderElection", "podDisruptionBudget", "readinessProbe", "replicas",
                                         "operator.apiQps", "operator.apiBurst") for a in ("--set", f"{key}=null")])
    deploy = by_kind(docs, "Deployment")[0]["spec"]
    assert (deploy["replicas"], deploy["strategy"]) == (1, {"type": "Recreate"})
    (container,) = deploy["template"]["spec"]["containers"]
    args = operator_cli({}).parse_args(container["args"])
    assert (args.leader_election_namespace, args.api_qps, args.api_burst) == ("", 20.0, 30)
    assert container["readinessProbe"] == {"httpGet": {"path": "/healthz", "port": "health"}}
    assert not by_kind(docs, "PodDisruptionBudget")


def test_every_object_carries_the_release_labels(helm):
    docs = helm.template(*MODES["scheduler-plugins+monitors"])
    assert {d["kind"] for d in docs} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
                                         "Service", "ConfigMap", "ServiceMonitor", "PodMonitor"}
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert (labels["app.kubernetes.io/instance"], labels["app.kubernetes.io/managed-by"]) == ("distflow", "Helm")
    dashboard = by_kind(docs, "ConfigMap")[0]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["distflow.json"])["uid"] == "distflow"


# -- against the API server ------------------------------------------------

MONITOR_STUBS = [
    {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
     "metadata": {"name": f"{plural}.monitoring.coreos.com"},
     "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
              "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
              "versions": [{"name": "v1", "served": True, "storage": True,
                            "schema": {"openAPIV3Schema": {"type": "object",
                                                           "x-kubernetes-preserve-unknown-fields": True}}}]}}
    for kind, plural in (("ServiceMonitor", "servicemonitors"), ("PodMonitor", "podmonitors"))
]
"""prometheus-operator's CRDs are not available offline: structural stand-ins let the
server check the monitors' metadata; their spec is checked against the chart's own tests only."""


def test_rendered_objects_pass_server_side_dry_run(control_plane, helm, k8s_namespace):
    other = f"{k8s_namespace}-b"
    control_plane.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                         "metadata": {"name": other}}, expect=(201,))
    stubs = "\n---\n".join(yaml.safe_dump(s) for s in MONITOR_STUBS)
    try:
        assert control_plane.kubectl("apply", "-f", "-", input=stubs).returncode == 0
        wait_for(lambda: control_plane.kubectl("get", "podmonitors", "-A").returncode == 0, 30,
                 what="monitor stand-ins served")
        for mode in (["--set", f"watchNamespaces={{{k8s_namespace},{other}}}", "--set", "batchScheduler=volcano"],
                     MODES["scheduler-plugins+monitors"]):
            docs = helm.template(*mode, namespace=k8s_namespace, crds=True)
            out = control_plane.kubectl("apply", "--dry-run=server", "-f", "-",
                                        input="\n---\n".join(yaml.safe_dump(d) for d in docs))
            assert out.returncode == 0, out.stderr
            created = [line for line in out.stdout.splitlines() if "(server dry run)" in line]
            assert len(created) == len(docs), out.stdout
    finally:
        control_plane.kubectl("delete", "--ignore-not-found", "-f", "-", input=stubs)
        control_plane.request("DELETE", f"/api/v1/namespaces/{other}")


def operator_process(control_plane, deployment: dict, namespace: str, workdir: Path, replica: str = "operator",
                     ports: tuple[int, int] | None = None) -> subprocess.Popen:
    """The Deployment's container, run here: its args, the chart ServiceAccount's token.

    Args:
        ports: (metrics, liveness) for this replica, replacing the chart's (replicas on one host).
    """
    pod = deployment["spec"]["template"]["spec"]
    token = control_plane.make_token_for_serviceaccount(namespace, pod["serviceAccountName"])
    kubeconfig = control_plane.write_kubeconfig(workdir / "chart-sa.kubeconfig", token, user="chart-sa")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig),
           "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "operator")])}
    args = list(pod["containers"][0]["args"])
    if ports is not None:
        args = [a for a in args if not a.startswith(("--metrics-port=", "--liveness-port="))]
        args += [f"--metrics-port={ports[0]}", f"--liveness-port={ports[1]}"]
    with open(workdir / f"{replica}.log", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "distflow_operator", *args],
                                stdout=log, stderr=subprocess.STDOUT, env=env)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except OSError:
        return 0, ""


def release_leftovers(control_plane, release: str) -> list[str]:
    """Every listable object, in any namespace, labelled as part of ``release``."""
    kinds = control_plane.kubectl("api-resources", "--verbs=list", "-o", "name", check=True).stdout.split()
    out = control_plane.kubectl("get", ",".join(kinds), "-A", "-o", "name",
                                "-l", f"app.kubernetes.io/instance={release}")
    return out.stdout.split()


def test_helm_install_runs_the_operator_with_exactly_the_chart_grant(control_plane, cluster_helm,
                                                                   k8s_namespace, tmp_path):
    release, ns, api = f"df-{uuid.uuid4().hex[:6]}", k8s_namespace, Api(control_plane, k8s_namespace)
    metrics_port, liveness_port = free_port(), free_port()
    installed = cluster_helm("install", release, str(CHART), "-n", ns, "--wait", "--timeout=180s",
                             "--set", f"watchNamespaces={{{ns}}}", "--set", f"metrics.port={metrics_port}",
                             "--set", f"livenessPort={liveness_port}", "--set", "operator.resyncInterval=2")
    assert f"kubectl apply -n {ns} -f examples/rljob.yaml" in installed.stdout  # NOTES.txt: the next command
    _, deployment = control_plane.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{release}-distflow",
                                          expect=(200,))
    assert deployment["status"].get("availableReplicas") == 2
    assert control_plane.kubectl("get", "crd", CRD_NAME).returncode == 0

    proc = operator_process(control_plane, deployment, ns, tmp_path)
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{liveness_port}/healthz")[0] == 200, 60,
                 what="the Deployment's liveness probe answers")
        status, body = api.create_job(example_job("helm-job", runPolicy={"maxRestarts": 2, "backoffSeconds": 0,
                                                                          "ttlSecondsAfterFinished": 3}))
        assert status == 201, body
        api.wait_running_gang("helm-job", attempt=1, num_nodes=2, timeout_s=60)
        control_plane.set_pod_phase(ns, "helm-job-node-1", "Failed", exit_code=1)
        for pod in api.wait_running_gang("helm-job", attempt=2, num_nodes=2, timeout_s=60):
            control_plane.set_pod_phase(ns, pod["metadata"]["name"], "Succeeded")
        assert api.wait_phase("helm-job", "Succeeded", timeout_s=60)["restarts"] == 1
        wait_for(lambda: api.job("helm-job") is None, 30, what="deleted after its TTL")
        scraped = http_get(f"http://127.0.0.1:{metrics_port}/metrics")[1]
        assert 'distflow_operator_gang_restarts_total 1.0' in scraped
        assert_refused_outside_grant(control_plane, deployment, ns)
    finally:
        stop(proc)
    log = (tmp_path / "operator.log").read_text(errors="replace")
    assert "Forbidden" not in log and not re.search(r"\b403\b", log), log[-4000:]

    # The documented upgrade: the CRD by server-side apply, then helm upgrade (Recreate).
    out = control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    assert out.returncode == 0 and CRD_NAME in out.stdout, out.stderr
    cluster_helm("upgrade", release, str(CHART), "-n", ns, "--reuse-values", "--wait", "--timeout=180s",
                 "--set", "operator.resyncInterval=7")
    _, upgraded = control_plane.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{release}-distflow",
                                        expect=(200,))
    assert "--resync-interval=7" in upgraded["spec"]["template"]["spec"]["containers"][0]["args"]

    cluster_helm("uninstall", release, "-n", ns, "--wait", "--timeout=120s")
    assert release_leftovers(control_plane, release) == []
    assert control_plane.kubectl("get", "crd", CRD_NAME).returncode == 0  # documented to stay


def assert_refused_outside_grant(control_plane, deployment: dict, ns: str) -> None:
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    token = control_plane.make_token_for_serviceaccount(ns, sa)
    jobs = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{ns}/{PLURAL}"

    def status(method: str, path: str, body=None, **kw) -> int:
        return control_plane.request(method, path, body, token=token, **kw)[0]

    assert status("GET", jobs) == 200
    assert status("POST", f"/api/v1/namespaces/{ns}/pods?dryRun=All", example_pod()) == 201
    assert status("GET", f"/api/v1/namespaces/{ns}/secrets") == 403
    assert status("PATCH", f"{jobs}/anything", {"spec": {}}, content_type="application/merge-patch+json") == 403
    assert status("PUT", f"/api/v1/namespaces/{ns}/configmaps/anything", {}) == 403
    assert status("GET", f"/apis/{API_GROUP}/{API_VERSION}/{PLURAL}") == 403  # cluster-wide list
    assert status("POST", "/api/v1/namespaces/default/pods?dryRun=All", example_pod()) == 403
    assert status("DELETE", f"/api/v1/nodes/{control_plane.node_names[0]}") == 403
    assert status("POST", f"/apis/apps/v1/namespaces/{ns}/deployments?dryRun=All", {}) == 403
    assert status("GET", f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{ns}/podgroups/x") == 403
    assert_leases_writable_only_for_election(control_plane, deployment, ns)


def can(control_plane, user_ns: str, sa: str, verb: str, namespace: str, name: str = "") -> bool:
    """The API server's SubjectAccessReview: may ServiceAccount user_ns/sa ``verb`` Lease ``name``?"""
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {
        "user": f"system:serviceaccount:{user_ns}:{sa}",
        "groups": ["system:serviceaccounts", f"system:serviceaccounts:{user_ns}", "system:authenticated"],
        "resourceAttributes": {"group": "coordination.k8s.io", "resource": "leases", "verb": verb,
                               "namespace": namespace, **({"name": name} if name else {})}}}
    _, answer = control_plane.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review,
                                      expect=(201,))
    return bool(answer["status"].get("allowed"))


def assert_leases_writable_only_for_election(control_plane, deployment: dict, ns: str) -> None:
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert can(control_plane, ns, sa, "get", ns, "distflow-operator")
    assert can(control_plane, ns, sa, "update", ns, "distflow-operator")
    assert can(control_plane, ns, sa, "create", ns)  # RBAC cannot scope create to a name
    assert not can(control_plane, ns, sa, "update", ns, "another-controllers-lease")
    for other in ("kube-node-lease", "kube-system", "default"):
        for verb, name in (("update", "distflow-operator"), ("update", "node-1"), ("create", "")):
            assert not can(control_plane, ns, sa, verb, other, name), (verb, other, name)


def example_pod() -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}


def test_cluster_wide_install_grants_every_namespace_and_the_chosen_pod_groups(control_plane, cluster_helm,
                                                                              k8s_namespace):
    release, ns = f"df-{uuid.uuid4().hex[:6]}", k8s_namespace
    cluster_helm("install", release, str(CHART), "-n", ns, "--set", "batchScheduler=volcano",
                 "--set", "dashboards.enabled=false")
    try:
        token = control_plane.make_token_for_serviceaccount(ns, f"{release}-distflow")

        def status(path: str) -> int:
            return control_plane.request("GET", path, token=token)[0]

        assert status(f"/apis/{API_GROUP}/{API_VERSION}/{PLURAL}") == 200
        assert status("/api/v1/namespaces/default/pods") == 200
        assert status("/api/v1/namespaces") == 200  # kopf follows namespaces when it watches them all
        assert status("/api/v1/secrets") == 403
        # Granted: the API server answers 404 (volcano is not installed). Not granted: 403.
        assert status(f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{ns}/podgroups/x") == 404
        assert status(f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{ns}/podgroups/x") == 403
        assert not can(control_plane, ns, f"{release}-distflow", "update", "kube-node-lease", "node-1")
        assert can(control_plane, ns, f"{release}-distflow", "update", ns, "distflow-operator")
        assert control_plane.kubectl("get", "configmap", "-n", ns, f"{release}-distflow-dashboard").returncode != 0
    finally:
        cluster_helm("uninstall", release, "-n", ns, "--wait", "--timeout=120s")
    assert release_leftovers(control_plane, release) == []


def test_helm_upgrade_rolls_two_replicas_while_a_job_runs_and_restarts_no_job(control_plane, cluster_helm,
                                                                             k8s_namespace, tmp_path):
    """The rolling update the chart asks for (maxSurge 1, maxUnavailable 0), done here as the
    Deployment controller would: a new replica ready before an old one stops, two times over."""
    release, ns, api = f"df-{uuid.uuid4().hex[:6]}", k8s_namespace, Api(control_plane, k8s_namespace)
    cluster_helm("install", release, str(CHART), "-n", ns, "--set", f"watchNamespaces={{{ns}}}",
                 "--set", "leaderElection.leaseDuration=3", "--set", "operator.resyncInterval=2",
                 "--set", "dashboards.enabled=false")
    path = f"/apis/apps/v1/namespaces/{ns}/deployments/{release}-distflow"
    _, old = control_plane.request("GET", path, expect=(200,))
    replicas: list[tuple[subprocess.Popen, int]] = []

    def start(deployment: dict, name: str) -> subprocess.Popen:
        ports = (free_port(), free_port())
        proc = operator_process(control_plane, deployment, ns, tmp_path, name, ports)
        replicas.append((proc, ports[1]))
        wait_for(lambda: http_get(f"http://127.0.0.1:{ports[1]}/healthz")[0] == 200, 60,
                 what=f"replica {name} ready")
        return proc

    def lease_holder() -> str:
        _, lease = control_plane.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/"
                                                "distflow-operator", expect=(200,))
        return lease["spec"].get("holderIdentity") or ""

    try:
        olds = [start(old, f"old-{i}") for i in range(2)]
        assert api.create_job(example_job("upgraded", runPolicy={"maxRestarts": 3, "backoffSeconds": 0}))[0] == 201
        uids = sorted(p["metadata"]["uid"] for p in api.wait_running_gang("upgraded", attempt=1, num_nodes=2,
                                                                            timeout_s=60))
        cluster_helm("upgrade", release, str(CHART), "-n", ns, "--reuse-values", "--set", "operator.resyncInterval=3")
        _, new = control_plane.request("GET", path, expect=(200,))
        assert "--resync-interval=3" in new["spec"]["template"]["spec"]["containers"][0]["args"]
        for i, proc in enumerate(olds):
            start(new, f"new-{i}")
            stop(proc)
            time.sleep(4)  # more than a lease duration: a missing leader would show now
            job = api.job("upgraded")["status"]
            assert (job["phase"], job["attempt"], job.get("restarts", 0)) == ("Running", 1, 0), job
            assert sorted(p["metadata"]["uid"] for p in api.pods("upgraded")) == uids
        holder = lease_holder()
        assert holder and str(olds[0].pid) not in holder and str(olds[1].pid) not in holder
        # A new replica leads: a failure is handled at once, as before the upgrade.
        control_plane.set_pod_phase(ns, "upgraded-node-1", "Failed", exit_code=1)
        api.wait_running_gang("upgraded", attempt=2, num_nodes=2, timeout_s=30)
        assert api.job("upgraded")["status"]["restarts"] == 1
    finally:
        for proc, _ in replicas:
            stop(proc)
        cluster_helm("uninstall", release, "-n", ns, "--wait", "--timeout=120s")
    logs = " ".join((tmp_path / f"{n}.log").read_text(errors="replace") for n in ("old-0", "old-1", "new-0", "new-1"))
    assert not re.search(r"\b403\b", logs), logs[-4000:]
