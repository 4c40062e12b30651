"""Running every sample's tool calls of a turn at once, each within a timeout.

Each call runs in a daemon thread, at most ``max_workers`` at a time; the
caller waits for a call at most ``timeout`` seconds past its start. A call
still running then is abandoned (its thread cannot be killed; being a daemon
it does not hold the worker's exit) and reported as a timeout. Nothing a
tool does (raise, hang, return garbage) escapes as an exception: each call
comes back as an observation string or an error kind, so a turn ends and the
step goes on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

ERROR_KINDS = ("exception", "timeout", "bad_output", "parse")
"""``multiturn/tool_errors/<kind>``: the tool raised, ran past its timeout, returned something
that is not what it must return, or the model's call could not be read."""


@dataclass(frozen=True)
class CallResult:
    value: Any
    """What the call returned (None on an error)."""
    error: str | None
    """One of ``ERROR_KINDS``, or None."""
    message: str
    """The error's text for the model's observation ('' when none)."""
    seconds: float
    """Wall time of the call (the timeout for one that timed out)."""


def run_concurrently(calls: list[Callable[[], Any]], timeout: float, max_workers: int) -> list[CallResult]:
    """Run ``calls`` (no arguments each), ``max_workers`` at a time; results in order.

    Args:
        timeout: seconds a call may run before it is abandoned as ``timeout``.
    Returns:
        [len(calls)] ``CallResult``: the value, or error ``exception`` (it raised) or ``timeout``.
    """
    results: list[CallResult | None] = [None] * len(calls)
    for first in range(0, len(calls), max_workers):
        batch = range(first, min(first + max_workers, len(calls)))
        slots: dict[int, CallResult] = {}
        threads = {i: threading.Thread(target=_run_into, args=(calls[i], slots, i), daemon=True) for i in batch}
        started = time.perf_counter()
        for thread in threads.values():
            thread.start()
        for i, thread in threads.items():
            thread.join(max(0.0, started + timeout - time.perf_counter()))
            results[i] = slots.get(i) or CallResult(
                None, "timeout", f"the call ran past its timeout of {timeout:g} s", timeout)
    return results


def _run_into(call: Callable[[], Any], slots: dict[int, CallResult], i: int) -> None:
    start = time.perf_counter()
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation, not the step's
        slots[i] = CallResult(None, "exception", f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
        return
    slots[i] = CallResult(value, None, "", time.perf_counter() - start)
