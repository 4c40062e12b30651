"""Fault injection for the chaos tests: SIGKILL at the n-th event of a kind, on one rank.

``DISTFLOW_CHAOS="rank=1,event=optimizer,count=3,target=worker"`` makes rank
1 kill itself (``target=worker``) or its launcher (``target=launcher``; the
other workers then die by their parent-death signal) with SIGKILL at its 3rd
event of that kind. Events:

    forward      a forward call of the actor model (most of them are rollout generation)
    exchange     a torch.distributed all_to_all (a redistribution between DAG nodes)
    optimizer    an actor optimizer step (after the parameters changed, before anything is saved)
    checkpoint   a point inside ``checkpoint.save`` (shards written / manifest written / renamed)

A SIGKILL runs no handler and flushes nothing, so what survives is what a
``kill -9``, the OOM killer or a lost node would leave. Events are counted,
not timed, so a seeded trial hits the same moment on a loaded machine.

``DISTFLOW_CHAOS_TALLY=DIR`` writes each rank's event counts to
``DIR/tally_rank<r>.json`` at the end of a run: the chaos tests draw their
kill points from an uninterrupted run's tally. Unset (production), every
hook is a no-op and nothing is installed.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

EVENTS = ("forward", "exchange", "optimizer", "checkpoint")

_counts: Counter = Counter()
_plan: dict | None = None
_rank = -1


def parse(text: str) -> dict:
    """``"rank=1,event=forward,count=7,target=worker"`` -> dict.

    Raises:
        ValueError: an unknown key, event or target, or a count below 1.
    """
    out = {"rank": 0, "event": "forward", "count": 1, "target": "worker"}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in out:
            raise ValueError(f"DISTFLOW_CHAOS: unknown key {key!r}; keys are rank, event, count, target")
        out[key] = int(value) if key in ("rank", "count") else value
    if out["event"] not in EVENTS:
        raise ValueError(f"DISTFLOW_CHAOS: event {out['event']!r}; choose one of {', '.join(EVENTS)}")
    if out["target"] not in ("worker", "launcher"):
        raise ValueError(f"DISTFLOW_CHAOS: target {out['target']!r}; choose worker or launcher")
    if out["count"] < 1:
        raise ValueError("DISTFLOW_CHAOS: count must be >= 1")
    return out


def enabled() -> bool:
    return bool(os.environ.get("DISTFLOW_CHAOS") or os.environ.get("DISTFLOW_CHAOS_TALLY"))


def install(worker) -> None:
    """Count ``worker``'s events (and arm the kill if it is the chosen rank). No-op unless enabled."""
    global _plan, _rank
    if not enabled():
        return
    import torch.distributed as dist

    _rank = worker.rank
    raw = os.environ.get("DISTFLOW_CHAOS")
    _plan = parse(raw) if raw else None
    if worker.actor is not None:
        worker.actor.model.register_forward_pre_hook(lambda *_: hit("forward"))
        worker.actor.optimizer.register_step_post_hook(lambda *_: hit("optimizer"))
    else:  # a rollout pool worker (distflow.pools): its replica's forwards are generation steps
        worker.replica.register_forward_pre_hook(lambda *_: hit("forward"))
    for name in ("all_to_all", "all_to_all_single"):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            hit("exchange")
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def hit(event: str) -> None:
    """One event of this kind on this rank; SIGKILL if it is the planned one."""
    if _rank < 0:
        return
    _counts[event] += 1
    plan = _plan
    if plan and plan["rank"] == _rank and plan["event"] == event and plan["count"] == _counts[event]:
        victim = os.getppid() if plan["target"] == "launcher" else os.getpid()
        os.kill(victim, signal.SIGKILL)
        if victim != os.getpid():
            signal.pause()  # the parent-death signal ends this worker; it must not run on meanwhile


def write_tally() -> None:
    """Write this rank's event counts where ``DISTFLOW_CHAOS_TALLY`` says (no-op when unset)."""
    out = os.environ.get("DISTFLOW_CHAOS_TALLY")
    if out and _rank >= 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"tally_rank{_rank}.json").write_text(json.dumps(dict(_counts)))
