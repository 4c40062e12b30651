"""Bad job configs, generated from the examples: what a new user gets wrong.

Each :class:`BadConfig` is a mutation of one example (or of its data file):
the document to write, the files it refers to, and the field path the error
message must name. Categories (``CATEGORIES``):

- ``wrong type``: every scalar field of the spec model, given a value of
  another type (text for a number, a list for text, ...).
- ``out of range``: every bounded number, just past each bound.
- ``bad choice``: every enumerated field, given a name it does not know.
- ``missing``: each required field removed.
- ``unknown field``: each section of the example, given a misspelled key.
- ``bad file``: data files that are missing, empty, a directory, not JSON
  lines, not parquet, or of no known record schema; config files that are
  empty, not YAML or not a mapping.
- ``conflict``: settings that are valid alone but not together.
- ``bad function``: reward, custom-node and multi-turn tool functions that do not import.
- ``bad manifest``: a misspelled ``kind`` or a manifest without a spec.

The mutations of spec fields are derived from the pydantic model (so a new
field is covered when it is added); the file, conflict and function cases are
listed by hand.
"""

from __future__ import annotations

import copy
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic.alias_generators import to_camel

from distflow.spec import JobSpec

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ("quickstart.yaml", "ppo.yaml", "dapo.yaml", "gsm8k-grpo.yaml")
CATEGORIES = ("wrong type", "out of range", "bad choice", "missing", "unknown field", "bad file", "conflict",
              "bad function", "bad manifest")
GSM8K_ROW = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


@dataclass
class BadConfig:
    """One bad input: ``doc`` (None: ``raw`` is the config file's text) and the files it names."""

    name: str
    category: str
    field: str
    """What the message must name: ``spec.<path>`` of the field, or the config file for file-level errors."""
    doc: dict | None = None
    raw: bytes | None = None
    files: dict[str, bytes | None] = field(default_factory=dict)
    """Data files to create next to the config (None: a directory)."""

    def write(self, where: Path) -> Path:
        """The config (and its files) under ``where``; ``@DIR@`` in the document becomes ``where``."""
        where.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            if data is None:
                (where / name).mkdir(exist_ok=True)
            else:
                (where / name).write_bytes(data)
        config = where / "job.yaml"
        if self.raw is not None:
            config.write_bytes(self.raw)
        else:
            config.write_text(yaml.safe_dump(self.doc).replace("@DIR@", str(where)))
        return config

    def expected(self, config: Path) -> str:
        return self.field.replace("@CONFIG@", str(config))


def example(name: str) -> dict:
    """An example config, its data files pointed at a small gsm8k file written next to the config."""
    doc = yaml.safe_load((REPO / "examples" / name).read_text())
    for split in ("train", "eval"):
        ds = doc["data"].get(split)
        if ds and not str(ds["path"]).startswith("arithmetic"):
            ds["path"] = "@DIR@/train.jsonl"
    doc.setdefault("checkpoint", {})["dir"] = "@DIR@/ckpt"
    doc.setdefault("trainer", {})["logDir"] = "@DIR@/run"
    return doc


def _good_files() -> dict[str, bytes]:
    return {"train.jsonl": (json.dumps(GSM8K_ROW) + "\n").encode()}


def _set(doc: dict, path: tuple[str, ...], value: Any) -> dict:
    out = copy.deepcopy(doc)
    node = out
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return out


def _delete(doc: dict, path: tuple[str, ...]) -> dict:
    out = copy.deepcopy(doc)
    node = out
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]
    return out


