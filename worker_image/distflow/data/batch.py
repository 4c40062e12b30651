"""``PackedBatch``: the typed record that carries ragged samples between DAG stages.

Sample ``b`` has ``seq_lens[b]`` tokens. Token fields hold every sample's
tokens back to back, with no padding (``[T_total, *k]``, T_total =
sum(seq_lens)); sample fields hold one row per sample (``[B, *k]``). All token
fields share ``seq_lens``, so one offset table (``cu_seqlens``) slices them all.

``seq_lens`` always lives on the CPU: it is metadata every plan reads and
all-gathers, and keeping it there avoids a device sync per ``select``. The
fields share one device (CPU or the current CUDA device).

Deliberately simplified: no nested or string fields; a field that is
per-token for some samples and per-sample for others does not exist.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, NamedTuple, Sequence

import torch

TOKEN = "token"
SAMPLE = "sample"
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class FieldSpec(NamedTuple):
    """What senders and receivers must agree on for one field."""

    name: str
    kind: str  # TOKEN or SAMPLE
    dtype: torch.dtype
    trailing_shape: tuple[int, ...]  # shape after the first dim

    @property
    def row_nbytes(self) -> int:
        """Bytes per token (TOKEN) or per sample (SAMPLE)."""
        numel = 1
        for d in self.trailing_shape:
            numel *= d
        return numel * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """Ragged samples, packed. Treat as immutable: methods return new batches.

    Raises:
        ValueError: on construction, naming the field, when a token field's
            first dim is not sum(seq_lens), a sample field's is not B, a name
            is used twice, fields sit on different devices, or seq_lens is not
            a 1-D non-negative integer tensor.
    """

    seq_lens: torch.Tensor
    """[B] int64 on CPU: tokens per sample."""
    token_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """name -> [T_total, *k], e.g. ``input_ids``, ``old_log_probs``, ``response_mask``."""
    sample_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """name -> [B, *k], e.g. ``rewards``, ``advantages`` (per sequence), ``sample_id``."""

    def __post_init__(self) -> None:
        lens = self.seq_lens
        if not isinstance(lens, torch.Tensor) or lens.dim() != 1 or lens.dtype not in _INTEGER_DTYPES:
            raise ValueError("seq_lens must be a 1-D integer tensor [B] (tokens per sample)")
        lens = lens.to(device="cpu", dtype=torch.int64)
        if lens.numel() and int(lens.min()) < 0:
            raise ValueError(f"seq_lens has a negative length ({int(lens.min())}); lengths are >= 0")
        object.__setattr__(self, "seq_lens", lens)
        object.__setattr__(self, "token_fields", dict(self.token_fields))
        object.__setattr__(self, "sample_fields", dict(self.sample_fields))
        self._validate_fields()

    def _validate_fields(self) -> None:
        both = set(self.token_fields) & set(self.sample_fields)
        if both:
            raise ValueError(f"fields {sorted(both)} are both token and sample fields; rename one")
        num_tokens, num_samples = self.num_tokens, self.num_samples
        devices = {}
        for kind, fields, rows in ((TOKEN, self.token_fields, num_tokens),
                                   (SAMPLE, self.sample_fields, num_samples)):
            for name, value in fields.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    raise ValueError(f"{kind} field {name!r} must be a tensor with a first dimension")
                if value.shape[0] != rows:
                    unit = "sum(seq_lens)" if kind == TOKEN else "B = len(seq_lens)"
                    raise ValueError(
                        f"{kind} field {name!r} has first dim {value.shape[0]}, expected {unit} = {rows}"
                    )
                devices[name] = value.device
        if len(set(devices.values())) > 1:
            raise ValueError(f"fields are on different devices {devices}; move them to one device")

    @property
    def num_samples(self) -> int:
        """B."""
        return int(self.seq_lens.numel())

    @property
    def num_tokens(self) -> int:
        """T_total = sum(seq_lens)."""
        return int(self.seq_lens.sum())

    @property
    def device(self) -> torch.device:
        """Device of the fields (CPU when there are none)."""
        for value in (*self.token_fields.values(), *self.sample_fields.values()):
            return value.device
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Bytes held by the fields (seq_lens, being metadata, excluded)."""
        values = (*self.token_fields.values(), *self.sample_fields.values())
        return sum(v.numel() * v.element_size() for v in values)

    def sample_nbytes(self) -> list[int]:
        """[B] bytes of each sample over all fields."""
        specs = self.field_schema()
        per_token = sum(s.row_nbytes for s in specs if s.kind == TOKEN)
        per_sample = sum(s.row_nbytes for s in specs if s.kind == SAMPLE)
        return [n * per_token + per_sample for n in self.seq_lens.tolist()]

    def cu_seqlens(self, dtype: torch.dtype = torch.int32, device=None) -> torch.Tensor:
        """[B + 1] cumulative lengths starting at 0 (flash-attention's varlen layout).

        Defaults: int32, on the fields' device.
        """
        cu = torch.zeros(self.num_samples + 1, dtype=torch.int64)
        torch.cumsum(self.seq_lens, 0, out=cu[1:])
        return cu.to(device=self.device if device is None else device, dtype=dtype)

    def field_schema(self) -> tuple[FieldSpec, ...]:
        """Token fields then sample fields, each sorted by name: the wire order of exchange."""
        token = [FieldSpec(n, TOKEN, v.dtype, tuple(v.shape[1:])) for n, v in self.token_fields.items()]
        sample = [FieldSpec(n, SAMPLE, v.dtype, tuple(v.shape[1:])) for n, v in self.sample_fields.items()]
        return tuple(sorted(token) + sorted(sample))

    @cached_property
    def token_offsets(self) -> list[int]:
        """[B + 1] ints: sample b's tokens are rows ``token_offsets[b]:token_offsets[b + 1]``."""
        return [0, *itertools.accumulate(self.seq_lens.tolist())]

    def row_ranges(self, indices: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """``indices`` as runs ``(sample_start, sample_stop, token_start, token_stop)``, in order.

        Adjacent indices merge into one run, so picking contiguous samples
        copies each field in one slice rather than per sample.

        Raises:
            ValueError: if an index is outside 0..B-1.
        """
        runs: list[list[int]] = []
        for i in indices:
            if not 0 <= i < self.num_samples:
                raise ValueError(f"sample index {i} is out of range for B = {self.num_samples}")
            if runs and runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, i + 1])
        offsets = self.token_offsets
        return [(a, b, offsets[a], offsets[b]) for a, b in runs]

    def field_rows(self, name: str, runs) -> list[torch.Tensor]:
        """Views of field ``name`` (token or sample) for each of ``runs`` (from ``row_ranges``)."""
        if name in self.token_fields:
            return [self.token_fields[name][t0:t1] for _, _, t0, t1 in runs]
        return [self.sample_fields[name][a:b] for a, b, _, _ in runs]

    def gather_field(self, name: str, runs, out: torch.Tensor | None = None) -> torch.Tensor:
        """``field_rows`` concatenated: one copy, into ``out`` (e.g. a view of a send buffer) if given."""
        parts = self.field_rows(name, runs)
        if not parts:
            value = self.token_fields.get(name, self.sample_fields.get(name))
            return value[:0].clone() if out is None else out
        return torch.cat(parts) if out is None else torch.cat(parts, out=out)

    def slice(self, start: int, stop: int) -> "PackedBatch":
        """Samples ``start:stop`` as views (no copy).

        Raises:
            ValueError: unless 0 <= start <= stop <= B.
        """
        if not 0 <= start <= stop <= self.num_samples:
            raise ValueError(f"slice({start}, {stop}) is outside 0..B={self.num_samples}")
        t0, t1 = self.token_offsets[start], self.token_offsets[stop]
        return PackedBatch(
            seq_lens=self.seq_lens[start:stop],
            token_fields={n: v[t0:t1] for n, v in self.token_fields.items()},
            sample_fields={n: v[start:stop] for n, v in self.sample_fields.items()},
        )

    def select(self, indices: Sequence[int]) -> "PackedBatch":
        """The samples at ``indices`` (positions 0..B-1), in the given order (repeats allowed).

        Raises:
            ValueError: if an index is out of range.
        """
        runs = self.row_ranges([int(i) for i in indices])
        lens = [self.seq_lens[a:b] for a, b, _, _ in runs]
        return PackedBatch(
            seq_lens=torch.cat(lens) if lens else self.seq_lens[:0],
            token_fields={n: self.gather_field(n, runs) for n in self.token_fields},
            sample_fields={n: self.gather_field(n, runs) for n in self.sample_fields},
        )

    @classmethod
    def concat(cls, batches: Sequence["PackedBatch"]) -> "PackedBatch":
        """Samples of all batches, in order.

        Raises:
            ValueError: if ``batches`` is empty or the schemas differ (names the field).
        """
        if not batches:
            raise ValueError("concat needs at least one batch (an empty list has no schema)")
        first = batches[0]
        for k, other in enumerate(batches[1:], start=1):
            check_same_schema(first.field_schema(), other.field_schema(), f"batches[{k}]")
        return cls(
            seq_lens=torch.cat([b.seq_lens for b in batches]),
            token_fields={n: torch.cat([b.token_fields[n] for b in batches]) for n in first.token_fields},
            sample_fields={n: torch.cat([b.sample_fields[n] for b in batches]) for n in first.sample_fields},
        )

    def with_fields(
        self,
        token: Mapping[str, torch.Tensor] | None = None,
        sample: Mapping[str, torch.Tensor] | None = None,
    ) -> "PackedBatch":
        """A new batch with fields added or replaced (same samples, same seq_lens).

        New fields join the batch's device (a stage's host-computed scores go to
        the accelerator the step data lives on, not the batch to the host); a
        batch without fields takes theirs.
        """
        device = self.device if self.token_fields or self.sample_fields else None
        join = lambda new: {k: v if device is None else v.to(device) for k, v in (new or {}).items()}  # noqa: E731
        return PackedBatch(
            seq_lens=self.seq_lens,
            token_fields={**self.token_fields, **join(token)},
            sample_fields={**self.sample_fields, **join(sample)},
        )

    def to_padded(
        self, name: str, pad_value: float = 0, max_len: int | None = None, left_pad: bool = False
    ) -> torch.Tensor:
        """Token field ``name`` as [B, T, *k], T = max_len or max(seq_lens).

        ``left_pad`` puts the padding before the tokens (what decoder-only
        generation expects for prompts).

        Raises:
            ValueError: unknown token field, or ``max_len`` < max(seq_lens).
        """
        if name not in self.token_fields:
            raise ValueError(f"to_padded: no token field {name!r}; have {sorted(self.token_fields)}")
        longest = int(self.seq_lens.max()) if self.num_samples else 0
        width = longest if max_len is None else max_len
        if width < longest:
            raise ValueError(f"to_padded: max_len={max_len} is shorter than the longest sample ({longest})")
        value = self.token_fields[name]
        rows, cols = _padded_coords(self.seq_lens, width, left_pad)
        out = value.new_full((self.num_samples, width, *value.shape[1:]), pad_value)
        out[rows.to(value.device), cols.to(value.device)] = value
        return out


