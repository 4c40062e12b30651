"""Generate the RLPostTrainJob CRD from the spec model (``distflow.spec``).

    python -m distflow_operator.crdgen            # write crds/rlposttrainjobs.distflow.io.yaml
    python -m distflow_operator.crdgen --check    # exit 1 if the checked-in file is stale

The pydantic JSON schema becomes a Kubernetes structural schema:

- ``$ref`` is inlined (the field's docstring wins over the class docstring);
- ``anyOf: [X, null]`` becomes X. Without ``nullable`` the API server prunes an
  explicit null, which leaves the field unset -- what pydantic does with None;
- JSON-Schema-2020 ``exclusiveMinimum: v`` becomes ``minimum: v`` +
  ``exclusiveMinimum: true`` (OpenAPI v3.0);
- ``dict[str, Any]`` (and Any) become ``x-kubernetes-preserve-unknown-fields``;
- an optional sub-object whose fields all have defaults gets ``default: {}``, so
  the stored job shows every effective value and CEL rules can rely on it;
- strings the model checks against a list (advantage estimators, ...) get that
  list as ``enum``;
- unknown fields are rejected by kubectl's strict field validation, so
  ``additionalProperties: false`` is dropped (structural schemas forbid it).

CEL rules (``x-kubernetes-validations``) add what a schema cannot say: the
spec's cross-field size checks (same fields and fixes as ``distflow.spec``), fields
that may not change while the job exists, pod-template env names and pod labels
the operator owns, a non-root uid, and a metadata.name short enough for
``<name>-node-<rank>``. Anything the generator cannot express raises, so a spec
change never silently weakens the CRD.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from distflow.spec import (
    ADVANTAGE_ESTIMATORS, BUILTIN_WORKFLOWS, KL_ESTIMATORS, LOSS_AGG_MODES, NODE_ROLES,
    POLICY_LOSSES, JobSpec,
)
from distflow.spec.loading import JOB_NAME_PATTERN, MAX_JOB_NAME_LENGTH

from distflow_operator import (
    API_GROUP, API_VERSION, CATEGORY, CRD_NAME, KIND, PLURAL, SHORT_NAME, SINGULAR,
)
from distflow_operator.podspec import KUEUE_KEYS
from distflow_operator.render import GANG_METADATA_KEYS, NODE_LABEL_KEYS, OPERATOR_ENV_NAMES
from distflow_operator.status import JobStatus

DEFAULT_OUTPUTS = (Path("crds") / f"{CRD_NAME}.yaml", Path("helm") / "distflow" / "crds" / f"{CRD_NAME}.yaml")
"""The CRD and the chart's copy of it (Helm installs a chart's crds/), relative to the repository."""
HEADER = ("# Generated from distflow.spec by `python -m distflow_operator.crdgen`; do not edit.\n"
          "# tests/unit/test_crd.py fails when this file is stale.\n")

CHOICES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("algorithm", "advantageEstimator"): ADVANTAGE_ESTIMATORS,
    ("algorithm", "policyLoss"): POLICY_LOSSES,
    ("algorithm", "klLossType"): KL_ESTIMATORS,
    ("algorithm", "lossAggMode"): LOSS_AGG_MODES,
    ("workflow", "name"): BUILTIN_WORKFLOWS,
    ("workflow", "nodes", "*", "role"): NODE_ROLES,
}
"""Spec paths (``*`` = list item) of strings validated against a list -> their enum."""

IMMUTABLE = ("model", "data", "rollout", "algorithm", "actor", "workflow", "cluster", "dataPlane",
             "checkpoint", "trainer", "async")
"""What the pods compute: fixed for the job's life (runPolicy stays editable)."""
RESIZABLE = {"cluster": "numNodes", "async": "rolloutPool.numNodes"}
"""Within an IMMUTABLE section, the field a resize changes (the scale subresource's replicas:
`kubectl scale`, an autoscaler; the rollout pool's size, resized in place with cluster.numNodes);
the section's other fields stay fixed. A dotted path names a field of a nested object."""

MAX_NAME_LENGTH = MAX_JOB_NAME_LENGTH

_COPIED = ("type", "description", "enum", "pattern", "minLength", "maxLength", "minItems", "maxItems",
           "minimum", "maximum", "format", "maxProperties")
_HANDLED = set(_COPIED) | {"title", "default", "properties", "required", "additionalProperties",
                           "items", "exclusiveMinimum", "exclusiveMaximum", "$ref", "anyOf"}

