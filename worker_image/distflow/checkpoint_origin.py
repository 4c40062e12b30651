"""What a checkpoint was made from, recorded in it and compared before a run resumes from it.

A checkpoint holds the actor's (and critic's) weights and optimizer state for
one model. Resuming it under another model fails deep in the loader with a
tensor size mismatch; resuming a ppo checkpoint without a critic (or the
reverse) finds state it cannot place. So each checkpoint's ``trainer.json``
records ``made_from``: the model source, its shape (from the model's
``config.json``) and whether a critic is trained, and the launchers compare
it with the run's before any worker starts. Checkpoints written before this
record existed are not checked.
"""

from __future__ import annotations

import json
from pathlib import Path

from distflow.errors import DistflowConfigError
from distflow.spec import JobSpec

SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""The model config entries that decide every tensor's shape in a checkpoint."""


def made_from(spec: JobSpec, model_dir: str | Path | None) -> dict:
    """The settings a checkpoint of ``spec`` can only be resumed under.

    Args:
        model_dir: the resolved model directory; its ``config.json`` gives the shape (omitted
            when there is none, e.g. a model built in memory).
    """
    from distflow.planner import build_plan

    record = {"model.path": spec.model.path,
              "critic": any(node.role == "critic" for node in build_plan(spec).chain)}
    config = Path(model_dir) / "config.json" if model_dir else None
    if config is not None and config.is_file():
        values = json.loads(config.read_text())
        record["model shape"] = {key: values[key] for key in SHAPE_KEYS if key in values}
    return record


def resume_problems(recorded: dict, current: dict) -> list[str]:
    """``setting: the checkpoint was made with X, this run has Y`` for each setting that differs.

    A setting only one side records (an older checkpoint) is not compared.
    """
    return [f"{key}: the checkpoint was made with {recorded[key]!r}, this run has {current[key]!r}"
            for key in current if key in recorded and recorded[key] != current[key]]


def check_resume(spec: JobSpec, model_dir: str | Path | None) -> None:
    """Before a run resumes: its newest complete checkpoint was made from what this run trains.

    Raises:
        DistflowConfigError: naming ``checkpoint.dir``, each setting that changed, and the ways out
            (put the setting back, ``--no-resume``, or another ``checkpoint.dir``).
    """
    if not spec.checkpoint.dir or spec.checkpoint.resume != "auto":
        return
    from distflow.checkpoint import newest_trainer_state

    found = newest_trainer_state(spec.checkpoint.dir)
    if found is None or "made_from" not in found[1]:
        return
    location, meta = found
    if problems := resume_problems(meta["made_from"], made_from(spec, model_dir)):
        raise DistflowConfigError(
            f"spec.checkpoint.dir: the step-{meta['step']} checkpoint at {location} cannot resume this run: "
            + "; ".join(problems) + ". Put the setting back to continue that run, or start over: "
            "distflow run --no-resume (moves the old run aside) or another checkpoint.dir")
