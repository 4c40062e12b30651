"""Synthetic arithmetic task: "What is 37 + 48? Answer with just the number."

Used by the quickstart, where a 135M-parameter model trains on CPU: the task
is easy enough that such a model gets a reward signal from the first steps,
and its difficulty is a parameter (the operand range and the operators).

Records are addressed by index: record ``i`` of a split is drawn from its own
generator seeded with ``(seed, split, i)``, so any dp rank can build exactly
the records of its shard, in any order, without generating the others.

Train and eval never overlap, in two ways:

- the seed ranges differ: the split is part of the generator seed, so the
  two splits draw from disjoint random streams;
- the problems themselves are partitioned: a problem ``(a, op, b)`` belongs
  to the eval split iff ``crc32("a op b") % EVAL_MODULUS == 0`` (about 1 in
  10), and each split rejects the other's problems. Disjoint seeds alone
  would still let the same question appear in both splits.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from distflow.data.records import PromptRecord
from distflow.names import ARITHMETIC_SPLITS

ARITHMETIC_DATA_SOURCE = "arithmetic"
SPLITS = ARITHMETIC_SPLITS  # defined with the spec, which checks configs before any worker starts
EVAL_MODULUS = 10
_SPLIT_CODES = {"train": 0, "eval": 1}
_MAX_DRAWS = 10_000
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class ArithmeticTask:
    """Difficulty of the arithmetic task.

    Attributes:
        min_operand: smallest operand (inclusive); default 10, i.e. 2-digit.
        max_operand: largest operand (inclusive); default 99.
        ops: operators to draw from, a subset of ``+ - *``.
        allow_negative: if False, ``a - b`` is drawn with ``a >= b``.
    """

    min_operand: int = 10
    max_operand: int = 99
    ops: tuple[str, ...] = ("+", "-")
    allow_negative: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"arithmetic task: need 0 <= min_operand <= max_operand, got "
                f"min_operand={self.min_operand}, max_operand={self.max_operand}"
            )
        unknown = [op for op in self.ops if op not in _OPS]
        if not self.ops or unknown:
            raise ValueError(f"arithmetic task: ops must be a non-empty subset of {list(_OPS)}, got {list(self.ops)}")

    def problem(self, index: int, seed: int, split: str) -> tuple[int, str, int]:
        """The problem ``(a, op, b)`` at ``index`` of ``split``, deterministic in all arguments.

        Raises:
            ValueError: unknown split, or the operand range is too small to hold problems of this split.
        """
        if split not in _SPLIT_CODES:
            raise ValueError(f"arithmetic task: unknown split {split!r}; choose one of {list(SPLITS)}")
        rng = np.random.default_rng([seed, _SPLIT_CODES[split], index])
        for _ in range(_MAX_DRAWS):
            a, b = (int(x) for x in rng.integers(self.min_operand, self.max_operand + 1, size=2))
            op = self.ops[int(rng.integers(len(self.ops)))]
            if op == "-" and not self.allow_negative and a < b:
                a, b = b, a
            if problem_split(a, op, b) == split:
                return a, op, b
        raise ValueError(
            f"arithmetic task: no {split} problem found in operands [{self.min_operand}, {self.max_operand}] "
            f"with ops {list(self.ops)}; widen the operand range"
        )

    def record(self, index: int, seed: int, split: str = "train") -> PromptRecord:
        """The prompt record at ``index`` of ``split``; ground truth is the exact integer result."""
        a, op, b = self.problem(index, seed, split)
        question = f"What is {a} {op} {b}? Answer with just the number."
        return PromptRecord(
            uid=f"arithmetic-{split}-{seed}-{index}",
            messages=({"role": "user", "content": question},),
            ground_truth=str(_OPS[op](a, b)),
            data_source=ARITHMETIC_DATA_SOURCE,
            extra_info={"split": split, "index": index, "a": a, "op": op, "b": b},
        )


def problem_split(a: int, op: str, b: int) -> str:
    """The split a problem belongs to: ``"eval"`` for ~1/EVAL_MODULUS of problems, else ``"train"``."""
    return "eval" if zlib.crc32(f"{a} {op} {b}".encode()) % EVAL_MODULUS == 0 else "train"


def arithmetic_records(
    num: int,
    seed: int,
    *,
    split: str = "train",
    min_operand: int = 10,
    max_operand: int = 99,
    ops: tuple[str, ...] = ("+", "-"),
    allow_negative: bool = False,
) -> list[PromptRecord]:
    """``num`` arithmetic prompt records of ``split``; the same arguments give the same records.

    Raises:
        ValueError: ``num < 0``, unknown split or invalid difficulty (see :class:`ArithmeticTask`).
    """
    if num < 0:
        raise ValueError(f"arithmetic task: num must be >= 0, got {num}")
    task = ArithmeticTask(min_operand, max_operand, tuple(ops), allow_negative)
    return [task.record(i, seed, split) for i in range(num)]


class ArithmeticSource:
    """The arithmetic task as a random-access :class:`~distflow.data.sources.PromptSource`.

    Args:
        num_records: dataset size (prompts per epoch).
        seed: generator seed; train and eval of one seed never share a problem.
        split: ``"train"`` or ``"eval"``.
        task: difficulty.

    Raises:
        ValueError: ``num_records < 1`` or unknown split.
    """

    def __init__(
        self, num_records: int = 4096, seed: int = 0, split: str = "train", task: ArithmeticTask | None = None
    ):
        if num_records < 1:
            raise ValueError(f"arithmetic source: num_records must be >= 1, got {num_records}")
        if split not in SPLITS:
            raise ValueError(f"arithmetic source: unknown split {split!r}; choose one of {list(SPLITS)}")
        self._num_records = num_records
        self.seed = seed
        self.split = split
        self.task = task or ArithmeticTask()

    @property
    def num_records(self) -> int:
        return self._num_records

    def read(self, indices: Sequence[int]) -> list[PromptRecord]:
        """Records at ``indices`` (generated, nothing is read from disk).

        Raises:
            IndexError: an index is outside ``[0, num_records)``.
        """
        out = []
        for i in indices:
            if not 0 <= int(i) < self._num_records:
                raise IndexError(f"arithmetic source: index {i} out of range [0, {self._num_records})")
            out.append(self.task.record(int(i), self.seed, self.split))
        return out
