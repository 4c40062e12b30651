"""Small local jobs for the end-to-end dist tests: a tiny model, varied prompts, 2 gloo workers.

``tiny_job_spec`` builds the spec (keyword sections merge one level deep into
the defaults), ``run_job`` runs it through the local launcher and returns the
final checkpoint (converted from DCP) and the metrics.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from distflow.checkpoint import complete_checkpoints
from distflow.launcher import launch_local
from distflow.metrics import read_jsonl
from distflow.spec import JobSpec, parse_spec

REWARDS = Path(__file__).with_name("toy_rewards.py")


def varied_prompts(path, n=64) -> str:
    """verl-schema jsonl with prompts of very different lengths, so balancing moves samples."""
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(["and then add one more"] * (1 + (i * 7) % 9))
            row = {"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"Start at {i} {words}."}],
                   "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)},
                   "extra_info": {"index": i}}
            f.write(json.dumps(row) + "\n")
    return str(path)


def merged(*layers: dict) -> dict:
    """Spec sections merged one level deep, later layers winning."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def tiny_job_spec(tmp_path, name: str, reward: str = "distinct_chars", **sections) -> JobSpec:
    """2 workers x 1 thread, 4 prompts x 2 samples of at most 6 tokens, checkpoints under tmp_path/name."""
    doc = {
        "model": {"path": "tiny"},
        "data": {"train": {"path": varied_prompts(tmp_path / "train.jsonl")}, "trainBatchSize": 4,
                 "maxPromptLength": 96, "maxResponseLength": 6, "rewardFn": f"{REWARDS}:{reward}"},
        "rollout": {"n": 2, "temperature": 1.0},
        "actor": {"lr": 1e-3, "microBatchSize": 3},
        "critic": {"lr": 1e-3, "microBatchSize": 3},
        "cluster": {"numNodes": 2, "procsPerNode": 1, "device": "cpu"},
        "trainer": {"totalSteps": 2, "seed": 3, "logDir": str(tmp_path / name), "numThreads": 1},
        "checkpoint": {"dir": str(tmp_path / name / "ckpt")},
    }
    return parse_spec(merged(doc, sections))


def final_checkpoint(spec: JobSpec | str | Path) -> dict:
    """The last complete checkpoint as one state dict ("model", "optim", "critic", ...).

    ``spec``: the job's spec, or its checkpoint directory.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = spec.checkpoint.dir if isinstance(spec, JobSpec) else spec
    last = complete_checkpoints(root)[-1]
    out = last.parent / "final.pt"
    dcp_to_torch_save(str(last), str(out))
    return torch.load(out, weights_only=False)


def bit_identical(a: dict, b: dict) -> bool:
    """Whether two nested state dicts hold the same keys and bit-equal tensors (other leaves ==)."""
    flat_a, flat_b = _flatten(a), _flatten(b)
    return flat_a.keys() == flat_b.keys() and all(
        torch.equal(v, flat_b[k]) if isinstance(v, torch.Tensor) else v == flat_b[k] for k, v in flat_a.items())


def _flatten(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}/{key}").items()}
    return {prefix: tree}


def run_job(spec: JobSpec, name: str = "job", **kw) -> tuple[dict, list[dict]]:
    """(final checkpoint, metrics.jsonl records) of a local run."""
    launch_local(spec, name, progress=False, **kw)
    return final_checkpoint(spec), read_jsonl(f"{spec.trainer.log_dir}/metrics.jsonl")


def initial_params() -> dict[str, torch.Tensor]:
    """The tiny model's weights before training (what the reference model holds)."""
    from distflow.models import load_causal_lm, resolve_model
    from distflow.models import model_cache_dir

    return load_causal_lm(resolve_model("tiny", model_cache_dir())).state_dict()


def resized_by_hand(spec_doc: dict, tmp_path: Path, stops: list[tuple[int, int]]) -> Path:
    """A job resized by hand: ``spec_doc`` run locally, each size until its stop step (killed in the
    next step, as a lost node would be), then resumed at the next size; returns its log directory.

    ``stops``: (step, the size from the step after it) in order; ``spec_doc``'s own size first."""
    sizes = [spec_doc["cluster"]["numNodes"]] + [nodes for _, nodes in stops]
    ends = [step for step, _ in stops] + [None]
    for nodes, end in zip(sizes, ends, strict=True):
        doc = {**spec_doc, "cluster": {**spec_doc["cluster"], "numNodes": nodes},
               "trainer": {**spec_doc["trainer"], "logDir": str(tmp_path / "logs")},
               "checkpoint": {"dir": str(tmp_path / "checkpoints"), "saveEverySteps": 1, "keepLast": 2}}
        for section in ("template", "runPolicy"):  # the pods' and the operator's, not the run's
            doc.pop(section, None)
        spec = parse_spec(doc)
        if end is None:
            launch_local(spec, "by-hand", progress=False)
            continue
        import pytest  # here: the GPU check imports this module on a machine without pytest

        os.environ["DISTFLOW_INJECT_FAILURE_AT_STEP"] = str(end + 1)
        try:
            with pytest.raises(Exception, match="injected failure"):
                launch_local(spec, "by-hand", progress=False)
        finally:
            del os.environ["DISTFLOW_INJECT_FAILURE_AT_STEP"]
    return tmp_path / "logs"
