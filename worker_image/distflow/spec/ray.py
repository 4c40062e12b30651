"""``spec.ray``: running the job's workers as actors on an existing Ray cluster (e.g. KubeRay).

Only ``distflow run`` reads this section (the ``ray`` launcher,
:mod:`distflow.ray_launcher`); the operator ignores it, since it makes its own
pods. Each distflow node is one bundle of a placement group, one bundle per
Ray node, holding ``cluster.procsPerNode`` workers' resources.
"""

from __future__ import annotations

from pydantic import Field

from distflow.spec.base import SpecBase


class RaySpec(SpecBase):
    address: str | None = None
    """The Ray cluster `distflow run` starts the workers on: `auto` (Ray's own discovery: RAY_ADDRESS,
    or the cluster `ray start` made on this machine), `HOST:PORT` of the head's GCS, or
    `ray://HOST:10001`. Unset: the local launcher. `distflow run --ray ADDRESS` overrides it."""
    cpus_per_worker: float = Field(default=1.0, gt=0, le=1024)
    """CPUs each worker's actor reserves (Ray's `num_cpus`)."""
    gpus_per_worker: float | None = Field(default=None, ge=0, le=64)
    """GPUs each worker's actor reserves. Unset: cluster.acceleratorsPerNode / procsPerNode, else 1 with
    cluster.device cuda, else 0. A GPU job needs a whole number: a fraction would let Ray put two ranks on
    one GPU, so the launcher refuses it."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each worker reserves (e.g. `{node_pool_a100: 1}`, set on the Ray nodes
    with `ray start --resources`), to place the job on particular nodes."""
    label_selector: dict[str, str] = Field(default_factory=dict)
    """Ray node labels every distflow node's Ray node must carry (`ray start --labels`)."""
    placement_timeout_seconds: int = Field(default=300, ge=1, le=86400)
    """How long to wait for the cluster to place every worker before failing with what is missing."""
