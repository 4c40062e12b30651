"""Tools and environments for the multi-turn tests (loaded by name, as a user's would be)."""

from __future__ import annotations

import time

FIXED_OBSERVATION = "  result: 42  "
"""Spaces at both ends: a chat template that trims contents renders it differently on re-encode."""


def lookup() -> str:
    return FIXED_OBSERVATION


def explode(query: str = "") -> str:
    raise RuntimeError("the tool broke")


def sleepy(seconds: float = 30.0) -> str:
    time.sleep(seconds)
    return "too late"


def not_text() -> int:
    return 7


class Countdown:
    """Done after three steps; reward 1 per step whose action is non-empty."""

    def reset(self, record):
        self.left = 3
        return None

    def step(self, action_text: str):
        self.left -= 1
        return f"{self.left} left", float(bool(action_text)), self.left == 0


class NoStep:
    """An environment missing its step method."""

    def reset(self, record):
        return None


class BrokenReset(Countdown):
    """Its reset raises: the sample gets one turn, counted as an exception."""

    def reset(self, record):
        raise KeyError("no such task")


class RankTurns(Countdown):
    """Done after 1 + 2 x RANK steps (the worker's rank in the job): ranks 0 and 1 of a two-worker
    job run 1 and 3 model turns per trajectory, so one rank generates while the other is done."""

    def reset(self, record):
        import os

        self.left = 1 + 2 * int(os.environ.get("RANK", "0"))
        return None
