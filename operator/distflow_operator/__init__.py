"""The distflow operator: RLPostTrainJob -> per-node pods, status, run policy.

Reconcile = observe -> decide -> render -> apply -> compute status::

    kopf watches ──> index (jobs, pods) ──> kick(job) ──> reconcile.py
                                                            │ observed.py  pod/job views
                                                            │ policy.py    restart / fail / suspend / TTL
                                                            │ status.py    phase + conditions
                                                            │ render.py    ConfigMap, Service, Pods, PodGroup
                                                            └ kube.py      the only module that writes to the API

Everything but ``kube.py``, ``reconcile.py``, ``progress.py`` (HTTP to node 0)
and ``handlers.py`` (kopf) is pure and unit-tested without a cluster. This
package never imports torch; it reads the job spec model from ``distflow.spec``.
"""

from distflow.spec import API_GROUP, API_VERSION, KIND

PLURAL = "rlposttrainjobs"
SINGULAR = "rlposttrainjob"
SHORT_NAME = "rljob"
CATEGORY = "distflow"
CRD_NAME = f"{PLURAL}.{API_GROUP}"
MANAGER = "distflow-operator"
"""Value of app.kubernetes.io/managed-by on every child, and the field manager."""

__all__ = ["API_GROUP", "API_VERSION", "KIND", "PLURAL", "SINGULAR", "SHORT_NAME", "CATEGORY",
           "CRD_NAME", "MANAGER"]
