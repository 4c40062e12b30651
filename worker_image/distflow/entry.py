"""A worker process's entry point: the DAG worker of sync mode, or of a pooled job (``async.enable``).

Its own module so that ``distflow.worker`` (``DagWorker``) and ``distflow.pools.worker``
(``PoolWorker``, a subclass) do not import each other.
"""

from __future__ import annotations

from distflow import gang_resize
from distflow.pools.worker import PoolWorker
from distflow.resize import EXIT_LEFT_POOL, EXIT_RESIZE
from distflow.spec import JobSpec
from distflow.malloc import configure_malloc
from distflow.worker import DagWorker, WorkerEnv


def run_worker(spec: JobSpec, env: WorkerEnv, progress=None) -> list[dict[str, float]]:
    """Entry point of one worker process.

    Raises:
        SystemExit: with ``EXIT_RESIZE`` once the workers stopped for a resize (every rank, after its
            clean close: the checkpoint is complete); the launcher turns it into ``StoppedForResize``;
            with ``EXIT_LEFT_POOL`` on a rank that left its rollout pool or its gang in an in-place
            shrink (``distflow.pools.elastic``, ``distflow.gang_resize``).
    """
    configure_malloc()
    kind = PoolWorker if spec.async_.enable else DagWorker
    if env.join and not spec.async_.enable:  # joins a running gang (a rollout pool's joiner joins later)
        env = gang_resize.join(spec, env)
        if env is None:  # the gang finished first
            return []
    worker, history = kind(spec, env), []
    while True:
        try:
            history += worker.train(progress)
        except BaseException:
            worker.close(clean=False)
            raise
        if worker.reform_to is None:
            break
        spec, env = gang_resize.reform(worker)  # the gang resized in place: the same process goes on
        worker = None  # its models freed before the next are built
        gang_resize.collect()
        worker = kind(spec, env)
    worker.close()
    if worker.left_pool:
        raise SystemExit(EXIT_LEFT_POOL)
    if worker.stopped_for_resize:
        raise SystemExit(EXIT_RESIZE)
    return history
