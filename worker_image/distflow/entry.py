"""A worker process's entry point: the DAG worker of sync mode, or of a pooled job (``async.enable``).

Its own module so that ``distflow.worker`` (``DagWorker``) and ``distflow.pools.worker``
(``PoolWorker``, a subclass) do not import each other.
"""

from __future__ import annotations

from distflow.pools.worker import PoolWorker
from distflow.resize import EXIT_LEFT_POOL, EXIT_RESIZE
from distflow.spec import JobSpec
from distflow.worker import DagWorker, WorkerEnv, configure_malloc


def run_worker(spec: JobSpec, env: WorkerEnv, progress=None) -> list[dict[str, float]]:
    """Entry point of one worker process.

    Raises:
        SystemExit: with ``EXIT_RESIZE`` once the workers stopped for a resize (every rank, after its
            clean close: the checkpoint is complete); the launcher turns it into ``StoppedForResize``;
            with ``EXIT_LEFT_POOL`` on a rollout rank that left its pool in an in-place shrink.
    """
    configure_malloc()
    worker = (PoolWorker if spec.async_.enable else DagWorker)(spec, env)
    try:
        history = worker.train(progress)
    except BaseException:
        worker.close(clean=False)
        raise
    worker.close()
    if worker.left_pool:
        raise SystemExit(EXIT_LEFT_POOL)
    if worker.stopped_for_resize:
        raise SystemExit(EXIT_RESIZE)
    return history