_WORLD = "(self.cluster.numNodes * self.cluster.procsPerNode)"
_POOLED = "(has(self.async) && has(self.async.enable) && self.async.enable)"
_ROLLOUT_NODES = "(has(self.async.rolloutPool) && has(self.async.rolloutPool.numNodes) ? self.async.rolloutPool.numNodes : 1)"
# The workers that generate and the workers that train: all of them, or each pool's (async.enable).
_GEN_WORLD = f"({_POOLED} ? {_ROLLOUT_NODES} * self.cluster.procsPerNode : {_WORLD})"
_TRAIN_WORLD = f"({_POOLED} ? {_WORLD} - {_ROLLOUT_NODES} * self.cluster.procsPerNode : {_WORLD})"
_TP = "self.rollout.tensorParallelSize"
_DP = f"({_GEN_WORLD} / {_TP} > 1 ? {_GEN_WORLD} / {_TP} : 1)"
_MINI = "self.actor.ppoMiniBatchSize"
_BATCH = "self.data.trainBatchSize"
_MIN_NODES = "self.cluster.minNodes"
_MAX_NODES = "self.cluster.maxNodes"
_REPLICATE = "self.cluster.dataParallelReplicateDegree"
_SHARD = "self.cluster.dataParallelShardDegree"

SPEC_RULES: list[dict[str, str]] = [
    # Mirror distflow.spec.validation.size_problems: same fields, same fixes. The numbers stay in
    # pydantic's messages only: a messageExpression with string(int) exceeds the API
    # server's CEL cost budget (it estimates such strings as unbounded).
    # A resize's bounds (kubectl scale goes through these rules too: the API server refuses the size).
    {"rule": f"!has({_MIN_NODES}) || !has({_MAX_NODES}) || {_MIN_NODES} <= {_MAX_NODES}",
     "message": "cluster.minNodes: is above cluster.maxNodes; use at most maxNodes",
     "fieldPath": ".cluster.minNodes", "reason": "FieldValueInvalid"},
    {"rule": f"!has({_MIN_NODES}) || self.cluster.numNodes >= {_MIN_NODES}",
     "message": "cluster.numNodes: is below cluster.minNodes; use at least minNodes or lower it",
     "fieldPath": ".cluster.numNodes", "reason": "FieldValueInvalid"},
    {"rule": f"!has({_MAX_NODES}) || self.cluster.numNodes <= {_MAX_NODES}",
     "message": "cluster.numNodes: is above cluster.maxNodes; use at most maxNodes or raise it",
     "fieldPath": ".cluster.numNodes", "reason": "FieldValueInvalid"},
    {"rule": f"!{_POOLED} || {_ROLLOUT_NODES} < self.cluster.numNodes",
     "message": "async.rolloutPool.numNodes: leaves no node to train; use fewer than cluster.numNodes",
     "fieldPath": ".async.rolloutPool.numNodes", "reason": "FieldValueInvalid"},
    {"rule": f"{_TP} < 1 || {_GEN_WORLD} % {_TP} == 0",
     "message": "rollout.tensorParallelSize: must divide the workers (cluster.numNodes x "
                "cluster.procsPerNode; the rollout pool's with async.enable); pick a divisor of that product",
     "fieldPath": ".rollout.tensorParallelSize", "reason": "FieldValueInvalid"},
    {"rule": f"{_TP} < 1 || {_BATCH} % {_DP} == 0",
     "message": "data.trainBatchSize: prompts cannot be split evenly over the rollout dp ranks "
                "(cluster.numNodes x cluster.procsPerNode / rollout.tensorParallelSize; the rollout pool's "
                "with async.enable); use a multiple of them",
     "fieldPath": ".data.trainBatchSize", "reason": "FieldValueInvalid"},
    {"rule": f"!has({_MINI}) || {_MINI} < 1 || {_BATCH} % {_MINI} == 0",
     "message": "actor.ppoMiniBatchSize: does not divide data.trainBatchSize; use a divisor of it",
     "fieldPath": ".actor.ppoMiniBatchSize", "reason": "FieldValueInvalid"},
    {"rule": f"self.rollout.engine != 'hf' || {_TP} == 1",
     "message": "rollout.tensorParallelSize: the hf engine runs with 1; set it to 1",
     "fieldPath": ".rollout.tensorParallelSize", "reason": "FieldValueInvalid"},
    *({"rule": f"!has(self.cluster.{name}) || self.cluster.{name} < 1 || {_TRAIN_WORLD} % self.cluster.{name} == 0",
       "message": f"cluster.{name}: must divide the workers (cluster.numNodes x cluster.procsPerNode); "
                  "pick a divisor of that product",
       "fieldPath": f".cluster.{name}", "reason": "FieldValueInvalid"}
      for name in ("dataParallelReplicateDegree", "dataParallelShardDegree")),
    {"rule": f"!has({_REPLICATE}) || !has({_SHARD}) || {_REPLICATE} * {_SHARD} == {_TRAIN_WORLD}",
     "message": "cluster.dataParallelShardDegree: replicas x shards must be the workers "
                "(cluster.numNodes x cluster.procsPerNode); set it so, or leave it unset",
     "fieldPath": ".cluster.dataParallelShardDegree", "reason": "FieldValueInvalid"},
    {"rule": "oldSelf.runPolicy.suspend || (self.template == oldSelf.template && "
             "self.scheduling == oldSelf.scheduling)",
     "message": "spec.template and spec.scheduling may change only while the job is suspended; "
                "set spec.runPolicy.suspend: true first"},
]