def _scalar_kind(annotation) -> tuple[str, tuple]:
    """(kind, literal choices) of a field's type, ``None`` in a union ignored; kind '' when not a scalar."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return _scalar_kind(rest[0]) if len(rest) == 1 else ("", ())
    if typing.get_origin(annotation) is Literal:
        return "choice", args
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(annotation, ""), ()


WRONG_TYPE = {"int": "twelve", "float": "fast", "bool": "maybe", "str": [1, 2], "choice": {"a": 1}}


def _bounds(info) -> list[tuple[str, float]]:
    """(``below``/``above``, value just past the bound) for each numeric bound of a field."""
    out = []
    for meta in info.metadata:
        for name, sign, strict in (("ge", -1, False), ("gt", -1, True), ("le", 1, False), ("lt", 1, True)):
            bound = getattr(meta, name, None)
            if bound is not None:
                past = bound if strict else bound + sign * (1 if isinstance(bound, int) else 0.5)
                out.append(("below" if sign < 0 else "above", past))
    return out


def _model_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()):
    """(camelCase path, field info, sub-model or None) of every field, depth first; lists of models skipped."""
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or to_camel(name),)
        annotation = info.annotation
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        members = [a for a in typing.get_args(annotation) if a is not type(None)] if union else [annotation]
        sub = next((a for a in members if isinstance(a, type) and issubclass(a, BaseModel)), None)
        yield path, info, sub
        if sub is not None:
            yield from _model_fields(sub, path)


def field_mutations(base: dict, base_name: str) -> list[BadConfig]:
    """Wrong types, out-of-range numbers, unknown choices and missing required fields, from the model."""
    out = []
    for path, info, sub in _model_fields(JobSpec):
        dotted = ".".join(path)
        if path[0] in ("workflow",) and len(path) > 1 and path[1] == "nodes":
            continue
        kind, _ = _scalar_kind(info.annotation)
        if sub is None and kind:
            category = "bad choice" if kind == "choice" else "wrong type"
            out.append(BadConfig(f"{base_name}:{dotted}:{category}", category, f"spec.{dotted}",
                                 _set(base, path, WRONG_TYPE[kind]), files=_good_files()))
            for side, value in _bounds(info) if kind in ("int", "float") else ():
                if kind == "int" and value != int(value):
                    continue
                out.append(BadConfig(f"{base_name}:{dotted}:{side}", "out of range", f"spec.{dotted}",
                                     _set(base, path, int(value) if kind == "int" else value),
                                     files=_good_files()))
        if info.is_required() and _present(base, path):
            out.append(BadConfig(f"{base_name}:{dotted}:missing", "missing", f"spec.{dotted}",
                                 _delete(base, path), files=_good_files()))
    return out


def _present(doc: dict, path: tuple[str, ...]) -> bool:
    node: Any = doc
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def unknown_fields(base: dict, base_name: str) -> list[BadConfig]:
    """A misspelled key in every section of the example (its first key with one letter dropped)."""
    out = [BadConfig(f"{base_name}:<top>:unknown", "unknown field", "spec.trainers",
                     {**base, "trainers": {"totalSteps": 3}}, files=_good_files())]
    for section, body in base.items():
        if isinstance(body, dict) and body:
            key = next(iter(body))
            typo = key[:-1] if len(key) > 2 else key + "x"
            if typo in body:
                continue
            out.append(BadConfig(f"{base_name}:{section}.{typo}:unknown", "unknown field", f"spec.{section}.{typo}",
                                 _set(base, (section, typo), body[key]), files=_good_files()))
    return out


def _parquet_of(rows: list[dict]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def bad_files(base: dict) -> list[BadConfig]:
    """Data files and config files a worker could not read."""
    train = ("data", "train", "path")
    data_cases: list[tuple[str, str, bytes | None]] = [
        ("missing", "nowhere.jsonl", b""),
        ("empty", "train.jsonl", b""),
        ("blank lines", "train.jsonl", b"\n\n\n"),
        ("a directory", "train.jsonl", None),
        ("csv text", "train.jsonl", b"question,answer\nWhat is 2 + 3?,5\n"),
        ("a JSON array", "train.json", json.dumps([GSM8K_ROW]).encode()),
        ("binary", "train.jsonl", bytes(range(256)) * 4),
        ("truncated JSON", "train.jsonl", json.dumps(GSM8K_ROW)[:-5].encode() + b"\n"),
        ("no prompt field", "train.jsonl", json.dumps({"text": "2 + 3?", "label": "5"}).encode() + b"\n"),
        ("a JSON number per line", "train.jsonl", b"5\n6\n"),
        ("a JSON string per line", "train.jsonl", b'"What is 2 + 3?"\n'),
        ("verl schema without ground truth", "train.jsonl", json.dumps(
            {"data_source": "x", "prompt": "2+3?", "reward_model": {}}).encode() + b"\n"),
        ("gsm8k answer without ####", "train.jsonl", json.dumps(
            {"question": "2+3?", "answer": "5"}).encode() + b"\n"),
        ("not parquet", "train.parquet", b"PAR1 but not really"),
        ("parquet of another schema", "train.parquet", _parquet_of([{"text": "hi"}])),
        ("csv file", "train.csv", b"question,answer\n"),
    ]
    out = []
    for what, name, data in data_cases:
        files = {} if what == "missing" else {name: data}
        for split in ("train", "eval"):
            doc = _set(base, train, "@DIR@/train.jsonl") if split == "eval" else base
            doc = _set(doc, ("data", split, "path"), f"@DIR@/{name}")
            needed = {**_good_files(), **files} if split == "eval" else files
            out.append(BadConfig(f"data.{split}: {what}", "bad file", f"spec.data.{split}.path", doc,
                                 files=needed))
    for what, path in (("a directory that does not exist", "@DIR@/no/such/model"), ("a GGUF file that does not "
                       "exist", "gguf:@DIR@/model.gguf"), ("a data file as the model", "@DIR@/train.jsonl")):
        out.append(BadConfig(f"model.path: {what}", "bad file", "spec.model.path",
                             _set(base, ("model", "path"), path), files=_good_files()))
    for what, raw in (("empty", b""), ("only a comment", b"# nothing\n"), ("not YAML", b"model: [unclosed\n"),
                      ("a YAML list", b"- model\n- data\n"), ("a YAML string", b"quickstart\n"),
                      ("binary", b"\xff\xfe\x00\x01" * 16), ("tabs", b"model:\n\tpath: tiny\n")):
        out.append(BadConfig(f"config file: {what}", "bad file", "@CONFIG@", raw=raw))
    return out


CONFLICTS: list[tuple[str, str, dict]] = [
    ("greedy group sampling", "spec.rollout.temperature",
     {"rollout": {"temperature": 0, "n": 8}, "algorithm": {"advantageEstimator": "grpo"}}),
    ("group advantage of one response", "spec.rollout.n",
     {"rollout": {"n": 1}, "algorithm": {"advantageEstimator": "rloo"}}),
    ("batch not divisible by workers", "spec.data.trainBatchSize", {"data": {"trainBatchSize": 3}}),
    ("mini-batch not dividing batch", "spec.actor.ppoMiniBatchSize", {"actor": {"ppoMiniBatchSize": 3}}),
    ("critic mini-batch not dividing batch", "spec.critic.ppoMiniBatchSize", {"critic": {"ppoMiniBatchSize": 3}}),
    ("tp with hf", "spec.rollout.tensorParallelSize", {"rollout": {"tensorParallelSize": 2}}),
    ("tp not dividing workers", "spec.rollout.tensorParallelSize", {"rollout": {"tensorParallelSize": 3}}),
    ("tis without vllm", "spec.rollout.tisImpRatioCap", {"rollout": {"tisImpRatioCap": 2.0}}),
    ("ppo without gae", "spec.algorithm.advantageEstimator",
     {"workflow": {"name": "ppo"}, "algorithm": {"advantageEstimator": "grpo"}}),
    ("filter groups with n=1", "spec.algorithm.filterGroups.enable",
     {"algorithm": {"filterGroups": {"enable": True}, "advantageEstimator": "reinforce_plus_plus"},
      "rollout": {"n": 1}}),
    ("greedy held-out sampling with n>1", "spec.rollout.val.n", {"rollout": {"val": {"n": 4, "temperature": 0}}}),
    ("operands reversed", "spec.data.train.minOperand",
     {"data": {"train": {"path": "arithmetic", "minOperand": 30, "maxOperand": 20}}}),
    ("eval on the training split", "spec.data.eval.path", {"data": {"eval": {"path": "arithmetic:train"}}}),
    ("unknown arithmetic split", "spec.data.train.path", {"data": {"train": {"path": "arithmetic:test"}}}),
    ("overlong buffer past the response length", "spec.algorithm.overlongBuffer.length",
     {"algorithm": {"overlongBuffer": {"enable": True, "length": 4096}}}),
    ("unknown tiny tokenizer", "spec.model.path", {"model": {"path": "tiny:gpt5"}}),
    ("unknown advantage estimator", "spec.algorithm.advantageEstimator",
     {"algorithm": {"advantageEstimator": "grpo++"}}),
    ("unknown policy loss", "spec.algorithm.policyLoss", {"algorithm": {"policyLoss": "clipped"}}),
    ("unknown loss aggregation", "spec.algorithm.lossAggMode", {"algorithm": {"lossAggMode": "mean"}}),
    ("unknown workflow", "spec.workflow.name", {"workflow": {"name": "grpo2"}}),
    ("unknown built-in reward", "spec.data.rewardFn", {"data": {"rewardFn": "gsm9k"}}),
    ("rollout pool of every node", "spec.async.rolloutPool.numNodes",
     {"async": {"enable": True, "rolloutPool": {"numNodes": 64}}}),
    ("asynchronous mode with tensor-parallel vllm", "spec.rollout.tensorParallelSize",
     {"async": {"enable": True}, "cluster": {"numNodes": 2},
      "rollout": {"engine": "vllm", "tensorParallelSize": 2}}),
    ("asynchronous mode with dynamic sampling", "spec.async.enable",
     {"async": {"enable": True}, "cluster": {"numNodes": 2}, "algorithm": {"filterGroups": {"enable": True}}}),
    ("multi-turn with nothing to call", "spec.rollout.multiTurn.enable", {"rollout": {"multiTurn": {"enable": True}}}),
    ("multi-turn with tensor-parallel vllm", "spec.rollout.tensorParallelSize",
     {"cluster": {"procsPerNode": 2}, "rollout": {"engine": "vllm", "tensorParallelSize": 2,
                                                  "multiTurn": {"enable": True, "environment": "envs:Game"}}}),
    ("multi-turn tool arguments not an object", "spec.rollout.multiTurn.tools[0].toolSchema.function.parameters",
     {"rollout": {"multiTurn": {"enable": True, "tools": [{"function": "distflow.multiturn.tools.calculator:calculate",
                                                          "toolSchema": {"function": {"name": "calculate",
                                                                                      "parameters": {"type": "string"}}}}]}}}),
    ("multi-turn turn longer than the budget", "spec.rollout.multiTurn.maxTokensPerTurn",
     {"rollout": {"multiTurn": {"enable": True, "environment": "envs:Game", "maxTokensPerTurn": 100000}}}),
    ("custom workflow with a cycle", "spec.workflow.nodes", {"workflow": {"nodes": [
        {"id": "gen", "role": "rollout", "kind": "inference", "deps": ["train"]},
        {"id": "score", "role": "reward", "kind": "compute", "deps": ["gen"]},
        {"id": "adv", "role": "advantage", "kind": "compute", "deps": ["score"]},
        {"id": "train", "role": "actor", "kind": "train", "deps": ["adv"]}]}, "algorithm": {"useKlLoss": False}}),
    ("custom workflow with an unknown role", "spec.workflow.nodes[1].role", {"workflow": {"nodes": [
        {"id": "gen", "role": "rollout", "kind": "inference"},
        {"id": "score", "role": "grader", "kind": "compute", "deps": ["gen"]}]}}),
]

CUSTOM_NODES = [{"id": "gen", "role": "rollout", "kind": "inference"},
                {"id": "score", "role": "reward", "kind": "compute", "deps": ["gen"]},
                {"id": "mine", "role": "custom", "kind": "compute", "deps": ["score"], "function": "@FUNCTION@"},
                {"id": "adv", "role": "advantage", "kind": "compute", "deps": ["mine"]},
                {"id": "train", "role": "actor", "kind": "train", "deps": ["adv"]}]
FUNCTIONS = [("no such module", "no_such_module_xyz:f"), ("no such file", "@DIR@/nowhere.py:f"),
             ("no such function", "@DIR@/user.py:nothing_here"), ("not callable", "@DIR@/user.py:LIMIT"),
             ("module raising on import", "@DIR@/broken.py:f"), ("no function name", "@DIR@/user.py:")]
USER_FILES = {"user.py": b"LIMIT = 3\ndef score(response, ground_truth, extra_info):\n    return 1.0\n",
              "broken.py": b"raise RuntimeError('broken on import')\n"}


def conflicts(base: dict, base_name: str) -> list[BadConfig]:
    out = []
    for what, path, change in CONFLICTS:
        doc = copy.deepcopy(base)
        for section, values in change.items():
            doc[section] = {**doc.get(section, {}), **values} if isinstance(values, dict) else values
        out.append(BadConfig(f"{base_name}: {what}", "conflict", path, doc, files=_good_files()))
    return out


def bad_functions(base: dict) -> list[BadConfig]:
    out = []
    for what, ref in FUNCTIONS:
        out.append(BadConfig(f"rewardFn: {what}", "bad function", "spec.data.rewardFn",
                             _set(base, ("data", "rewardFn"), ref), files={**_good_files(), **USER_FILES}))
        nodes = json.loads(json.dumps(CUSTOM_NODES).replace("@FUNCTION@", ref))
        doc = {**base, "workflow": {"nodes": nodes}, "algorithm": {**base.get("algorithm", {}), "useKlLoss": False}}
        out.append(BadConfig(f"custom node: {what}", "bad function", "spec.workflow.nodes[2].function", doc,
                             files={**_good_files(), **USER_FILES}))
        tool = {"function": ref, "toolSchema": {"function": {"name": "calculate"}}}
        doc = {**base, "rollout": {**base.get("rollout", {}), "multiTurn": {"enable": True, "tools": [tool]}}}
        out.append(BadConfig(f"multi-turn tool: {what}", "bad function", "spec.rollout.multiTurn.tools[0].function",
                             doc, files={**_good_files(), **USER_FILES}))
    return out


def bad_manifests() -> list[BadConfig]:
    manifest = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    out = []
    for kind in ("RLPostTrainJobs", "RlPostTrainJob", "RLJob", "Job"):
        out.append(BadConfig(f"manifest kind {kind}", "bad manifest", "kind", {**manifest, "kind": kind}))
    out.append(BadConfig("manifest without kind", "bad manifest", "kind",
                         {k: v for k, v in manifest.items() if k != "kind"}))
    out.append(BadConfig("manifest without spec", "bad manifest", "spec",
                         {k: v for k, v in manifest.items() if k != "spec"}))
    out.append(BadConfig("manifest spec not a mapping", "bad manifest", "spec", {**manifest, "spec": "quickstart"}))
    return out


def generate() -> list[BadConfig]:
    """Every bad config, each with a unique name."""
    out: list[BadConfig] = []
    quickstart = example("quickstart.yaml")
    out += field_mutations(quickstart, "quickstart")
    for name in EXAMPLES:
        base = example(name)
        out += unknown_fields(base, name.removesuffix(".yaml"))
        out += conflicts(base, name.removesuffix(".yaml"))
    gsm8k = example("gsm8k-grpo.yaml")
    out += bad_files(gsm8k)
    out += bad_functions(quickstart)
    out += bad_manifests()
    names = [c.name for c in out]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    return out


def categories(configs: list[BadConfig]) -> dict[str, int]:
    """How many configs each category holds."""
    return {category: sum(c.category == category for c in configs) for category in CATEGORIES}

