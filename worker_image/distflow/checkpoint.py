"""Checkpoints: model, optimizer, RNG, dataloader state and step, written atomically.

Layout under ``checkpoint.dir``::

    step_00000012/           complete checkpoint (renamed into place last)
        .metadata, *.distcp  torch.distributed.checkpoint shards (actor, and critic if any: model + optimizer)
        rank_00000.pt        per-rank RNG state
        trainer.json         step, dataloader state (global), world size, in-reward KL coefficient
    step_00000016.tmp/       being written; ignored by resume, removed by the next save

Every rank writes its shards into the ``.tmp`` directory, a barrier follows,
then rank 0 renames it. A crash at any point leaves either the old or the new
checkpoint complete. A separate rollout copy
(``rollout.shareActorWeights: false``) is not saved: it is re-synced from the
actor on load; the reference model is the initial weights.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

PREFIX = "step_"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".tmp")
                  and (p / "trainer.json").is_file())


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save(root: str | Path, step: int, worker, keep_last: int) -> Path:
    """Collective: every rank calls it. Returns the final directory."""
    root = Path(root)
    final = _step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(worker.actor.model, worker.actor.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, **_critic_state(worker)}, checkpoint_id=str(tmp))
    torch.save({"rng": _rng_state()}, tmp / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        meta = {"step": step, "loader": worker.loader.state_dict(), "world_size": dist.get_world_size(),
                "kl_ctrl": worker.kl_ctrl.state_dict()}
        (tmp / "trainer.json").write_text(json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _critic_state(worker) -> dict:
    """The critic's model and optimizer state dicts, when the workflow trains one (ppo)."""
    if worker.critic is None:
        return {}
    model_sd, optim_sd = get_state_dict(worker.critic.model, worker.critic.optimizer)
    return {"critic": model_sd, "critic_optim": optim_sd}


def load_latest(root: str | Path, worker) -> int:
    """Collective: restore the latest complete checkpoint into ``worker``; the step to continue from.

    Returns 0 when there is none.
    """
    found = complete_checkpoints(root)
    if not found:
        return 0
    path = found[-1]
    meta = json.loads((path / "trainer.json").read_text())
    model_sd, optim_sd = get_state_dict(worker.actor.model, worker.actor.optimizer)
    state = {"model": model_sd, "optim": optim_sd, **_critic_state(worker)}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(worker.actor.model, worker.actor.optimizer,
                   model_state_dict=state["model"], optim_state_dict=state["optim"])
    if worker.critic is not None:
        set_state_dict(worker.critic.model, worker.critic.optimizer,
                       model_state_dict=state["critic"], optim_state_dict=state["critic_optim"])
    if "kl_ctrl" in meta:
        worker.kl_ctrl.load_state_dict(meta["kl_ctrl"])
    worker.loader.load_state_dict(meta["loader"])
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    if rank_file.is_file() and meta.get("world_size") == dist.get_world_size():
        _set_rng_state(torch.load(rank_file, weights_only=False)["rng"])
    worker.rollout.sync(worker.actor_model)
    return int(meta["step"])