ENV_NAME_RULE = {
    "rule": "self.all(e, !(e.name in [" + ", ".join(f"'{n}'" for n in OPERATOR_ENV_NAMES) + "]))",
    "message": "spec.template.env: the operator sets " + ", ".join(OPERATOR_ENV_NAMES)
               + " on every node; remove them from template.env",
}
_OWNED_LABELS = (*NODE_LABEL_KEYS, *GANG_METADATA_KEYS, *KUEUE_KEYS)
LABEL_KEYS_RULE = {
    "rule": "self.all(k, !(k in [" + ", ".join(f"'{k}'" for k in _OWNED_LABELS) + "]))",
    "message": "spec.template.labels: the operator sets " + ", ".join(_OWNED_LABELS)
               + " on node pods; remove them (for Kueue, label the RLPostTrainJob itself)",
}
ROOT_RULE = {
    "rule": "!self.runAsNonRoot || !has(self.runAsUser) || self.runAsUser != 0",
    "message": "spec.template.securityContext.runAsUser: 0 contradicts runAsNonRoot: true; "
               "set runAsNonRoot: false to run as root, or pick a non-zero uid",
}
NAME_RULE = {
    "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && "
            f"self.metadata.name.matches('{JOB_NAME_PATTERN}')",
    "message": f"metadata.name: must start with a letter, contain only a-z, 0-9 and '-', and be at "
               f"most {MAX_NAME_LENGTH} characters (it names the Service and the pods <name>-node-<rank>)",
}