def _padded_coords(seq_lens: torch.Tensor, width: int, left_pad: bool):
    """(row, col) in a [B, width] grid of every packed token, in packed order."""
    rows = torch.repeat_interleave(torch.arange(seq_lens.numel()), seq_lens)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    cols = torch.arange(int(seq_lens.sum())) - starts[rows]
    if left_pad:
        cols = cols + (width - seq_lens)[rows]
    return rows, cols


def from_padded(padded: torch.Tensor, seq_lens: torch.Tensor, left_pad: bool = False) -> torch.Tensor:
    """Pack [B, T, *k] padded rows into [T_total, *k], keeping ``seq_lens[b]`` tokens of row b.

    The inverse of ``PackedBatch.to_padded`` (right padding unless ``left_pad``).

    Raises:
        ValueError: if ``padded`` has fewer than B rows or a length exceeds T.
    """
    seq_lens = seq_lens.to(device="cpu", dtype=torch.int64)
    if padded.dim() < 2 or padded.shape[0] != seq_lens.numel():
        raise ValueError(f"from_padded: padded shape {tuple(padded.shape)} needs [B={seq_lens.numel()}, T, ...]")
    width = padded.shape[1]
    if seq_lens.numel() and int(seq_lens.max()) > width:
        raise ValueError(f"from_padded: a length {int(seq_lens.max())} exceeds the padded width T={width}")
    rows, cols = _padded_coords(seq_lens, width, left_pad)
    return padded[rows.to(padded.device), cols.to(padded.device)]


def check_same_schema(expected: Sequence[FieldSpec], actual: Sequence[FieldSpec], where: str) -> None:
    """Raise ValueError naming the first field that differs between two schemas."""
    exp = {s.name: s for s in expected}
    act = {s.name: s for s in actual}
    for name in sorted(set(exp) | set(act)):
        if exp.get(name) != act.get(name):
            raise ValueError(
                f"{where}: field {name!r} is {act.get(name)} but expected {exp.get(name)}; "
                "every batch on an edge needs the same fields, kinds, dtypes and trailing shapes"
            )
