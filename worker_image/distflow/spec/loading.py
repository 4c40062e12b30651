"""Reading a spec: YAML files, ``--set`` overrides, manifests, and errors with field paths.

Every validation error names the field path (``spec.data.trainBatchSize``) and
the fix, and is raised as :class:`DistflowConfigError` before any worker starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from distflow.errors import DistflowConfigError
from distflow.spec.models import JobSpec

API_GROUP = "distflow.io"
API_VERSION = "v1alpha1"
KIND = "RLPostTrainJob"


def _format_validation_error(err: ValidationError, root: str) -> list[str]:
    problems = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"] if not str(p).startswith("function-"))
        path = f"{root}.{loc}" if loc else root
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "value_error":
            # Cross-field validators name their own paths, relative to the spec.
            for line in msg.splitlines():
                own_path, sep, text = line.partition(": ")
                problems.append(f"{root}.{own_path}: {text}" if sep else f"{path}: {line}")
            continue
        if item["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling (fields are camelCase)"
        elif item["type"] == "missing":
            msg = "required field is missing; add it"
        elif "input" in item:
            msg = f"{msg} (got {item['input']!r})"
        problems.append(f"{path}: {msg}")
    return problems


def parse_spec(data: dict[str, Any], root: str = "spec") -> JobSpec:
    """Validate a spec mapping.

    Raises:
        DistflowConfigError: listing every problem with its field path.
    """
    if not isinstance(data, dict):
        raise DistflowConfigError(f"{root}: expected a mapping, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise DistflowConfigError(_format_validation_error(err, root)) from None


def spec_from_manifest(doc: dict[str, Any]) -> JobSpec:
    """Accept a whole RLPostTrainJob manifest or a bare spec mapping."""
    if isinstance(doc, dict) and doc.get("kind") == KIND:
        if "spec" not in doc:
            raise DistflowConfigError("spec: the RLPostTrainJob has no spec; add one")
        return parse_spec(doc["spec"], root="spec")
    return parse_spec(doc, root="spec")


def apply_overrides(doc: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a spec mapping.

    The path is relative to the spec (``data.train.path=...``).

    Raises:
        DistflowConfigError: an override is not `path=value`.
    """
    target = doc["spec"] if doc.get("kind") == KIND else doc
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise DistflowConfigError(f"--set {item!r}: expected path=value, e.g. data.train.path=train.jsonl")
        node = target
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise DistflowConfigError(f"--set {key}: {part} is not a mapping")
        node[parts[-1]] = _override_value(key, raw)
    return doc


def _override_value(key: str, raw: str) -> Any:
    """A ``--set`` value as YAML reads it (numbers, booleans, null, [lists], {mappings}), except
    that text which YAML would cut at `` #`` or turn into a mapping at ``: `` stays the text.

    Raises:
        DistflowConfigError: a value starting with ``[`` or ``{`` that is not valid YAML.
    """
    structured = raw.lstrip().startswith(("[", "{"))
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        if structured:
            raise DistflowConfigError(f"--set {key}: {raw!r} is not a valid YAML list or mapping ({err}); "
                                      "close the brackets, or quote the text") from None
        return raw
    if " #" in raw or (isinstance(value, (dict, list)) and not structured):
        return raw
    return value


def load_job_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Load a local run config or an RLPostTrainJob manifest from YAML.

    Raises:
        DistflowConfigError: file missing, not YAML, or an invalid spec.
    """
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise DistflowConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DistflowConfigError(f"{path}: is a directory; give a YAML file") from None
    except yaml.YAMLError as err:
        raise DistflowConfigError(f"{path}: not valid YAML: {err}") from None
    except UnicodeDecodeError:
        raise DistflowConfigError(f"{path}: not a text file; give a YAML file") from None
    if doc is None:
        raise DistflowConfigError(f"{path}: the file is empty")
    if not isinstance(doc, dict):
        raise DistflowConfigError(f"{path}: expected a mapping (a run config or an RLPostTrainJob), "
                                  f"got a YAML {type(doc).__name__}")
    if doc.get("kind") == KIND and not isinstance(doc.get("spec"), dict):
        raise DistflowConfigError(f"{path}: the RLPostTrainJob has no spec mapping; add one")
    return spec_from_manifest(apply_overrides(doc, overrides or []))


def dump_spec(spec: JobSpec) -> dict[str, Any]:
    """The spec as a camelCase mapping (what the operator writes into the ConfigMap)."""
    return spec.model_dump(mode="json", by_alias=True, exclude_none=True)
