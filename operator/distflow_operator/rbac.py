"""The RBAC rules the operator's ServiceAccount needs, and nothing more.

The helm chart's ClusterRole should carry exactly ``OPERATOR_RULES`` plus
``KOPF_DISCOVERY_RULES``; the operator tier runs the operator with a
ServiceAccount token bound to them (the first set by a RoleBinding in one
namespace, the second cluster-wide), so a rule missing here fails a test. The
discovery rules are read-only and cluster-scoped: kopf lists and watches
namespaces and CRDs even when it serves one namespace, and without them it
retries for about a minute before falling back.

Leader election (leader.py) gets its own rules, ``LEADER_ELECTION_RULES``,
bound in the operator's namespace only: get and update of the operator's
Lease by name, and create of Leases there (RBAC cannot restrict create by
name: the new object's name is not part of the request's URL). No Lease
elsewhere (kube-node-lease, kube-system) is writable.
``update`` on ``rlposttrainjobs/finalizers``: children carry
``blockOwnerDeletion: true``, which the OwnerReferencesPermissionEnforcement
admission plugin allows only to who may update the owner's finalizers.

What is deliberately absent: no other ``update`` (status and ConfigMaps are
patched), no ``patch`` on jobs (the operator never writes spec or metadata), no
``list`` on Services/ConfigMaps (they are created by name), no Secrets, and the
node pods get no rights at all.
"""

from __future__ import annotations

from distflow_operator import API_GROUP, PLURAL
from distflow_operator.leader import LEASE_NAME

OPERATOR_RULES: list[dict[str, list[str]]] = [
    {"apiGroups": [API_GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "delete"]},
    {"apiGroups": [API_GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    {"apiGroups": [API_GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["scheduling.volcano.sh", "scheduling.x-k8s.io"], "resources": ["podgroups"],
     "verbs": ["get", "create", "patch"]},
]
"""delete on jobs: ttlSecondsAfterFinished. get on the others: adopting what a 409 says exists.
patch on podgroups: the PodGroup follows scheduling edits."""

KOPF_DISCOVERY_RULES: list[dict[str, list[str]]] = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
]

LEADER_ELECTION_RULES: list[dict[str, list[str]]] = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [LEASE_NAME],
     "verbs": ["get", "update"]},
]
"""Bound by a Role in the namespace given as --leader-election-namespace (the chart: the release's)."""
