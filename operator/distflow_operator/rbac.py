"""The RBAC rules the operator's ServiceAccount needs, and nothing more.

The helm chart's (Cluster)Role should carry exactly ``OPERATOR_RULES``; the
operator tier runs the operator with a ServiceAccount token bound to them, so a
rule missing here fails a test. ``KOPF_DISCOVERY_RULES`` only matter when the
operator watches all namespaces (kopf follows namespaces and CRDs appearing);
a namespaced install may leave them out and kopf just logs that it cannot.

What is deliberately absent: no ``update`` anywhere (status and ConfigMaps are
patched), no ``patch`` on jobs (the operator never writes spec or metadata), no
``list`` on Services/ConfigMaps (they are created by name), no Secrets, and the
node pods get no rights at all.
"""

from __future__ import annotations

from distflow_operator import API_GROUP, PLURAL

OPERATOR_RULES: list[dict[str, list[str]]] = [
    {"apiGroups": [API_GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "delete"]},
    {"apiGroups": [API_GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["scheduling.volcano.sh", "scheduling.x-k8s.io"], "resources": ["podgroups"],
     "verbs": ["get", "create"]},
]
"""delete on jobs: ttlSecondsAfterFinished. get on the others: adopting what a 409 says exists."""

KOPF_DISCOVERY_RULES: list[dict[str, list[str]]] = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
]
