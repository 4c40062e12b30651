"""Checkpoints: model, optimizer, RNG, dataloader state and step; complete only once verified.

Layout under ``checkpoint.dir`` (a local path, e.g. a PVC, or an fsspec URL such as ``s3://bucket/run``)::

    step_00000012/           complete checkpoint: its manifest.json lists every file
        .metadata, *.distcp  torch.distributed.checkpoint shards (actor, and critic if any: model + optimizer)
        rank_00000.pt        per-rank RNG state
        trainer.json         step, dataloader state (global), world size, in-reward KL coefficient, what
                             it was made from (distflow.checkpoint_origin: compared before a resume), and
                             the steps a rollout pool had generated past it (in_flight_steps; distflow.pools)
        manifest.json        written last: size and sha256 of each file above
    step_00000016.tmp/       being written (local storage); ignored by resume, removed by the next save

Write: every rank writes its shards (fsynced), then the ranks read every
file back and hash it, each a share of the bytes (``hash_shares``), and rank 0
writes trainer.json, the manifest last, and (on a local filesystem) renames
``.tmp`` into place; older checkpoints are pruned after the commit. An object store has no atomic
rename; there the shards go to ``step_N/`` directly and the manifest, one
atomic PUT, is the commit. Either way a crash at any point leaves the
previous complete checkpoint as it was.

Read: rank 0 checks the newest candidate against its manifest (sizes and
checksums, the ranks hashing a share each); a torn, partial or corrupt one is
skipped with a message and the previous one is tried (``choose``). Every rank then loads the chosen one
(``load``), after checking that it holds every parameter of the models it
fills at their shapes: a resumed worker builds its actor and critic without
reading the pretrained weights, so the checkpoint must fill them all. The model and
optimizer are resharded by torch.distributed.checkpoint, so a checkpoint
written by N workers loads on M; the dataloader state is global (see
``distflow.data.loader``). Per-rank RNG state is restored only at the same
world size; what the run samples does not depend on it across sizes:
rollout sampling is seeded per global sample (``distflow.engines.rollout``).
A separate rollout copy (``rollout.shareActorWeights: false``) is not saved:
it is re-synced from the actor on load; the reference model is the initial
weights.
"""

from __future__ import annotations

import errno
import shutil
import hashlib
import io
import json
import os
import pickle
import random
import re
from pathlib import Path

import fsspec
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from distflow import chaos
from distflow.engines import fsdp

PREFIX = "step_"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(rf"^{PREFIX}(\d{{8}})(\.tmp)?$")


class CheckpointError(RuntimeError):
    """Writing a checkpoint failed (disk full, storage unreachable); the previous one is intact."""


class UnusableCheckpointError(RuntimeError):
    """The checkpoint chosen for resume lacks a parameter of the models it must fill, or holds
    it at another shape (made from another model or workflow)."""


class _Store:
    """The checkpoint root on its filesystem (local or fsspec URL); names are relative to it."""

    def __init__(self, root: str | os.PathLike):
        self.url = str(root).rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, *names: str) -> str:
        return "/".join([self.root, *names])

    def location(self, name: str) -> str:
        """What torch.distributed.checkpoint is given: a local path or the URL."""
        return self.path(name) if self.local else f"{self.url}/{name}"

    def step_dirs(self) -> dict[str, int]:
        """``{name: step}`` of every ``step_*`` directory, complete or not."""
        self.fs.invalidate_cache()  # other processes write here; an object store's listing is cached
        if not self.fs.exists(self.root):
            return {}
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))
        return {n: int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))}

    def remove(self, name: str) -> None:
        if self.fs.exists(self.path(name)):
            self.fs.rm(self.path(name), recursive=True)

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.fs.open(self.path(name), "wb") as f:
            f.write(data)
            if self.local:
                f.flush()
                os.fsync(f.fileno())


