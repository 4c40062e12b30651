"""Step buffers: this step's data, and the node-local shared-memory buffer.

``StepBuffer`` holds the step's data; ``swap()`` at a step boundary only
moves a reference and hands the finished step to a background thread, so
freeing (possibly GBs of tensors) never stalls a step.

``NodeBuffer`` lets workers of one node hand tensors to each other through
files in shared memory (``/dev/shm``) instead of sending them: the sender
writes the bytes once into a mapped file, the receiver maps the same pages
and unlinks the name. Cross-node pieces still go over the network
(``distflow.data.exchange``).

Deliberately simplified: the node buffer keys pieces by (step, edge, src,
dst) file names and signals readiness by an atomic rename; there is no
daemon process and no memory cap.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import tempfile
import threading
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any, Hashable, Mapping

import torch

_STOP = object()


class _Releaser:
    """One daemon thread that drops the references it is handed."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, obj: Any) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="distflow-release", daemon=True)
                self._thread.start()
        self._queue.put(obj)

    def drain(self) -> None:
        """Block until everything submitted so far is released."""
        self._queue.join()

    def stop(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            thread.join()

    def _run(self) -> None:
        while True:
            obj = self._queue.get()
            stop = obj is _STOP
            # dropping the last reference here, not in the caller, is the point
            obj = None
            self._queue.task_done()
            if stop:
                return


class StepBuffer:
    """This step's data; ``swap()`` at a step boundary frees it off the training loop.

    ``put``/``get`` work on the current step's entries. ``swap()`` hands the
    whole step to a background thread, which drops it (possibly GBs of
    tensors, and their pages returned to the OS), and starts an empty step.
    ``swap`` is O(1): it never iterates or touches the entries, so freeing
    overlaps the next step's rollout instead of stalling the step boundary.
    """

    def __init__(self) -> None:
        self._current: dict[Hashable, Any] = {}
        self._releaser = _Releaser()

    @property
    def current(self) -> Mapping[Hashable, Any]:
        """Read-only view of this step's entries."""
        return MappingProxyType(self._current)

    def put(self, key: Hashable, value: Any) -> None:
        self._current[key] = value

    def get(self, key: Hashable) -> Any:
        """The entry ``key`` of this step.

        Raises:
            KeyError: if absent.
        """
        try:
            return self._current[key]
        except KeyError:
            raise KeyError(f"{key!r} is not in this step's buffer") from None

    def swap(self) -> None:
        """Step boundary: this step's entries freed in the background, an empty step started."""
        released, self._current = self._current, {}
        self._releaser.submit(released)

    def drain(self) -> None:
        """Wait until every released step has been freed (tests, shutdown)."""
        self._releaser.drain()

    def close(self) -> None:
        """Release the current step and stop the background thread."""
        self._releaser.submit(self._current)
        self._current = {}
        self._releaser.drain()
        self._releaser.stop()


def default_shm_root() -> Path:
    """``/dev/shm`` when writable (RAM-backed), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


class NodeBuffer:
    """One node's shared-memory hand-over area, ``<root>/distflow-<job_id>-node<node_rank>``.

    Every process of the node constructs its own ``NodeBuffer`` with the same
    ``job_id`` and ``node_rank``; they meet in the same directory.

    Args:
        job_id: unique per run, so two jobs on one host never collide.
        node_rank: this node's index.
        root: parent directory (default ``default_shm_root()``).
        timeout_s: how long ``take`` waits for a piece, in seconds.
    """

    def __init__(self, job_id: str, node_rank: int, root: str | os.PathLike | None = None,
                 timeout_s: float = 600.0) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", job_id):
            raise ValueError(f"job_id {job_id!r} must match [A-Za-z0-9_.-]+ (it names a directory)")
        base = Path(root) if root is not None else default_shm_root()
        self.directory = base / f"distflow-{job_id}-node{node_rank}"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s

    def path(self, step: int, edge: str, src_rank: int, dst_rank: int) -> Path:
        """File of one piece; the edge is sanitised and hashed so any name is safe."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", edge)[:40]
        tag = hashlib.sha1(edge.encode()).hexdigest()[:8]
        return self.directory / f"s{step}.{safe}-{tag}.{src_rank}-{dst_rank}"

    def reserve(self, step: int, edge: str, src_rank: int, dst_rank: int, nbytes: int) -> torch.Tensor:
        """[nbytes] uint8 tensor mapped onto a not-yet-visible file; fill it, then ``commit``.

        Raises:
            OSError: (ENOSPC) when shared memory cannot hold ``nbytes``; in a
                pod, mount a memory-backed emptyDir at /dev/shm.
        """
        if nbytes <= 0:
            raise ValueError(f"reserve: nbytes={nbytes}; only non-empty pieces go through the node buffer")
        tmp = self._tmp(self.path(step, edge, src_rank, dst_rank))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # allocate now: writing into a sparse mapping of a full /dev/shm
            # would kill the process with SIGBUS instead of raising
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        return torch.from_file(str(tmp), shared=True, size=nbytes, dtype=torch.uint8)

    def commit(self, step: int, edge: str, src_rank: int, dst_rank: int) -> None:
        """Make a reserved piece visible to ``take`` (atomic rename)."""
        final = self.path(step, edge, src_rank, dst_rank)
        os.replace(self._tmp(final), final)

    def publish(self, step: int, edge: str, src_rank: int, dst_rank: int, data: torch.Tensor) -> int:
        """Write a uint8 tensor for ``dst_rank`` (one copy). Returns its size in bytes.

        Raises:
            ValueError: if ``data`` is not a non-empty 1-D uint8 tensor.
        """
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError(f"publish: data must be [n] uint8 (view it with .view(torch.uint8)), "
                             f"got {tuple(data.shape)} {data.dtype}")
        self.reserve(step, edge, src_rank, dst_rank, data.numel()).copy_(data)
        self.commit(step, edge, src_rank, dst_rank)
        return data.numel()

    def take(self, step: int, edge: str, src_rank: int, dst_rank: int) -> torch.Tensor:
        """Map a published piece ([n] uint8, shared pages, no copy) and unlink its name.

        Waits (polling) up to ``timeout_s`` for the sender to commit.

        Raises:
            TimeoutError: naming the file and the sender, if it never appears.
        """
        path = self.path(step, edge, src_rank, dst_rank)
        deadline = time.monotonic() + self.timeout_s
        delay = 1e-4
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"node buffer: rank {src_rank} did not publish {path} "
                                   f"within {self.timeout_s} s (did it fail?)")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        data = torch.from_file(str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8)
        path.unlink()
        return data

    def cleanup_step(self, step: int) -> None:
        """Remove any piece of ``step`` left behind (e.g. after a failure)."""
        for leftover in self.directory.glob(f"s{step}.*"):
            leftover.unlink(missing_ok=True)

    def cleanup(self) -> None:
        """Remove the whole node directory at the end. Every worker of the node calls it (each
        closes on its own), so whichever comes second finds the files, or the directory, gone:
        even while listing it (pathlib checks the directory, then lists it)."""
        try:
            for leftover in self.directory.glob("*"):
                leftover.unlink(missing_ok=True)
            self.directory.rmdir()
        except FileNotFoundError:
            pass

    @staticmethod
    def _tmp(final: Path) -> Path:
        return final.with_name(final.name + ".tmp")
