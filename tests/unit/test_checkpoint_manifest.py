"""The checkpoint manifest, the completeness rule and pruning, on hand-made directories (no processes).

A directory is a complete checkpoint only if its manifest (written last)
lists trainer.json and .metadata and every listed file has the listed size
and sha256; keepLast prunes only complete checkpoints older than the newest.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from distflow import chaos, checkpoint, sample_ids
from distflow.data.loader import ShardedPromptLoader

pytestmark = pytest.mark.unit


def _write_checkpoint(root, step, with_manifest=True):
    name = f"step_{step:08d}"
    d = root / name
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta" * step)
    (d / "__0_0.distcp").write_bytes(bytes(range(100)) * step)
    (d / "trainer.json").write_text(json.dumps({"step": step}))
    if with_manifest:
        store = checkpoint._Store(root)
        manifest = checkpoint._build_manifest(store, name, step)
        (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_manifest_holds_size_and_sha256_of_every_file(tmp_path):
    d = _write_checkpoint(tmp_path, 2)
    files = json.loads((d / "manifest.json").read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "trainer.json"]
    assert files[".metadata"] == {  # sha256sum of "metameta"
        "size": 8, "sha256": "5ca6f2f5858050415d401261988955d7e53ebe50eeac08a6b3f5dd0ef04f3b41"}
    assert files["__0_0.distcp"]["size"] == 200


def test_only_checkpoints_their_manifest_vouches_for_are_complete(tmp_path):
    _write_checkpoint(tmp_path, 1)
    _write_checkpoint(tmp_path, 2, with_manifest=False)  # killed before its commit
    torn = _write_checkpoint(tmp_path, 3)
    (torn / "__0_0.distcp").write_bytes(b"short")
    corrupt = _write_checkpoint(tmp_path, 4)
    data = bytearray((corrupt / "__0_0.distcp").read_bytes())
    data[7] ^= 1
    (corrupt / "__0_0.distcp").write_bytes(bytes(data))
    broken = _write_checkpoint(tmp_path, 5)
    (broken / "manifest.json").write_text('{"files": {"trainer.js')
    _write_checkpoint(tmp_path, 6)
    (tmp_path / "step_00000006" / "trainer.json").rename(tmp_path / "step_00000007.tmp")
    store = checkpoint._Store(tmp_path)
    assert checkpoint.verify(store, "step_00000001") is None
    assert checkpoint.verify(store, "step_00000002") == "no manifest (its write did not finish)"
    assert checkpoint.verify(store, "step_00000003") == "__0_0.distcp has 5 bytes, the manifest says 300"
    assert checkpoint.verify(store, "step_00000004") == \
        "__0_0.distcp does not match its sha256 in the manifest (corrupt)"
    assert checkpoint.verify(store, "step_00000004", checksums=False) is None  # the cheap check
    assert checkpoint.verify(store, "step_00000005") == "its manifest is torn or unreadable"
    assert checkpoint.verify(store, "step_00000006") == "trainer.json is missing"
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path, checksums=True)] == ["step_00000001"]


def test_keep_last_prunes_only_older_complete_checkpoints(tmp_path):
    for step in (1, 2):
        _write_checkpoint(tmp_path, step)
    _write_checkpoint(tmp_path, 3, with_manifest=False)
    store = checkpoint._Store(tmp_path)
    checkpoint._prune(store, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    checkpoint._prune(store, keep_last=0)  # never below one: the newest complete checkpoint stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]


def test_disk_full_message_names_the_intact_checkpoint_and_the_fix(tmp_path):
    _write_checkpoint(tmp_path, 4)
    err = OSError(28, "No space left on device")
    message = checkpoint._failure_message(checkpoint._Store(tmp_path), 6, err)
    assert message.startswith(f"checkpoint.dir {tmp_path}: writing the step-6 checkpoint failed: the disk is full")
    assert "the step-4 checkpoint is intact" in message and "free space" in message


def test_chaos_spec_is_parsed_and_checked():
    assert chaos.parse("rank=1,event=exchange,count=3,target=launcher") == \
        {"rank": 1, "event": "exchange", "count": 3, "target": "launcher"}
    with pytest.raises(ValueError, match="choose one of forward, exchange, optimizer, checkpoint"):
        chaos.parse("event=backward")


def test_trained_ids_map_group_indices_to_records_across_refill_rounds(tmp_path):
    rounds = [np.array([7, 3, 9, 1]), np.array([4, 0, 2, 8])]
    # step 2 of 5, batch 4: round 0 numbers prompts 8..11, refill round 1 numbers 28..31
    assert sample_ids.record_ids([9, 9, 11, 29, 30], 2, 4, 5, rounds) == [3, 3, 1, 0, 2]
    for step in (1, 2, 3):
        sample_ids.append(tmp_path, step, [step])
    sample_ids.drop_after(tmp_path, 2)
    assert sample_ids.read(tmp_path) == {1: [1], 2: [2]}


def test_loader_hands_out_the_global_batches_it_read(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(8)))
    loader = ShardedPromptLoader(str(path), batch_size=4, dp_rank=1, dp_size=2, seed=0, shuffle=False)
    loader.next_batch()
    loader.next_batch()
    assert [b.tolist() for b in loader.take_read_batches()] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert loader.take_read_batches() == []


def test_hash_shares_spread_the_bytes_over_the_ranks_largest_first():
    sizes = {"__0_0.distcp": 800, "__1_0.distcp": 810, ".metadata": 5, "rank_00000.pt": 2, "rank_00001.pt": 2,
             "trainer.json": 1}
    assert checkpoint.hash_shares(sizes, 2) == [
        ["__1_0.distcp"], ["__0_0.distcp", ".metadata", "rank_00000.pt", "rank_00001.pt", "trainer.json"]]
    assert checkpoint.hash_shares(sizes, 4) == [
        ["__1_0.distcp"], ["__0_0.distcp"], [".metadata"], ["rank_00000.pt", "rank_00001.pt", "trainer.json"]]
    assert checkpoint.hash_shares(sizes, 1) == [sorted(sizes, key=lambda r: (-sizes[r], r))]
    assert checkpoint.hash_shares({}, 3) == [[], [], []]