def _sha256(fs, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _file_sizes(store: _Store, name: str) -> dict[str, int]:
    """Size (bytes) of every file of ``name`` but its manifest, by path relative to ``name``."""
    base = store.path(name)
    sizes = {}
    for path, info in sorted(store.fs.find(base, detail=True).items()):
        rel = path[len(base.rstrip("/")) + 1:]
        if rel != MANIFEST:
            sizes[rel] = int(info["size"])
    return sizes


def _build_manifest(store: _Store, name: str, step: int, digests: dict[str, str] | None = None) -> dict:
    """Sizes (bytes) and sha256 of every file of ``name``, read back from storage; ``digests``
    gives the sha256 of files already read back and hashed (``_hash_together``)."""
    digests = digests or {}
    return {"format": 1, "step": step, "files": {
        rel: {"size": size, "sha256": digests.get(rel) or _sha256(store.fs, store.path(name, rel))}
        for rel, size in _file_sizes(store, name).items()}}


def hash_shares(sizes: dict[str, int], num_ranks: int) -> list[list[str]]:
    """The files each of ``num_ranks`` ranks reads back and hashes: the largest first, each to the
    rank with the fewest bytes so far (ties: the lower rank). Pure; every rank computes the same.

    Args:
        sizes: file name -> size in bytes.
    """
    loads, shares = [0] * num_ranks, [[] for _ in range(num_ranks)]
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        shares[rank].append(rel)
        loads[rank] += sizes[rel]
    return shares


def _digests_together(store: _Store, name: str, sizes: dict[str, int]) -> tuple[dict[str, str], str | None]:
    """Collective: (file -> sha256 of the files of ``name`` that ``sizes`` lists, read back from
    storage, each rank hashing its ``hash_shares`` share; the first rank's read error, or None),
    the same on every rank."""
    digests, error, rel = {}, None, ""
    try:
        for rel in hash_shares(sizes, dist.get_world_size())[dist.get_rank()]:
            digests[rel] = _sha256(store.fs, store.path(name, rel))
    except OSError as err:
        error = f"{rel}: {err}"
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (digests, error))
    return {rel: sha for part, _ in parts for rel, sha in part.items()}, next((e for _, e in parts if e), None)


def _hash_together(store: _Store, name: str, step: int) -> tuple[dict[str, str], str | None]:
    """Collective: (file -> sha256 of every file of ``name`` now (``_digests_together``); the
    failure message, or None), the same on every rank."""
    listing: list = [None, None]
    if dist.get_rank() == 0:
        try:
            listing[0] = _file_sizes(store, name)
        except OSError as err:
            listing[1] = _failure_message(store, step, err)
    dist.broadcast_object_list(listing, src=0)
    sizes, error = listing
    if error is not None:
        return {}, error
    digests, error = _digests_together(store, name, sizes)
    return digests, None if error is None else _failure_message(store, step, error)


