"""examples/scaledobject.yaml: KEDA's ScaledObject targets the example job through its scale
subresource and queries a series the node exporter serves (tests/operator/test_keda.py runs it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from distflow.exporter import STEP_GAUGES, NodeExporter
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_scaled_object_targets_the_async_example_job_within_its_sizes():
    scaled = yaml.safe_load((EXAMPLES / "scaledobject.yaml").read_text())
    job = yaml.safe_load((EXAMPLES / "rljob-async.yaml").read_text())
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": job["apiVersion"], "kind": job["kind"],
                                                "name": job["metadata"]["name"]}
    spec = scaled["spec"]
    assert spec["minReplicaCount"] <= job["spec"]["cluster"]["numNodes"] <= spec["maxReplicaCount"]
    assert spec["minReplicaCount"] > job["spec"]["async"]["rolloutPool"]["numNodes"]
    # The job's own bounds are the ScaledObject's, and every size between is one the spec accepts.
    cluster = job["spec"]["cluster"]
    assert (cluster["minNodes"], cluster["maxNodes"]) == (spec["minReplicaCount"], spec["maxReplicaCount"])
    for size in range(cluster["minNodes"], cluster["maxNodes"] + 1):
        doc = {**job["spec"], "cluster": {**cluster, "numNodes": size}}
        assert parse_spec(doc).cluster.num_nodes == size


def test_scaled_object_queries_a_series_the_node_exporter_serves():
    trigger = yaml.safe_load((EXAMPLES / "scaledobject.yaml").read_text())["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    node = NodeExporter("grpo-async", 0, port=0)
    node.observe_step(1, dict.fromkeys(STEP_GAUGES, 1.0), {}, 1.0, 0.0, 0.0)
    served = {family.name for family in node.registry.collect()}
    queried = set(re.findall(r"\bdistflow_\w+", trigger["metadata"]["query"]))
    assert queried and queried <= served, queried - served
    assert 'job_name="grpo-async"' in trigger["metadata"]["query"]
