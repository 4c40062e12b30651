"""The generated bad configs (tests/bad_configs.py) as RLPostTrainJobs on a real API server.

Every mutation of a spec field (wrong type, out of range, unknown choice, missing, unknown
field) is rejected at once by the CRD's schema or CEL rules, naming the field: each is
sent as a server-side dry run (`kubectl apply --dry-run=server`), so nothing is stored.
The conflicts of settings that are valid alone are created for real: the API server
rejects the ones CEL mirrors, and the operator marks the rest Failed with reason
InvalidSpec, naming the field, before any pod exists. Data files and user functions are
not the API server's to check: a pod's pre-flight rejects them (tests/unit/test_bad_input_generated.py).
"""

from __future__ import annotations

import json

import pytest

from tests.bad_configs import BadConfig, generate
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    api, crd, example_job, operator, operator_kubeconfig_path,
)

pytestmark = [pytest.mark.operator, pytest.mark.timeout(900)]

FIELD_CATEGORIES = ("wrong type", "out of range", "bad choice", "missing", "unknown field")
CONFIGS = [c for c in generate() if c.doc is not None and "kind" not in c.doc]
FIELD_MUTATIONS = [c for c in CONFIGS if c.category in FIELD_CATEGORIES]
CONFLICTS = [c for c in CONFIGS if c.category == "conflict" and c.name.startswith("quickstart:")]


def _resource(bad: BadConfig, name: str) -> dict:
    """The bad config as the spec of examples/rljob.yaml's manifest, suspended (no pods needed)."""
    doc = example_job(name)
    doc["spec"] = json.loads(json.dumps(bad.doc).replace("@DIR@", "/data"))
    run_policy = doc["spec"].setdefault("runPolicy", {})
    if isinstance(run_policy, dict):
        run_policy.setdefault("suspend", True)
    return doc


def test_every_field_mutation_is_rejected_by_the_api_server_naming_the_field(api, crd):
    assert len(FIELD_MUTATIONS) >= 200
    unnamed = []
    for i, bad in enumerate(FIELD_MUTATIONS):
        status, body = api.cp.request("POST", f"{api.jobs}?fieldValidation=Strict&dryRun=All",
                                      _resource(bad, f"bad-field-{i}"))
        if status not in (400, 422) or bad.field not in body.get("message", ""):
            unnamed.append((bad.name, status, body.get("message")))
    assert not unnamed, json.dumps(unnamed, indent=1)


def test_conflicting_settings_are_rejected_or_failed_naming_the_field(api, operator):
    created = []
    for i, bad in enumerate(CONFLICTS):
        status, body = api.create_job(_resource(bad, f"conflict-{i}"))
        if status == 201:
            created.append((f"conflict-{i}", bad))
        else:
            assert status == 422 and bad.field in body["message"], (bad.name, status, body)
    assert created  # some conflicts only the operator's own spec check sees
    for name, bad in created:
        failed = api.wait_phase(name, "Failed", timeout_s=60)
        assert failed["reason"] == "InvalidSpec" and bad.field in failed["message"], (bad.name, failed)
        assert not api.pods(name)
