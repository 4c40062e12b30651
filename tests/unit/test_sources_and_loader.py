"""Prompt sources (gsm8k / verl jsonl / verl parquet / arithmetic) and the sharded loader."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distflow.data import sources
from distflow.data.loader import ShardedPromptLoader, epoch_permutation
from distflow.data.sources import (
    GSM8K_INSTRUCTION,
    FileSource,
    PromptRecord,
    count_records,
    open_source,
    read_records,
)
from distflow.tasks import ArithmeticSource, ArithmeticTask, arithmetic_records, problem_split

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
GSM8K_DIR = Path(os.environ.get("DISTFLOW_GSM8K_DIR", REPO_ROOT / ".." / "shared" / "data" / "gsm8k"))
GSM8K_TRAIN = GSM8K_DIR / "train.jsonl"
needs_gsm8k = pytest.mark.skipif(not GSM8K_TRAIN.is_file(), reason=f"GSM8K not found at {GSM8K_DIR}")


def verl_rows(num: int) -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i} é?"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(i * 3), "style": "rule"},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(num)
    ]


def write_jsonl(path: Path, rows: list[dict], trailing_newline: bool = True) -> Path:
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows)
    path.write_text(text + ("\n" if trailing_newline else ""), encoding="utf-8")
    return path


# --- GSM8K -------------------------------------------------------------------------------------


@needs_gsm8k
def test_gsm8k_real_lines_give_the_answer_after_hashes_without_commas():
    # Lines 1, 2, 346 and 5716 of train.jsonl: "#### 72", "#### 10", "#### 1,080", "#### -7".
    records = read_records(GSM8K_TRAIN, [0, 1, 345, 5715])
    assert [r.ground_truth for r in records] == ["72", "10", "1080", "-7"]
    first = records[0]
    assert first.data_source == "openai/gsm8k"
    assert first.uid == "train-0"
    assert first.messages[0]["role"] == "user"
    assert first.messages[0]["content"].startswith("Natalia sold clips to 48 of her friends")
    assert first.messages[0]["content"].endswith(" " + GSM8K_INSTRUCTION)
    assert first.extra_info["answer"].endswith("#### 72")


@needs_gsm8k
def test_gsm8k_count_and_seek_reads_equal_a_full_parse():
    lines = GSM8K_TRAIN.read_text(encoding="utf-8").splitlines()
    assert count_records(GSM8K_TRAIN) == len(lines) == 7473
    picks = [7472, 0, 4000, 123, 4000]
    records = read_records(GSM8K_TRAIN, picks)
    for i, record in zip(picks, records):
        row = json.loads(lines[i])
        assert record.messages[0]["content"] == f"{row['question']} {GSM8K_INSTRUCTION}"
        assert record.ground_truth == row["answer"].split("####")[1].strip().replace(",", "")


# --- jsonl byte ranges -------------------------------------------------------------------------


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_jsonl_seek_reads_equal_full_read_across_chunk_boundaries(tmp_path, monkeypatch, trailing_newline):
    rows = verl_rows(23)
    path = write_jsonl(tmp_path / "data.jsonl", rows, trailing_newline)
    # Blank lines are not records.
    path.write_text(path.read_text(encoding="utf-8").replace("\n", "\n\n", 3), encoding="utf-8")
    monkeypatch.setattr(sources, "_SCAN_CHUNK_BYTES", 7)  # many chunk boundaries inside lines
    sources._jsonl_line_spans.cache_clear()
    source = FileSource(path)
    assert source.num_records == 23
    assert source.read_rows(range(23)) == rows
    assert source.read_rows([22, 3, 3, 0]) == [rows[22], rows[3], rows[3], rows[0]]
    sources._jsonl_line_spans.cache_clear()


def test_jsonl_index_is_rebuilt_when_the_file_changes(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", verl_rows(3))
    assert count_records(path) == 3
    write_jsonl(path, verl_rows(5))
    os.utime(path, ns=(1, 1))
    assert count_records(path) == 5


def test_out_of_range_index_raises_index_error(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", verl_rows(3))
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        read_records(path, [3])


# --- verl schema: parquet and jsonl ------------------------------------------------------------


def test_verl_parquet_reads_only_the_row_groups_holding_requested_rows(tmp_path, monkeypatch):
    rows = verl_rows(20)
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    assert pq.ParquetFile(path).metadata.num_row_groups == 5

    groups_read: list[int] = []
    original = pq.ParquetFile.read_row_group

    def spy(self, i, *args, **kwargs):
        groups_read.append(i)
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    assert count_records(path) == 20
    assert groups_read == []  # counting uses metadata only
    records = read_records(path, [17, 5, 6])
    assert sorted(groups_read) == [1, 4]
    assert [r.ground_truth for r in records] == ["51", "15", "18"]
    assert records[1] == PromptRecord(
        uid="data-5",
        messages=({"role": "system", "content": "be brief"}, {"role": "user", "content": "q5 é?"}),
        ground_truth="15",
        data_source="openai/gsm8k",
        extra_info={"index": 5, "split": "train", "ability": "math"},
    )


def test_verl_schema_in_jsonl_gives_the_same_records_as_parquet(tmp_path):
    rows = verl_rows(9)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data.parquet", row_group_size=2)
    write_jsonl(tmp_path / "data.jsonl", rows)
    picks = [8, 0, 4]
    assert read_records(tmp_path / "data.parquet", picks) == read_records(tmp_path / "data.jsonl", picks)


def test_unknown_jsonl_schema_names_missing_keys_and_accepted_schemas(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"question": "q", "solution": "s"}])
    with pytest.raises(ValueError, match="missing keys") as err:
        read_records(path, [0])
    message = str(err.value)
    assert "'answer'" in message and "'reward_model'" in message and "gsm8k" in message and "verl" in message


def test_unknown_parquet_schema_is_rejected_from_metadata(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), path)
    with pytest.raises(ValueError, match="'data_source'"):
        FileSource(path)


def test_unknown_extension_is_rejected_with_the_accepted_ones(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"\.jsonl.*\.parquet"):
        FileSource(path)


def test_size_limits_a_file_source_to_its_first_records(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", verl_rows(10))
    source = open_source(path, size=4)
    assert source.num_records == 4
    with pytest.raises(IndexError):
        source.read([4])


# --- arithmetic task ---------------------------------------------------------------------------


def test_arithmetic_records_are_correct_and_deterministic():
    records = arithmetic_records(50, seed=7)
    assert records == arithmetic_records(50, seed=7)
    assert records != arithmetic_records(50, seed=8)
    for r in records:
        a, op, b = r.extra_info["a"], r.extra_info["op"], r.extra_info["b"]
        assert r.messages == ({"role": "user", "content": f"What is {a} {op} {b}? Answer with just the number."},)
        assert r.ground_truth == str(a + b if op == "+" else a - b)
        assert 10 <= a <= 99 and 10 <= b <= 99 and int(r.ground_truth) >= 0
        assert r.data_source == "arithmetic"
    assert {r.extra_info["op"] for r in records} == {"+", "-"}


def test_arithmetic_train_and_eval_never_share_a_problem():
    def problems(split):
        records = arithmetic_records(1500, 0, split=split)
        return {(r.extra_info["a"], r.extra_info["op"], r.extra_info["b"]) for r in records}

    train, held_out = problems("train"), problems("eval")
    assert train and held_out and not train & held_out
    assert all(problem_split(*p) == "eval" for p in held_out)


def test_arithmetic_difficulty_is_a_parameter():
    records = arithmetic_records(40, seed=1, min_operand=1, max_operand=9, ops=("*",))
    assert all(1 <= r.extra_info["a"] <= 9 and r.extra_info["op"] == "*" for r in records)
    assert all(r.ground_truth == str(r.extra_info["a"] * r.extra_info["b"]) for r in records)
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError, match="min_operand"):
        ArithmeticTask(min_operand=50, max_operand=10)


def test_arithmetic_source_reads_any_index_like_the_list():
    source = open_source("arithmetic", size=30, seed=3)
    assert isinstance(source, ArithmeticSource) and source.num_records == 30
    assert source.read([29, 2]) == [arithmetic_records(30, 3)[i] for i in (29, 2)]
    assert open_source("arithmetic:eval", size=5).read([0])[0].extra_info["split"] == "eval"


# --- sharded loader ----------------------------------------------------------------------------


class CountingSource:
    """Arithmetic source that records which indices were read."""

    def __init__(self, num_records: int):
        self.inner = ArithmeticSource(num_records=num_records, seed=0)
        self.read_indices: list[int] = []

    @property
    def num_records(self) -> int:
        return self.inner.num_records

    def read(self, indices):
        self.read_indices.extend(indices)
        return self.inner.read(indices)


def run_steps(num_records, batch_size, dp_size, num_steps, **kwargs):
    """uids per step, concatenated over dp ranks in rank order."""
    loaders = [ShardedPromptLoader(CountingSource(num_records), batch_size, r, dp_size, seed=11, **kwargs)
               for r in range(dp_size)]
    return [[rec.uid for loader in loaders for rec in loader.next_batch()] for _ in range(num_steps)]


@pytest.mark.parametrize("dp_size", [2, 4])
def test_union_over_dp_ranks_equals_the_single_rank_batch(dp_size):
    # 7 steps of 8 over 26 records cross two epoch boundaries.
    assert run_steps(26, 8, dp_size, 7) == run_steps(26, 8, 1, 7)


def test_each_rank_reads_only_its_contiguous_part():
    source = CountingSource(40)
    loader = ShardedPromptLoader(source, batch_size=8, dp_rank=1, dp_size=4, seed=5)
    batch = loader.next_batch()
    expected = epoch_permutation(40, 5, 0)[2:4].tolist()
    assert source.read_indices == expected
    assert [r.uid for r in batch] == [f"arithmetic-train-0-{i}" for i in expected]


def test_epochs_roll_over_with_a_fresh_permutation():
    source = CountingSource(10)
    loader = ShardedPromptLoader(source, batch_size=4, dp_rank=0, dp_size=1, seed=0)
    assert loader.steps_per_epoch == 2
    loader.next_batch()
    loader.next_batch()
    assert loader.state_dict() == {"epoch": 0, "offset": 8}
    loader.next_batch()  # the 2 leftover records of epoch 0 are dropped
    assert loader.state_dict() == {"epoch": 1, "offset": 4}
    perm0, perm1 = epoch_permutation(10, 0, 0), epoch_permutation(10, 0, 1)
    assert source.read_indices == perm0[:8].tolist() + perm1[:4].tolist()
    assert not np.array_equal(perm0, perm1)
    assert sorted(perm1.tolist()) == list(range(10))


def test_without_drop_last_the_last_batch_is_filled_from_the_epoch_start():
    loader = ShardedPromptLoader(CountingSource(10), batch_size=4, dp_rank=0, dp_size=2, seed=0, drop_last=False)
    assert loader.steps_per_epoch == 3
    perm = epoch_permutation(10, 0, 0).tolist()
    seen = []
    for _ in range(3):
        seen.append(loader.next_global_indices().tolist())
        loader.next_batch()
    assert seen[2] == perm[8:10] + perm[0:2]
    assert sorted(set(sum(seen, []))) == list(range(10))
    loader.next_batch()
    assert loader.state_dict() == {"epoch": 1, "offset": 4}


@pytest.mark.parametrize("resume_dp_size", [1, 2])
def test_restored_state_continues_the_same_stream(resume_dp_size):
    reference = run_steps(22, 4, 2, 9)
    loaders = [ShardedPromptLoader(CountingSource(22), 4, r, 2, seed=11) for r in range(2)]
    for _ in range(4):
        for loader in loaders:
            loader.next_batch()
    state = loaders[0].state_dict()
    assert state == loaders[1].state_dict()
    resumed = [ShardedPromptLoader(CountingSource(22), 4, r, resume_dp_size, seed=11) for r in range(resume_dp_size)]
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [[rec.uid for loader in resumed for rec in loader.next_batch()] for _ in range(5)]
    assert rest == reference[4:]


def test_loader_rejects_batch_size_not_divisible_by_dp_size():
    with pytest.raises(ValueError, match="multiple of 4 .e.g. 8 or 12"):
        ShardedPromptLoader(CountingSource(100), batch_size=10, dp_rank=0, dp_size=4, seed=0)


def test_loader_rejects_a_dataset_smaller_than_one_batch():
    with pytest.raises(ValueError, match="3 records, fewer than one batch"):
        ShardedPromptLoader(CountingSource(3), batch_size=4, dp_rank=0, dp_size=1, seed=0)


def test_loader_rejects_bad_state():
    loader = ShardedPromptLoader(CountingSource(8), batch_size=4, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="out of range"):
        loader.load_state_dict({"epoch": 0, "offset": 500})


def test_loader_reads_a_jsonl_file_by_path(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", verl_rows(12))
    whole = ShardedPromptLoader(path, batch_size=4, dp_rank=0, dp_size=1, seed=2).next_batch()
    halves = [ShardedPromptLoader(path, batch_size=4, dp_rank=r, dp_size=2, seed=2).next_batch() for r in range(2)]
    assert halves[0] + halves[1] == whole