def verify(store: _Store, name: str, checksums: bool = True) -> str | None:
    """Why checkpoint ``name`` must not be loaded, or None when its manifest vouches for every file."""
    try:
        with store.fs.open(store.path(name, MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
        files = manifest["files"]
    except FileNotFoundError:
        return "no manifest (its write did not finish)"
    except (ValueError, KeyError, TypeError):
        return "its manifest is torn or unreadable"
    if "trainer.json" not in files or ".metadata" not in files:
        return "its manifest lacks trainer.json or .metadata"
    for rel, want in files.items():
        path = store.path(name, rel)
        if not store.fs.exists(path):
            return f"{rel} is missing"
        if store.fs.size(path) != want["size"]:
            return f"{rel} has {store.fs.size(path)} bytes, the manifest says {want['size']}"
        if checksums and _sha256(store.fs, path) != want["sha256"]:
            return f"{rel} does not match its sha256 in the manifest (corrupt)"
    return None


def complete_checkpoints(root: str | os.PathLike, checksums: bool = False) -> list[Path | str]:
    """Checkpoints whose manifest vouches for their files, oldest first (Paths for a local root, else URLs).

    ``checksums=False`` checks presence and sizes only (cheap); resume also checks the sha256s.
    """
    store = _Store(root)
    names = sorted(n for n in store.step_dirs() if not n.endswith(".tmp"))
    good = [n for n in names if verify(store, n, checksums) is None]
    return [Path(store.path(n)) if store.local else store.location(n) for n in good]


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _no_space_left(store: _Store) -> bool:
    """A local checkpoint volume with under 1 MiB free: torch's writers report a full disk as a short
    write ("unexpected pos ...") rather than ENOSPC."""
    try:
        return store.local and shutil.disk_usage(store.root).free < (1 << 20)
    except OSError:
        return False


def _failure_message(store: _Store, step: int, err: BaseException | str) -> str:
    text = str(err)
    full = (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left on device" in text \
        or _no_space_left(store)
    reason = "the disk is full (No space left on device)" if full else text.strip().splitlines()[-1][:300]
    done = sorted(s for n, s in store.step_dirs().items()
                  if not n.endswith(".tmp") and verify(store, n, checksums=False) is None)
    kept = f"the step-{done[-1]} checkpoint is intact" if done else "no earlier checkpoint exists"
    fix = ("free space on that volume or give checkpoint.dir a larger one (checkpoint.keepLast: 1 keeps "
           "fewer), then run again: it resumes from the last complete checkpoint") if full else \
        "check that checkpoint.dir is writable and reachable, then run again: it resumes from the last complete one"
    return f"checkpoint.dir {store.url}: writing the step-{step} checkpoint failed: {reason}; {kept}. Fix: {fix}."


def _agree(error: str | None) -> str | None:
    """The first rank's error, on every rank (so no rank waits in a collective for one that gave up)."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def save(root: str | os.PathLike, step: int, worker, keep_last: int) -> str:
    """Collective: every rank calls it. Returns the checkpoint's location.

    Raises:
        CheckpointError: on every rank, when any rank could not write its part
            (disk full, storage error); the partial directory is removed and
            the previous checkpoint is left as it was.
    """
    store = _Store(root)
    final = f"{PREFIX}{step:08d}"
    work = final + ".tmp" if store.local else final
    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            for name in store.step_dirs():  # partial writes of a killed run; never a complete checkpoint
                if name.endswith(".tmp") or name == final or verify(store, name, checksums=False):
                    store.remove(name)
            store.fs.makedirs(store.path(work), exist_ok=True)
        except OSError as err:
            error = _failure_message(store, step, err)
    error = _agree(error)
    if error is None:
        try:
            if _trains(worker):  # a rollout pool (distflow.pools) holds no trained state
                dcp.save(_train_state(worker), checkpoint_id=store.location(work),
                         process_group=getattr(worker, "train_group", None))
            rng = io.BytesIO()
            torch.save({"rng": _rng_state()}, rng)
            store.write_bytes(f"{work}/rank_{rank:05d}.pt", rng.getvalue())
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - every rank must reach _agree
            # (torch's CheckpointException, which carries every rank's error, is a BaseException)
            error = _failure_message(store, step, err)
        chaos.hit("checkpoint")
        error = _agree(error)
    digests: dict[str, str] = {}
    if error is None:
        digests, error = _hash_together(store, work, step)
    if error is None and rank == 0:
        error = _commit(store, work, final, step, worker, digests)
    error = _agree(error if rank == 0 else None)
    if error is not None:
        if rank == 0:
            _remove_quietly(store, work)
        raise CheckpointError(error)
    if rank == 0:  # after the agreement: the other ranks need not wait for the deletes
        _prune(store, keep_last)
    return store.location(final)


def _commit(store: _Store, work: str, final: str, step: int, worker, digests: dict[str, str]) -> str | None:
    """Rank 0: trainer.json, the manifest (last; ``digests`` holds the other files' sha256), the
    rename. Returns an error message or None."""
    try:
        meta = {"step": step, "loader": worker.loader.state_dict(), "world_size": dist.get_world_size(),
                "kl_ctrl": worker.kl_ctrl.state_dict(), "made_from": worker.made_from,
                "in_flight_steps": worker.in_flight_steps(step) if hasattr(worker, "in_flight_steps") else 0}
        store.write_bytes(f"{work}/trainer.json", json.dumps(meta).encode())
        manifest = _build_manifest(store, work, step, digests)
        store.write_bytes(f"{work}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        chaos.hit("checkpoint")
        if work != final:
            os.rename(store.path(work), store.path(final))  # atomic; fails rather than nest into a leftover
            _fsync_dir(store)
        chaos.hit("checkpoint")
    except OSError as err:
        return _failure_message(store, step, err)
    return None


def _prune(store: _Store, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints (>= 1: the newest complete one always stays)."""
    complete = sorted((s, n) for n, s in store.step_dirs().items()
                      if not n.endswith(".tmp") and verify(store, n, checksums=False) is None)
    for _, name in complete[:-max(1, keep_last)]:
        _remove_quietly(store, name)


def _remove_quietly(store: _Store, name: str) -> None:
    try:
        store.remove(name)
    except OSError:
        pass  # a leftover is ignored by resume and removed by the next save


def _fsync_dir(store: _Store) -> None:
    """Make the rename durable (local filesystems; an object store's PUT already is)."""
    fd = os.open(store.root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _trains(worker) -> bool:
    """Whether ``worker`` holds trained state: every worker in sync mode; the trainer pool's
    (``distflow.pools``), whose rollout pool has only its replicas, refilled from the trainers."""
    return getattr(worker, "trains", True)


def _train_state(worker) -> dict:
    """The state dicts torch.distributed.checkpoint saves and reshards: actor, and critic when trained (ppo).

    Saves the sharded parameters: full ones an evaluation left gathered
    (``actor.reshardAfterForward: false``) are released first."""
    fsdp.release_unsharded(worker.actor.model)
    model_sd, optim_sd = get_state_dict(worker.actor.model, worker.actor.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if worker.critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(worker.critic.model, worker.critic.optimizer)
    return state


def _checksum_problem(store: _Store, name: str) -> str | None:
    """Collective, after rank 0's cheap :func:`verify` of ``name`` (broadcast): why its files do not
    match the manifest's sha256 (the ranks hash a share each), or None; the same on every rank."""
    head: list = [None, None]
    if dist.get_rank() == 0:
        head[0] = verify(store, name, checksums=False)
        if head[0] is None:
            with store.fs.open(store.path(name, MANIFEST), "rb") as f:
                head[1] = json.loads(f.read())["files"]
    dist.broadcast_object_list(head, src=0)
    reason, files = head
    if reason is not None:
        return reason
    digests, error = _digests_together(store, name, {rel: want["size"] for rel, want in files.items()})
    if error is not None:
        return f"it could not be read back ({error})"
    return next((f"{rel} does not match its sha256 in the manifest (corrupt)"
                 for rel, want in files.items() if digests[rel] != want["sha256"]), None)


def newest_trainer_state(root: str | os.PathLike) -> tuple[str, dict] | None:
    """(location, trainer.json) of the newest complete checkpoint (sizes checked, not checksums);
    None when there is none."""
    store = _Store(root)
    if (name := _newest_complete(store)) is None:
        return None
    return store.location(name), trainer_state(root, name)


def trainer_state(root: str | os.PathLike, name: str) -> dict:
    """trainer.json of checkpoint ``name`` (``step_N``, e.g. from :func:`choose`).

    Raises:
        OSError: it cannot be read.
    """
    store = _Store(root)
    with store.fs.open(store.path(name, "trainer.json"), "rb") as f:
        return json.loads(f.read())


def _newest_complete(store: _Store) -> str | None:
    """The newest checkpoint whose manifest vouches for its files' sizes (not checksums), or None."""
    for name in sorted((n for n in store.step_dirs() if not n.endswith(".tmp")), reverse=True):
        if verify(store, name, checksums=False) is None:
            return name
    return None


def finished(root: str | os.PathLike, total_steps: int) -> tuple[str, int] | None:
    """(location, step) of the newest complete checkpoint when its step is ``total_steps`` or more
    and its checksums match its manifest: the run it belongs to has nothing left to train. None
    otherwise (no checkpoint, steps left, or a newest one a resume would skip as corrupt)."""
    store = _Store(root)
    if (name := _newest_complete(store)) is None:
        return None
    step = int(_STEP_DIR.match(name).group(1))
    return (store.location(name), step) if step >= total_steps and verify(store, name) is None else None


def choose(root: str | os.PathLike) -> str | None:
    """Collective: the name (``step_N``) of the newest checkpoint that passes :func:`verify` with
    checksums, the same on every rank; None when there is none. Rank 0 says which ones it
    skipped and why; the ranks read back and hash a share of each candidate's bytes."""
    store = _Store(root)
    names = [sorted((n for n in store.step_dirs() if not n.endswith(".tmp")), reverse=True)
             if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    for i, name in enumerate(names[0]):
        reason = _checksum_problem(store, name)
        if reason is None:
            return name
        if dist.get_rank() == 0:
            then = ("trying the previous one" if i + 1 < len(names[0])
                    else "no other checkpoint is left: training starts from step 0")
            print(f"distflow: skipping checkpoint {store.location(name)}: {reason}; {then}", flush=True)
    return None


def load_latest(root: str | os.PathLike, worker) -> int:
    """Collective: restore the newest verified checkpoint into ``worker``; the step to continue from.

    Returns 0 when there is none. Raises as :func:`load`.
    """
    return load(root, choose(root), worker)


def load(root: str | os.PathLike, name: str | None, worker) -> int:
    """Collective: restore checkpoint ``name`` (from :func:`choose`) into ``worker``; its step.

    Returns 0 when ``name`` is None. The actor's (and critic's) parameters are all written:
    ``worker`` may have built them uninitialised.

    Raises:
        UnusableCheckpointError: on every rank, naming the checkpoint, when it lacks a parameter
            of the actor or critic or holds one at another shape (nothing is loaded).
    """
    if name is None:
        return 0
    store = _Store(root)
    meta = trainer_state(root, name)
    if _trains(worker):
        state = _train_state(worker)
        problems = _unfilled(store, name, state, worker)
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise UnusableCheckpointError(
                f"checkpoint {store.location(name)} cannot resume this run: {'; '.join(problems[:5])}{more}. "
                "It was made from another model or workflow; resume it under those, or start over: "
                "distflow run --no-resume (moves the old run aside) or another checkpoint.dir")
        dcp.load(state, checkpoint_id=store.location(name), process_group=getattr(worker, "train_group", None))
        set_state_dict(worker.actor.model, worker.actor.optimizer,
                       model_state_dict=state["model"], optim_state_dict=state["optim"])
    if worker.critic is not None:
        set_state_dict(worker.critic.model, worker.critic.optimizer,
                       model_state_dict=state["critic"], optim_state_dict=state["critic_optim"])
    if "kl_ctrl" in meta:
        worker.kl_ctrl.load_state_dict(meta["kl_ctrl"])
    worker.loader.load_state_dict(meta["loader"])
    saved_world = meta.get("world_size")
    if saved_world == dist.get_world_size():
        with store.fs.open(store.path(name, f"rank_{dist.get_rank():05d}.pt"), "rb") as f:
            _set_rng_state(torch.load(f, weights_only=False)["rng"])
    elif dist.get_rank() == 0:
        print(f"distflow: the step-{meta['step']} checkpoint was written by {saved_world} workers and is "
              f"resharded onto {dist.get_world_size()}; the data stream continues at {meta['loader']}",
              flush=True)
    if worker.actor is not None:  # a rollout pool's replicas get the weights from the trainer pool's sync
        worker.rollout.sync(worker.actor.model)
    return int(meta["step"])


def _unfilled(store: _Store, name: str, state: dict, worker) -> list[str]:
    """Why loading ``name`` into ``state`` (``_train_state``) would leave a parameter of the actor
    or critic unwritten: one line per parameter that no loaded entry holds, that the checkpoint
    lacks, or that it holds at another (global) shape. Empty: the load writes every parameter."""
    with store.fs.open(store.path(name, ".metadata"), "rb") as f:
        saved = pickle.load(f).state_dict_metadata  # as torch.distributed.checkpoint's reader does
    problems = []
    models = {"model": worker.actor.model, "critic": worker.critic.model if worker.critic is not None else None}
    for part, model in models.items():
        if model is None:
            continue
        loaded = state[part]
        problems += [f"{part} parameter {n} is not in the state loaded"
                     for n, _ in model.named_parameters() if n not in loaded]
        for key, tensor in loaded.items():
            entry = saved.get(f"{part}.{key}")
            if entry is None:
                problems.append(f"it lacks {part}.{key}")
            elif tuple(entry.size) != tuple(tensor.shape):
                problems.append(f"{part}.{key} is {tuple(entry.size)} in it, {tuple(tensor.shape)} in this run")
    return problems
