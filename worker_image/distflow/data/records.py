"""The records a prompt source yields: what the data files, the built-in tasks and the
reward functions agree on. Their own module so that the file readers
(``distflow.data.sources``) and the built-in tasks (``distflow.tasks``) both use
them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of an RL dataset.

    Attributes:
        uid: unique, stable id of the prompt (``<file stem>-<row>`` for files).
        messages: chat messages ``({"role": ..., "content": ...}, ...)``.
        ground_truth: the reference answer the reward function compares to.
        data_source: dataset name; selects the default reward function.
        extra_info: free-form per-record metadata, passed to the reward function.
    """

    uid: str
    messages: tuple[dict[str, str], ...]
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class PromptSource(Protocol):
    """Random-access collection of prompt records."""

    @property
    def num_records(self) -> int: ...

    def read(self, indices: Sequence[int]) -> list[PromptRecord]: ...
