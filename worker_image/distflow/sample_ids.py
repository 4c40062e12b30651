"""Which prompts each step trained on: ``<trainer.logDir>/trained_ids.jsonl``, one line per step.

    {"step": 3, "ids": [5, 5, 12, 12, 40, 40, 61, 61]}   dataset record indices, one per sample, sorted

The ids are those of the samples in the batch after the last DAG node (what
the actor, or the critic, trained on), gathered from every rank. A resumed
run drops the lines a killed run wrote past its checkpoint, so each step is
logged once; the chaos tests compare these lines with an uninterrupted run's
(no sample lost, none trained twice).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch.distributed as dist

FILE = "trained_ids.jsonl"


def record_ids(group_index: list[int], step: int, batch_size: int, total_steps: int,
               rounds: list[np.ndarray]) -> list[int]:
    """Dataset record index of each sample.

    ``group_index`` [B]: round ``k`` of step ``s`` numbers its prompts from
    ``(s + k * total_steps) * batch_size`` (``stages.run_rollout``; refill
    rounds: ``stages.group_filter._refill_round``); ``rounds[k]`` [batch_size] are
    that round's records in order (``ShardedPromptLoader.take_read_batches``).
    """
    out = []
    for g in group_index:
        round_index = (g // batch_size - step) // total_steps
        out.append(int(rounds[round_index][g - (step + round_index * total_steps) * batch_size]))
    return out


def gather(ids: list[int]) -> list[int]:
    """Every rank's ids, sorted (collective)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, ids)
    return sorted(i for part in parts for i in part)


def append(log_dir: str | Path, step: int, ids: list[int], extra: dict | None = None) -> None:
    """One step's line; ``extra`` adds keys (asynchronous mode: each sample's ``policy_versions``)."""
    path = Path(log_dir) / FILE
    with path.open("a") as f:
        f.write(json.dumps({"step": step, "ids": ids, **(extra or {})}) + "\n")


def drop_after(log_dir: str | Path, step: int) -> None:
    """Resuming at ``step``: forget the lines of later steps (they are about to run again); atomic."""
    path = Path(log_dir) / FILE
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(FILE + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def read(log_dir: str | Path) -> dict[int, list[int]]:
    """``{step: ids}`` of a run's log."""
    path = Path(log_dir) / FILE
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {rec["step"]: rec["ids"] for rec in lines}