OVERLAYS: dict[tuple[str, ...], dict[str, Any]] = {
    # An EnvVar needs a name, and CEL can read only declared fields.
    ("template", "env", "*"): {"required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}},
    ("template", "env"): {"x-kubernetes-validations": [ENV_NAME_RULE]},
    ("template", "labels"): {"x-kubernetes-validations": [LABEL_KEYS_RULE]},
    ("template", "securityContext"): {"x-kubernetes-validations": [ROOT_RULE]},
}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline ``$ref`` and unwrap ``anyOf: [X, null]``."""
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) != 1 or len(node["anyOf"]) != 2:
            raise ValueError(f"crdgen: cannot express anyOf {node['anyOf']}; use `X | None` only")
        node = {**_resolve(options[0], defs), **{k: v for k, v in node.items() if k != "anyOf"}}
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        sibling = {k: v for k, v in node.items() if k != "$ref"}
        node = {**_resolve(target, defs), **sibling}
    return node


def _structural(node: dict[str, Any], defs: dict[str, Any], path: tuple[str, ...],
                with_defaults: bool) -> dict[str, Any]:
    if "const" in node:  # a one-value Literal: an enum of one
        node = {**{k: v for k, v in node.items() if k != "const"}, "enum": [node["const"]]}
    unknown = set(node) - _HANDLED
    if unknown:
        raise ValueError(f"crdgen: {'.'.join(path)}: unsupported schema keywords {sorted(unknown)}")
    out = {k: node[k] for k in _COPIED if k in node}
    if "description" in out:
        # Docstrings wrap at 100 columns; kubectl explain re-wraps anyway.
        out["description"] = " ".join(out["description"].split())
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node:
            out[limit], out[bound] = node[bound], True
    if with_defaults and node.get("default") is not None:
        out["default"] = node["default"]
    kind = node.get("type")
    if kind == "object" and "properties" in node:
        out["properties"] = {}
        for name, child in node["properties"].items():
            resolved = _resolve(child, defs)
            sub = _structural(resolved, defs, path + (name,), with_defaults)
            if (with_defaults and name not in node.get("required", ()) and "properties" in resolved
                    and not resolved.get("required") and "default" not in sub):
                sub["default"] = {}
            out["properties"][name] = sub
        if node.get("required"):
            out["required"] = list(node["required"])
    elif kind == "object" and isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _structural(_resolve(node["additionalProperties"], defs), defs,
                                                  path + ("*",), with_defaults)
    elif kind == "object" or kind is None:
        out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["items"] = _structural(_resolve(node["items"], defs), defs, path + ("*",), with_defaults)
    if path in CHOICES:
        out["enum"] = list(CHOICES[path])
    for key, extra in OVERLAYS.get(path, {}).items():
        out[key] = {**out.get(key, {}), **extra} if isinstance(extra, dict) else list(extra)
    return out


def model_schema(model: type, with_defaults: bool) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of a pydantic model (camelCase field names)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs, (), with_defaults)


def _unchanged_rule(section: dict[str, Any], resizable: str | None) -> str:
    """CEL transition rule: the section equals its old self, ``resizable`` (a scalar field) aside.
    Each field may be absent (the API server checks the section's default ``{}`` against the rule
    too): then it must be absent on both sides."""
    if resizable is None:
        return "self == oldSelf"
    return _unchanged_fields(section, resizable.split("."), "")


def _unchanged_fields(section: dict[str, Any], resizable: list[str], prefix: str) -> str:
    """The fields of ``section`` (at ``prefix``) unchanged, the path ``resizable`` aside."""
    rules = []
    for f in section["properties"]:
        path = f"{prefix}{f}"
        if f == resizable[0] and len(resizable) == 1:
            continue
        if f == resizable[0]:
            inner = _unchanged_fields(section["properties"][f], resizable[1:], f"{path}.")
            rules.append(f"(has(self.{path}) ? has(oldSelf.{path}) && {inner} : !has(oldSelf.{path}))")
        else:
            rules.append(f"(has(self.{path}) ? has(oldSelf.{path}) && self.{path} == oldSelf.{path} "
                         f": !has(oldSelf.{path}))")
    return " && ".join(rules)


def spec_schema() -> dict[str, Any]:
    schema = model_schema(JobSpec, with_defaults=True)
    for name in IMMUTABLE:
        schema["properties"][name]["x-kubernetes-validations"] = [{
            "rule": _unchanged_rule(schema["properties"][name], RESIZABLE.get(name)),
            "message": f"spec.{name} cannot change while the job exists; create a new job "
                       f"(it resumes from spec.checkpoint.dir)"
                       + (f"; only {name}.{RESIZABLE[name]} may (a resize)" if name in RESIZABLE else "")}]
    schema["x-kubernetes-validations"] = SPEC_RULES
    return schema


def status_schema() -> dict[str, Any]:
    schema = model_schema(JobStatus, with_defaults=False)
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return schema


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Nodes", "type": "string", "jsonPath": ".status.nodes", "description": "ready/desired node pods"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.progress.tokensPerSecond"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
]


SCALE_SUBRESOURCE = {"specReplicasPath": ".spec.cluster.numNodes", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}
"""`kubectl scale rljob NAME --replicas=N` and an HPA's target: replicas are node pods."""


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    root = {
        "type": "object",
        "description": f"{KIND}: fully distributed RL post-training (GRPO, PPO, ...) of an LLM.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": [NAME_RULE],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME,
                     "labels": {"app.kubernetes.io/name": "distflow", "app.kubernetes.io/part-of": "distflow"}},
        "spec": {
            "group": API_GROUP,
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": [SHORT_NAME], "categories": [CATEGORY]},
            "scope": "Namespaced",
            "versions": [{
                "name": API_VERSION, "served": True, "storage": True,
                "subresources": {"status": {}, "scale": SCALE_SUBRESOURCE},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


class _GoSafeDumper(yaml.SafeDumper):
    """Quotes y/Y/n/N too: Go's YAML 1.1 parser (kubectl, the API server) reads them as
    booleans, so an unquoted ``n:`` property (rollout.n) would arrive as ``false``."""


_GoSafeDumper.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))


def render_crd_yaml() -> str:
    return HEADER + yaml.dump(build_crd(), Dumper=_GoSafeDumper, sort_keys=False, width=1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distflow_operator.crdgen", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, action="append",
                        help=f"a file to write (repeatable); default: {' and '.join(map(str, DEFAULT_OUTPUTS))}")
    parser.add_argument("--check", action="store_true", help="exit 1 if an --output differs from the model")
    args = parser.parse_args(argv)
    text = render_crd_yaml()
    outputs = args.output or list(DEFAULT_OUTPUTS)
    if args.check:
        stale = [out for out in outputs if (out.read_text() if out.exists() else "") != text]
        for out in stale:
            print(f"{out} is stale; run: python -m distflow_operator.crdgen", file=sys.stderr)
        if not stale:
            print(f"{' and '.join(map(str, outputs))} up to date")
        return 1 if stale else 0
    for out in outputs:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
