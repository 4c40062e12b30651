"""Reading a spec: YAML files, ``--set`` overrides, manifests, and errors with field paths.

Every validation error names the field path (``spec.data.trainBatchSize``) and
the fix, and is raised as :class:`DistflowConfigError` before any worker starts.

Version skew between the operator and the worker image is a contract, both ways:

- the operator renders into the job's ConfigMap only the fields whose value
  is not the default (:func:`dump_spec_portable`), with ``schemaVersion``:
  an image of the previous release, which rejects fields it does not know,
  reads it as long as the user sets no field that release lacks;
- ``distflow node`` reads that ConfigMap with :func:`load_rendered_spec`,
  which drops fields this image does not know and names them in a warning,
  instead of failing the job as an invalid config (exit code 2). A user's own
  file (``distflow run``/``validate``/``plan``) still rejects them: there an
  unknown field is a typo.
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.alias_generators import to_camel

from distflow.errors import DistflowConfigError
from distflow.spec.models import WORKFLOW_DEFAULTS, JobSpec
from distflow.spec.validation import closest_choice

API_GROUP = "distflow.io"
API_VERSION = "v1alpha1"
KIND = "RLPostTrainJob"
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_JOB_NAME_LENGTH = 53
"""63 (DNS label) minus len('-node-4095'): the longest pod hostname must still fit."""
KUBECTL_BOOLEAN_KEYS = ("y", "Y", "n", "N")
"""Plain keys that kubectl's YAML 1.1 parser reads as booleans and PyYAML reads as strings: the
manifest ``distflow validate`` passes would reach the API server with a key ``false``."""
SPEC_SCHEMA_VERSION = 1
"""The spec schema this package reads and renders; one more in every release that adds spec fields."""


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
            msg = _unknown_field_message(item["loc"], root)
        elif item["type"] == "missing":
            msg = "required field is missing; add it"
        elif item["type"] == "model_type" and (fields := _known_fields((*item["loc"], ""))):
            name = str(item["loc"][-1])
            msg = (f"expected a section, a mapping of its fields (got {item.get('input')!r}); use e.g. "
                   f"{name}: {{{next(iter(fields))}: ...}} (its fields: {', '.join(fields)})")
        elif "input" in item:
            msg = f"{msg} (got {item['input']!r})"
            if fix := _fix_for(item["type"], item.get("ctx") or {}, item["input"]):
                msg = f"{msg}; {fix}"
        problems.append(f"{path}: {msg}")
    return problems


def _known_fields(loc: tuple) -> dict[str, str] | None:
    """``{camelCase name: snake_case name}`` of the spec section holding the field at ``loc`` (a
    pydantic error location from :class:`JobSpec`), or None where it is not a spec section."""
    model: Any = JobSpec
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if field is None or not (sections := _sections_of(field.annotation)):
            return None
        model = sections[0]
    return {field.alias or name: name for name, field in model.model_fields.items()}


def _sections_of(annotation: Any) -> list[type[BaseModel]]:
    """The spec sections (pydantic models) a field's annotation holds: ``X``, ``X | None``,
    ``list[X] | None``."""
    kinds = [annotation, *typing.get_args(annotation)]
    kinds += [arg for kind in kinds for arg in typing.get_args(kind)]
    return list(dict.fromkeys(k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)))


@functools.cache
def _section_paths(model: Any = JobSpec, prefix: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """``{camelCase field name: [its paths in the spec]}``, every section walked."""
    paths: dict[str, list[str]] = {}
    for name, field in model.model_fields.items():
        alias = field.alias or name
        paths.setdefault(alias, []).append(".".join((*prefix, alias)))
        for kind in _sections_of(field.annotation):
            for key, found in _section_paths(kind, (*prefix, alias)).items():
                paths.setdefault(key, []).extend(found)
    return paths


def _unknown_field_message(loc: tuple, root: str) -> str:
    """What to do about a field the spec does not have: the known one it misspells, if any, or the
    section it belongs to."""
    key, known = str(loc[-1]), _known_fields(loc) or {}
    if to_camel(key) != key and to_camel(key) in known:
        return f"given twice, as {key} and {to_camel(key)}; keep one"
    elsewhere = sorted(set(_section_paths().get(to_camel(key), ())))
    if 0 < len(elsewhere) <= 3:  # a name as common as `enable` or `path` would point everywhere
        return f"not a field of this section; it is {' or '.join(f'{root}.{p}' for p in elsewhere)}"
    if close := difflib.get_close_matches(key, list(known), n=1, cutoff=0.75):
        return f"unknown field; did you mean {close[0]}? (or remove it; fields are camelCase)"
    return "unknown field; remove it or check its spelling (fields are camelCase)"


_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}
_TYPE_FIXES = {"int_parsing": "use a whole number", "int_from_float": "use a whole number",
               "int_type": "use a whole number", "float_parsing": "use a number", "float_type": "use a number",
               "bool_parsing": "use true or false", "bool_type": "use true or false",
               "string_type": "use a string (quote it in YAML)", "finite_number": "use a finite number, e.g. 2"}


def _fix_for(error_type: str, ctx: dict, given: Any = None) -> str | None:
    """The fix for one of pydantic's field errors whose message gives none (a bound, a type).
    ``given``: the value given (YAML 1.1 reads ``1e3`` as text: the fix names the number)."""
    if error_type in _BOUNDS:
        op, key = _BOUNDS[error_type]
        return f"use a value {op} {ctx[key]}" if key in ctx else None
    fix = _TYPE_FIXES.get(error_type)
    choices = re.findall(r"'([^']*)'", ctx.get("expected", "")) if error_type == "literal_error" else []
    if error_type == "literal_error" and isinstance(given, bool):
        if not given and "none" in choices:
            return "YAML reads no and off as false; to turn it off, use 'none'"
        return (f"YAML reads yes, no, on and off as true and false, and none of them is a choice here; "
                f"use one of {', '.join(map(repr, choices))}")
    if error_type == "literal_error" and given is None:
        if "none" in choices:
            return "YAML reads null, ~ and an empty value as no value; to turn it off, use 'none'"
        return f"use one of {', '.join(map(repr, choices))}, or leave the field out for its default"
    if error_type == "literal_error" and isinstance(given, str):
        close = closest_choice(given, choices)
        return f"did you mean {close!r}?" if close else f"use one of {', '.join(map(repr, choices))}"
    if error_type == "int_parsing" and isinstance(given, str):
        try:
            number = float(given)
        except ValueError:
            return fix
        if number.is_integer():
            return f"{fix}: {int(number)} (YAML reads {given} as text)"
    return fix


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


def parse_spec_ignoring_unknown(data: Any, root: str = "spec") -> tuple[JobSpec, tuple[str, ...]]:
    """Validate a spec written by a newer distflow: (the spec without the fields this version does
    not know, their paths). Every other problem still counts.

    Raises:
        DistflowConfigError: listing the problems left once unknown fields are dropped.
    """
    try:
        return parse_spec(data, root), ()
    except DistflowConfigError as err:
        if not isinstance(data, dict):
            raise
        failure = err
    paths: list[tuple[Any, ...]] = []
    try:
        JobSpec.model_validate(data)
    except ValidationError as err:
        paths = [e["loc"] for e in err.errors() if e["type"] == "extra_forbidden"]
    if not paths:
        raise failure
    pruned = copy.deepcopy(data)
    for loc in paths:
        parent = pruned
        for key in loc[:-1]:
            parent = parent[key] if isinstance(parent, dict) or isinstance(key, int) else None
            if parent is None:
                break
        if isinstance(parent, dict):
            parent.pop(loc[-1], None)
    return parse_spec(pruned, root), tuple(".".join([root, *map(str, loc)]) for loc in paths)


def spec_from_manifest(doc: dict[str, Any]) -> JobSpec:
    """Accept a whole RLPostTrainJob manifest or a bare spec mapping."""
    if isinstance(doc, dict) and doc.get("kind") == KIND:
        if "spec" not in doc:
            raise DistflowConfigError("spec: the RLPostTrainJob has no spec; add one")
        return parse_spec(doc["spec"], root="spec")
    return parse_spec(doc, root="spec")


def apply_overrides(doc: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a spec mapping.

    The path is relative to the spec (``data.train.path=...``); a number addresses an item of a
    list that is already there (``rollout.multiTurn.tools.0.timeoutSeconds=5``).

    Raises:
        DistflowConfigError: an override is not `path=value`, or its path goes through a value
            that is neither a mapping nor a list, or names a list item that does not exist.
    """
    target = doc["spec"] if doc.get("kind") == KIND else doc
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise DistflowConfigError(f"--set {item!r}: expected path=value, e.g. data.train.path=train.jsonl")
        node = target
        parts = key.split(".")
        for depth, part in enumerate(parts):
            where = ".".join(parts[:depth]) or "the spec"
            last = depth == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise DistflowConfigError(
                        f"--set {key}: {where} is a list of {len(node)} item(s); address one by its index "
                        f"0..{len(node) - 1} (e.g. {where}.0.<field>), or set the whole list with "
                        f"{where}=[...]")
                index = int(part)
                if last:
                    node[index] = _override_value(key, raw)
                else:
                    node = node[index]
                continue
            if not isinstance(node, dict):
                raise DistflowConfigError(f"--set {key}: {where} is {node!r}, not a mapping or a list")
            if last:
                node[part] = _override_value(key, raw)
            else:
                node = node.setdefault(part, {})
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

    A manifest is also held to what the API server checks beyond the spec (:func:`manifest_problems`),
    unless it is a document the operator rendered for its pods (it carries ``schemaVersion``).

    Raises:
        DistflowConfigError: file missing, not YAML, or an invalid spec or manifest.
    """
    path = Path(path)
    doc = _read_document(path)
    user_manifest = doc.get("kind") == KIND and "schemaVersion" not in doc
    if user_manifest and (problems := manifest_problems(doc, path.read_text())):
        raise DistflowConfigError([f"{path}: {problem}" for problem in problems])
    return spec_from_manifest(apply_overrides(doc, overrides or []))


def load_rendered_spec(path: str | Path) -> tuple[JobSpec, list[str]]:
    """Load the spec the operator rendered into the job's ConfigMap (what ``distflow node`` reads):
    (the spec, warnings). Fields this image does not know, from a newer operator, are dropped and
    named in a warning rather than failing the node.

    Raises:
        DistflowConfigError: file missing, not YAML, or invalid for any other reason.
    """
    doc = _read_document(Path(path))
    body = doc["spec"] if doc.get("kind") == KIND else doc
    spec, unknown = parse_spec_ignoring_unknown(body, root="spec")
    if not unknown:
        return spec, []
    rendered = doc.get("schemaVersion", "unknown")
    return spec, [f"ignoring fields this worker image does not know: {', '.join(unknown)} (the operator "
                  f"rendered spec schema {rendered}, this image reads {SPEC_SCHEMA_VERSION}); use a newer "
                  "worker image (spec.template.image) for them to take effect"]


def render_spec_document(spec: JobSpec) -> dict[str, Any]:
    """What the operator writes into the job's ConfigMap: an RLPostTrainJob document whose spec holds
    only the fields not at their default (:func:`dump_spec_portable`), and the schema version."""
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "schemaVersion": SPEC_SCHEMA_VERSION,
            "spec": dump_spec_portable(spec)}


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"line {line}: the key {key!r} is given twice (first on line {first_line}); a YAML "
                         f"reader keeps only the last, dropping what the first held (kubectl refuses the file): "
                         f"merge the two")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that repeats a key (PyYAML keeps the last one
    silently; kubectl and the API server's strict decoding refuse it). Merge keys (``<<``) may
    still be overridden."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
            except TypeError:  # an unhashable key: the base constructor says so
                continue
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _read_document(path: Path) -> dict[str, Any]:
    """The YAML mapping in ``path``.

    Raises:
        DistflowConfigError: file missing, not YAML, a key given twice in a mapping, not a mapping,
            or a manifest without a spec.
    """
    try:
        doc = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as err:
        raise DistflowConfigError(f"{path}: {err}") from None
    except FileNotFoundError:
        raise DistflowConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DistflowConfigError(f"{path}: is a directory; give a YAML file") from None
    except yaml.composer.ComposerError as err:
        if "single document" not in str(err):
            raise DistflowConfigError(f"{path}: not valid YAML: {err}") from None
        raise DistflowConfigError(f"{path}: holds several YAML documents (---); distflow reads one run config or "
                                  f"{KIND} per file: put the job in a file of its own (a RayJob bundle's job is "
                                  "the job.yaml of its ConfigMap)") from None
    except yaml.YAMLError as err:
        raise DistflowConfigError(f"{path}: not valid YAML: {err}") from None
    except UnicodeDecodeError:
        raise DistflowConfigError(f"{path}: not a text file; give a YAML file") from None
    if doc is None:
        raise DistflowConfigError(f"{path}: the file is empty")
    if not isinstance(doc, dict):
        raise DistflowConfigError(f"{path}: expected a mapping (a run config or an RLPostTrainJob), "
                                  f"got a YAML {type(doc).__name__}")
    if "kind" in doc and doc["kind"] != KIND or "apiVersion" in doc and "kind" not in doc:
        raise DistflowConfigError(
            f"{path}: kind: {doc.get('kind')!r} is not a kind distflow reads; a manifest's kind is {KIND} "
            f"(apiVersion {API_GROUP}/{API_VERSION}); a local run config has no kind or apiVersion")
    if doc.get("kind") == KIND and not isinstance(doc.get("spec"), dict):
        raise DistflowConfigError(f"{path}: the RLPostTrainJob has no spec mapping; add one")
    return doc


def manifest_problems(doc: dict[str, Any], text: str) -> list[str]:
    """What the API server (or kubectl) refuses in an RLPostTrainJob manifest that the spec model
    cannot see: the apiVersion, metadata.name (the CRD's rule), and keys kubectl reads as booleans.

    Returns:
        One message per problem, each naming the field and the fix; empty when there is none.
    """
    problems = []
    expected = f"{API_GROUP}/{API_VERSION}"
    if doc.get("apiVersion") != expected:
        problems.append(f"apiVersion: {doc.get('apiVersion')!r} is not served for {KIND}; write apiVersion: {expected}")
    name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
    if not isinstance(name, str) or not name:
        problems.append("metadata.name: missing; give the job a name (e.g. metadata: {name: grpo-tiny})")
    elif len(name) > MAX_JOB_NAME_LENGTH or not re.match(JOB_NAME_PATTERN, name):
        problems.append(f"metadata.name: {name!r} must start with a letter, contain only a-z, 0-9 and '-', and be "
                        f"at most {MAX_JOB_NAME_LENGTH} characters (it names the Service and the pods "
                        "<name>-node-<rank>)")
    for key in _plain_keys(yaml.compose(text)):
        if key.value in KUBECTL_BOOLEAN_KEYS:
            problems.append(f"line {key.start_mark.line + 1}: the key {key.value} is unquoted, and kubectl reads a "
                            f"bare {key.value} as a boolean; quote it: \"{key.value}\":")
    return problems


def _plain_keys(node: Any):
    """Every unquoted scalar mapping key under the composed YAML ``node``."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.style is None:
                yield key
            yield from _plain_keys(value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from _plain_keys(item)


def dump_spec(spec: JobSpec) -> dict[str, Any]:
    """The spec as a camelCase mapping, every field with its value."""
    return spec.model_dump(mode="json", by_alias=True, exclude_none=True)


def dump_spec_portable(spec: JobSpec) -> dict[str, Any]:
    """The smallest camelCase mapping that parses back to ``spec``: fields at their default are left
    out, so a field a newer release adds reaches an older worker image only when the user sets it.

    What a built-in workflow implies (``WORKFLOW_DEFAULTS``) is kept as set: left out, a value
    equal to the field's default (advantageEstimator: grpo under workflow ppo) would be implied anew.
    """
    full = dump_spec(spec)
    portable = spec.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)
    if not spec.workflow.nodes:
        _copy_keys(WORKFLOW_DEFAULTS.get(spec.workflow.name, {}), full, portable)
    return portable


def _copy_keys(keys: dict[str, Any], source: dict[str, Any], target: dict[str, Any]) -> None:
    """Copy into ``target`` the value in ``source`` of every (nested) key of ``keys``."""
    for key, nested in keys.items():
        if isinstance(nested, dict):
            _copy_keys(nested, source.get(key) or {}, target.setdefault(key, {}))
        elif key in source:
            target[key] = source[key]
