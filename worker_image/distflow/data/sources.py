"""Prompt sources: read prompt records from jsonl / parquet files, by index.

A dp rank of the distributed dataloader reads only the records of its shard,
so every reader here is random-access:

- parquet: the row-group metadata tells which row groups hold the requested
  rows, and only those row groups are read (``ParquetFile.read_row_group``).
- jsonl: one pass over the file, in large chunks, finds the byte offset of
  every line start; the requested lines are then read by seeking. The offset
  index lives in memory only (a few bytes per line) and is rebuilt when the
  file changes.

Accepted record schemas, detected per record by its keys:

- ``gsm8k``: raw GSM8K, ``{"question": ..., "answer": "... #### 72"}``.
  The prompt is built as verl's ``examples/data_preprocess/gsm8k.py`` does.
- ``verl``: verl's RL dataset schema, ``data_source``, ``prompt`` (chat
  messages), ``reward_model`` (``{"ground_truth": ..., "style": ...}``) and
  optional ``ability`` / ``extra_info``; in parquet or in jsonl.

Deliberately simplified: no streaming from object stores, no compression
other than what parquet itself does; jsonl must be UTF-8 with ``\\n`` line
ends (blank lines are skipped).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from distflow.data.records import PromptRecord, PromptSource
from distflow.tasks import ArithmeticSource, ArithmeticTask

if TYPE_CHECKING:
    from distflow.spec import DatasetSpec

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
GSM8K_DATA_SOURCE = "openai/gsm8k"

SCHEMA_KEYS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("question", "answer"),
    "verl": ("data_source", "prompt", "reward_model"),
}
_JSONL_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)
DATA_SUFFIXES = _JSONL_SUFFIXES + _PARQUET_SUFFIXES
"""File extensions ``open_source`` reads."""
_SCAN_CHUNK_BYTES = 8 << 20


def gsm8k_ground_truth(answer: str) -> str:
    """The final answer of a raw GSM8K solution: the text after ``####``, commas removed.

    Raises:
        ValueError: the solution has no ``####`` marker.
    """
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' final-answer marker: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def _missing_keys_error(keys: Sequence[str], where: str) -> ValueError:
    missing = {name: sorted(set(req) - set(keys)) for name, req in SCHEMA_KEYS.items()}
    accepted = "; ".join(f"{name}: {list(req)}" for name, req in SCHEMA_KEYS.items())
    return ValueError(
        f"{where}: unknown record schema (keys {sorted(keys)}); missing keys per schema: "
        f"{missing}. Accepted schemas: {accepted}"
    )


def detect_schema(keys: Sequence[str], where: str = "record") -> str:
    """Name of the schema whose required keys are all in ``keys``.

    Raises:
        ValueError: no schema matches; the message names the missing keys.
    """
    for name, required in SCHEMA_KEYS.items():
        if set(required) <= set(keys):
            return name
    raise _missing_keys_error(keys, where)


def _chat_messages(prompt: Any, where: str) -> tuple[dict[str, str], ...]:
    if isinstance(prompt, str):
        return ({"role": "user", "content": prompt},)
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        return tuple({"role": str(m["role"]), "content": str(m["content"])} for m in prompt)
    raise ValueError(f"{where}: 'prompt' must be a string or a list of chat messages, got {type(prompt).__name__}")


def record_from_row(row: dict[str, Any], uid: str, split: str = "") -> PromptRecord:
    """Convert one raw row (gsm8k or verl schema) into a :class:`PromptRecord`.

    Raises:
        ValueError: unknown schema, malformed prompt or missing ground truth.
    """
    schema = detect_schema(list(row), where=uid)
    if schema == "gsm8k":
        question = str(row["question"])
        return PromptRecord(
            uid=uid,
            messages=({"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"},),
            ground_truth=gsm8k_ground_truth(str(row["answer"])),
            data_source=GSM8K_DATA_SOURCE,
            extra_info={"split": split, "answer": row["answer"], "question": question},
        )
    reward_model = row["reward_model"] or {}
    if "ground_truth" not in reward_model:
        raise ValueError(f"{uid}: 'reward_model' has no 'ground_truth' (got keys {sorted(reward_model)})")
    extra_info = dict(row.get("extra_info") or {})
    if row.get("ability") is not None:
        extra_info.setdefault("ability", row["ability"])
    return PromptRecord(
        uid=uid,
        messages=_chat_messages(row["prompt"], uid),
        ground_truth=str(reward_model["ground_truth"]),
        data_source=str(row["data_source"]),
        extra_info=extra_info,
    )


@functools.lru_cache(maxsize=16)
def _jsonl_line_spans(path: str, size: int, mtime_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) in bytes of the non-empty lines; ``size``/``mtime_ns`` key the cache."""
    newlines: list[np.ndarray] = []
    with open(path, "rb") as f:
        base = 0
        while chunk := f.read(_SCAN_CHUNK_BYTES):
            newlines.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 0x0A) + base)
            base += len(chunk)
    ends = np.concatenate(newlines + [np.array([size], dtype=np.int64)]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    lengths = ends - starts
    keep = lengths > 0
    return starts[keep], lengths[keep]


class FileSource:
    """A jsonl or parquet file of prompt records, read by row index.

    Args:
        path: a ``.jsonl``/``.json`` (one JSON object per line) or ``.parquet`` file.
        max_records: use only the first ``max_records`` records (None: all).

    Raises:
        ValueError: unknown file extension, ``max_records < 1``, or (parquet) an unknown schema.
        FileNotFoundError: ``path`` does not exist.
    """

    def __init__(self, path: str | os.PathLike, max_records: int | None = None):
        if max_records is not None and max_records < 1:
            raise ValueError(f"data file {path}: size must be >= 1 or unset, got {max_records}")
        self.max_records = max_records
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"data file not found: {self.path}")
        suffix = self.path.suffix.lower()
        if suffix not in DATA_SUFFIXES:
            raise ValueError(
                f"data file {self.path}: unknown extension {suffix!r}; use one of "
                f"{list(DATA_SUFFIXES)}"
            )
        self.format = source_format(self.path)
        self.split = self.path.stem
        self._parquet_group_starts: np.ndarray | None = None
        if self.format == "parquet":
            self._init_parquet()

    def _init_parquet(self) -> None:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(self.path).metadata
        detect_schema(meta.schema.to_arrow_schema().names, where=str(self.path))
        group_rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._parquet_group_starts = np.concatenate([[0], np.cumsum(group_rows)]).astype(np.int64)

    def _line_spans(self) -> tuple[np.ndarray, np.ndarray]:
        stat = self.path.stat()
        return _jsonl_line_spans(str(self.path.resolve()), stat.st_size, stat.st_mtime_ns)

    @property
    def num_records(self) -> int:
        """Number of records (non-empty lines for jsonl, rows for parquet)."""
        if self._parquet_group_starts is not None:
            total = int(self._parquet_group_starts[-1])
        else:
            total = len(self._line_spans()[0])
        return total if self.max_records is None else min(total, self.max_records)

    def _check_indices(self, indices: Sequence[int]) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self.num_records
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"{self.path}: record index out of range [0, {n}): {idx.min()}..{idx.max()}")
        return idx

    def read_rows(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Raw rows at ``indices`` (any order, repeats allowed), reading only what they need."""
        idx = self._check_indices(indices)
        if self.format == "parquet":
            return self._read_parquet_rows(idx)
        return self._read_jsonl_rows(idx)

    def _read_jsonl_rows(self, idx: np.ndarray) -> list[dict[str, Any]]:
        starts, lengths = self._line_spans()
        rows: dict[int, dict[str, Any]] = {}
        with open(self.path, "rb") as f:
            for i in sorted(set(idx.tolist())):
                f.seek(int(starts[i]))
                line = f.read(int(lengths[i]))
                try:
                    rows[i] = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{self.path}: record {i} is not valid JSON: {exc}") from exc
        return [rows[i] for i in idx.tolist()]

    def _read_parquet_rows(self, idx: np.ndarray) -> list[dict[str, Any]]:
        import pyarrow.parquet as pq

        group_starts = self._parquet_group_starts
        groups = np.searchsorted(group_starts, idx, side="right") - 1
        parquet = pq.ParquetFile(self.path)
        rows: dict[int, dict[str, Any]] = {}
        for g in sorted(set(groups.tolist())):
            wanted = sorted(set(idx[groups == g].tolist()))
            table = parquet.read_row_group(g)
            local = [i - int(group_starts[g]) for i in wanted]
            rows.update(zip(wanted, table.take(local).to_pylist(), strict=True))
        return [rows[i] for i in idx.tolist()]

    def read(self, indices: Sequence[int]) -> list[PromptRecord]:
        """Prompt records at ``indices``, in the order given.

        Raises:
            IndexError: an index is outside ``[0, num_records)``.
            ValueError: a record has an unknown schema or is malformed.
        """
        idx = self._check_indices(indices).tolist()
        rows = self.read_rows(idx)
        return [record_from_row(row, f"{self.split}-{i}", self.split) for i, row in zip(idx, rows, strict=True)]


def open_source(
    source: str | os.PathLike | PromptSource, *, size: int | None = None, seed: int = 0
) -> PromptSource:
    """A :class:`PromptSource` from a file path, an existing source, or a task name.

    Args:
        source: a ``.jsonl``/``.parquet`` path, or ``arithmetic`` /
            ``arithmetic:train`` / ``arithmetic:eval`` (see :mod:`distflow.tasks`).
        size: files: use at most this many records; tasks: generate this many
            (None: all / the task's default).
        seed: tasks only: the generator seed.

    Raises:
        ValueError: unknown file extension or task split.
        FileNotFoundError: the path does not exist.
    """
    if isinstance(source, PromptSource):
        return source
    text = os.fspath(source)
    if text == "arithmetic" or text.startswith("arithmetic:"):
        return _arithmetic_source(text.partition(":")[2] or "train", size, seed, ArithmeticTask())
    return FileSource(text, max_records=size)


def dataset_source(ds: DatasetSpec) -> PromptSource:
    """The PromptSource of a ``data.train`` / ``data.eval`` spec: a file, or a built-in task with its difficulty."""
    if (split := ds.arithmetic_split) is not None:
        task = ArithmeticTask(min_operand=ds.min_operand, max_operand=ds.max_operand)
        return _arithmetic_source(split, ds.size, ds.seed, task)
    return open_source(ds.path, size=ds.size, seed=ds.seed)


def _arithmetic_source(split: str, size: int | None, seed: int, task: ArithmeticTask) -> ArithmeticSource:
    if size is None:
        return ArithmeticSource(seed=seed, split=split, task=task)
    return ArithmeticSource(num_records=size, seed=seed, split=split, task=task)


def count_records(path: str | os.PathLike) -> int:
    """Number of prompt records in a jsonl/parquet file (parquet: metadata only)."""
    return FileSource(path).num_records


def read_records(path: str | os.PathLike, indices: Sequence[int]) -> list[PromptRecord]:
    """Prompt records at ``indices`` of a jsonl/parquet file, reading only the rows needed."""
    return FileSource(path).read(indices)


def data_file_problem(path: str | os.PathLike) -> str | None:
    """Why a prompt file cannot be trained on, read from its first record; None when it can.

    Catches what would otherwise fail only once the workers read their shards: an
    empty file, a file that is not JSON lines / parquet, a record of no known schema
    (e.g. no ``prompt`` or ``question`` field).
    """
    try:
        source = FileSource(path)
        if source.num_records == 0:
            return "has no records (the file is empty); give a file with one prompt record per line or row"
        source.read([0])
    except (ValueError, TypeError, KeyError, OSError) as err:  # pyarrow's ArrowInvalid is a ValueError
        if "schema" in str(err):  # the message lists the accepted schemas and the missing keys
            return f"has records distflow cannot read: {err}"
        if source_format(path) == "parquet":
            return f"is not a readable parquet file ({err}); write it with pyarrow or pandas.to_parquet"
        if _first_character(path) == "[":
            return "holds one JSON array, not JSON lines; write one JSON object per line (e.g. jq -c '.[]')"
        return f"is not JSON lines ({err}); write one JSON object per line"
    return None


def _first_character(path: str | os.PathLike) -> str:
    """The file's first character that is not white space ('' for none or a file not UTF-8)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(4096).lstrip()[:1]
    except (OSError, UnicodeDecodeError):
        return ""


def source_format(path: str | os.PathLike) -> str:
    """``parquet`` or ``jsonl``, from the file's extension."""
    return "parquet" if Path(path).suffix.lower() in _PARQUET_SUFFIXES else "jsonl"
