"""Prompts longer than ``data.maxPromptLength``: stop the job, drop them, or cut them (``data.truncation``).

Every rank tokenizes a strided share of the dataset (``scan_share``); the
over-long ones are all-gathered (the worker does that), so every rank sees the
same list and takes the same decision: ``error`` raises on every rank before
training, ``filter`` gives every rank the same ``SubsetSource`` (the seeded
shuffle then runs over the kept prompts), ``left`` changes nothing (the
rollout keeps each prompt's last tokens). Deliberately simplified: a scan
tokenizes the whole dataset once per job start (verl's
``filter_overlong_prompts`` does the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from distflow.data.records import PromptRecord, PromptSource
from distflow.errors import DistflowConfigError

_READ_CHUNK = 256


@dataclass(frozen=True)
class Overlong:
    """A prompt longer than the limit."""

    index: int
    """Record index in the source."""
    uid: str
    num_tokens: int
    """Its length once chat-templated (tokens)."""


def scan_share(source: PromptSource, rank: int, world_size: int, max_prompt_length: int,
               prompt_tokens: Callable[[PromptRecord], int]) -> list[Overlong]:
    """The over-long prompts among records ``rank, rank + world_size, ...`` of ``source``.

    Args:
        prompt_tokens: a record's length in tokens as the rollout renders it.
    """
    mine = list(range(rank, source.num_records, world_size))
    found = []
    for start in range(0, len(mine), _READ_CHUNK):
        indices = mine[start: start + _READ_CHUNK]
        for index, record in zip(indices, source.read(indices)):
            n = prompt_tokens(record)
            if n > max_prompt_length:
                found.append(Overlong(index, record.uid, n))
    return found


class SubsetSource:
    """The records of ``source`` at ``kept`` (in that order), as a ``PromptSource``."""

    def __init__(self, source: PromptSource, kept: Sequence[int]):
        self.source, self.kept = source, list(kept)

    @property
    def num_records(self) -> int:
        return len(self.kept)

    def read(self, indices: Sequence[int]) -> list[PromptRecord]:
        return self.source.read([self.kept[i] for i in indices])


def fit_prompts(source: PromptSource, overlong: Sequence[Overlong], truncation: str, max_prompt_length: int,
                field: str) -> PromptSource:
    """``source`` as ``data.truncation`` says, given every over-long prompt of it (all ranks').

    Args:
        field: the dataset's spec field, for the error (``data.train``).

    Returns:
        ``source`` itself (nothing over-long, or ``left``), or a ``SubsetSource`` without the
        over-long prompts (``filter``).

    Raises:
        DistflowConfigError: ``error`` and some prompt is over-long (names the longest), or
            ``filter`` leaves no prompt.
    """
    if not overlong or truncation == "left":
        return source
    if truncation == "error":
        worst = max(overlong, key=lambda o: (o.num_tokens, -o.index))
        raise DistflowConfigError(
            f"spec.{field}: {len(overlong)} prompt(s) exceed data.maxPromptLength={max_prompt_length} tokens, "
            f"the longest {worst.uid!r} (record {worst.index}) with {worst.num_tokens}; raise "
            "data.maxPromptLength, or set data.truncation: filter (drop them) or left (keep their last tokens)")
    dropped = {o.index for o in overlong}
    kept = [i for i in range(source.num_records) if i not in dropped]
    if not kept:
        raise DistflowConfigError(f"spec.{field}: every prompt exceeds data.maxPromptLength={max_prompt_length} "
                                  "tokens; raise data.maxPromptLength")
    return SubsetSource(source, kept)
