"""Run a function on N gloo ranks in fresh processes and return each rank's result.

``run_on_ranks(fn, world_size, *args)`` spawns ``world_size`` processes,
initialises a gloo process group over a free localhost TCP port, calls
``fn(rank, world_size, *args)`` in each, and returns the results in rank
order. Results travel back through ``torch.save`` files (tensors included);
a worker's exception is re-raised in the parent with the worker's traceback.

``fn`` must be importable by name (a module-level function of a test module
or of this file), since the processes are spawned, not forked.
"""

from __future__ import annotations

import os
import queue
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple,
            result_dir: str, status: Any) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
        status.put((rank, None))
    except BaseException:  # report everything, including KeyboardInterrupt in the child
        status.put((rank, traceback.format_exc()))


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
                 daemon: bool = True) -> list[Any]:
    """``[fn(0, N, *args), ..., fn(N-1, N, *args)]``, each run in its own gloo rank.

    ``daemon=False`` lets a rank start processes of its own (a daemonic process may not), e.g. a
    vLLM engine core; the ranks are killed all the same when they fail or time out.

    Raises:
        RuntimeError: with the worker's traceback if any rank raised, died
            without reporting, or did not finish within ``timeout_s`` seconds.
    """
    ctx = mp.get_context("spawn")
    status = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="distflow-spawn-") as result_dir:
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, result_dir, status),
                             daemon=daemon) for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            failures = _collect(procs, status, world_size, timeout_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        if failures:
            raise RuntimeError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(failures.items())))
        return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


def _collect(procs, status, world_size: int, timeout_s: float, grace_s: float = 5.0) -> dict[int, str]:
    """Wait for every rank's report; returns rank -> traceback for the failures.

    After the first failure, waits ``grace_s`` more for the other ranks'
    reports (the first one to report is often a victim, not the cause); ranks
    still running are then likely stuck in a collective and get killed.
    """
    reported: dict[int, str | None] = {}
    deadline = time.monotonic() + timeout_s
    while len(reported) < world_size and time.monotonic() < deadline:
        try:
            rank, error = status.get(timeout=0.5)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in reported and p.exitcode not in (None, 0):
                    reported[r] = f"process exited with code {p.exitcode} without reporting"
                    deadline = min(deadline, time.monotonic() + grace_s)
            continue
        reported[rank] = error
        if error is not None:
            deadline = min(deadline, time.monotonic() + grace_s)
    failures = {r: tb for r, tb in reported.items() if tb is not None}
    if not failures and len(reported) < world_size:
        missing = sorted(set(range(world_size)) - set(reported))
        failures = {r: f"no result after {timeout_s} s (hung?)" for r in missing}
    return failures
