"""Distributed prompt loader: each dp rank reads only its shard of each step.

    epoch e permutation  = default_rng([seed, e]).permutation(N)   (same on every rank)
    step k global batch  = permutation[offset : offset + batch_size]
    dp rank r's part     = global batch[r * B/dp : (r + 1) * B/dp]  (contiguous)

The permutation depends on ``(seed, epoch, N)`` only, never on ``dp_size``,
and the rank parts are contiguous slices of the global batch, so the
concatenation of the rank parts in dp-rank order *is* the ``dp_size=1``
batch: runs on 1, 2 or 4 ranks see the same prompts at every step. The state
``{"epoch", "offset"}`` is global (offset counts prompts of the epoch already
consumed by all ranks), so a checkpoint taken with one dp size can be resumed
with another.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from distflow.data.records import PromptRecord, PromptSource
from distflow.data.sources import open_source


def epoch_permutation(num_records: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Global order of the records in ``epoch``: [N] int64, identical on every rank.

    The generator is seeded with ``[seed, epoch]`` rather than ``seed + epoch``
    so that (seed=1, epoch=0) and (seed=0, epoch=1) do not give the same order.
    """
    if not shuffle:
        return np.arange(num_records, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_records).astype(np.int64)


def _check_share(batch_size: int, dp_rank: int, dp_size: int) -> None:
    if batch_size % dp_size:
        lower = batch_size - batch_size % dp_size
        raise ValueError(
            f"data.trainBatchSize={batch_size} is not divisible by dp_size={dp_size}; "
            f"set data.trainBatchSize to a multiple of {dp_size} (e.g. {lower or dp_size} or {lower + dp_size})"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data loader: dp_rank={dp_rank} outside [0, dp_size={dp_size})")


class ShardedPromptLoader:
    """Yields this dp rank's prompts of each global batch; see the module docstring.

    Args:
        source: a :class:`PromptSource`, a data file path or a task name (:func:`open_source`).
        batch_size: global prompts per step, over all dp ranks.
        dp_rank: this rank's index in ``[0, dp_size)``.
        dp_size: number of data-parallel ranks; must divide ``batch_size``.
        seed: shuffle seed, the same on every rank.
        shuffle: permute the records each epoch; if False, file order.
        drop_last: drop the last incomplete batch of an epoch. If False, that
            batch is filled up with the first records of the same epoch's
            permutation, so every step has exactly ``batch_size`` prompts (RL
            steps assume a fixed group count) and the dp split stays even.

    Raises:
        ValueError: ``batch_size`` not divisible by ``dp_size``, ``dp_rank``
            outside ``[0, dp_size)``, or fewer records than one batch.
    """

    def __init__(
        self,
        source: PromptSource | str | os.PathLike,
        batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if batch_size < 1 or dp_size < 1:
            raise ValueError(f"data loader: batch_size and dp_size must be >= 1, got {batch_size}, {dp_size}")
        _check_share(batch_size, dp_rank, dp_size)
        self.source = open_source(source)
        self.num_records = self.source.num_records
        if self.num_records < batch_size:
            raise ValueError(
                f"dataset has {self.num_records} records, fewer than one batch (data.trainBatchSize={batch_size}); "
                f"lower data.trainBatchSize or use a larger dataset"
            )
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0
        self._permutation_epoch = -1
        self._permutation = np.empty(0, dtype=np.int64)
        self._read: list[np.ndarray] = []

    @property
    def steps_per_epoch(self) -> int:
        """Number of global batches per epoch."""
        full, rest = divmod(self.num_records, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def local_batch_size(self) -> int:
        """Prompts per step on this rank: ``batch_size // dp_size``."""
        return self.batch_size // self.dp_size

    def _epoch_order(self) -> np.ndarray:
        if self._permutation_epoch != self.epoch:
            self._permutation = epoch_permutation(self.num_records, self.seed, self.epoch, self.shuffle)
            self._permutation_epoch = self.epoch
        return self._permutation

    def _roll_over_if_done(self) -> None:
        remaining = self.num_records - self.offset
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.offset = 0

    def next_global_indices(self) -> np.ndarray:
        """Record indices of the next global batch, [batch_size], without advancing."""
        self._roll_over_if_done()
        order = self._epoch_order()
        batch = order[self.offset : self.offset + self.batch_size]
        if len(batch) < self.batch_size:
            batch = np.concatenate([batch, order[: self.batch_size - len(batch)]])
        return batch

    def next_batch(self) -> list[PromptRecord]:
        """This rank's records of the next step, [batch_size // dp_size]; advances the state.

        Only these records are read from the source.
        """
        batch = self.next_global_indices()
        self._read.append(batch)
        local = self.local_batch_size
        mine = batch[self.dp_rank * local : (self.dp_rank + 1) * local]
        self.offset += self.batch_size
        return self.source.read(mine.tolist())

    def reshard(self, dp_rank: int, dp_size: int) -> None:
        """Read share ``dp_rank`` of ``dp_size`` from the next step on, at the same position (epoch,
        offset are global): the stream goes on, no prompt skipped or read twice over the ranks.

        Raises:
            ValueError: ``batch_size`` not divisible by ``dp_size``, or ``dp_rank`` outside ``[0, dp_size)``.
        """
        _check_share(self.batch_size, dp_rank, dp_size)
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def take_read_batches(self) -> list[np.ndarray]:
        """The global batches ([batch_size] record indices, all ranks' parts) that :meth:`next_batch`
        read from since the last call, oldest first; forgets them."""
        read, self._read = self._read, []
        return read

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "offset": prompts of epoch e consumed globally}``; identical on all ranks."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream from a :meth:`state_dict`, possibly taken with another dp size.

        Raises:
            ValueError: missing keys or values out of range.
        """
        missing = {"epoch", "offset"} - set(state)
        if missing:
            raise ValueError(f"data loader state is missing {sorted(missing)}; expected keys ['epoch', 'offset']")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= self.num_records + self.batch_size:
            raise ValueError(
                f"data loader state out of range: epoch={epoch}, offset={offset} "
                f"(dataset has {self.num_records} records); was it saved for another dataset?"
            )
        self.epoch, self.offset = epoch, offset
