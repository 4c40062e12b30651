"""Checkpoints are complete only when their manifest (written last) vouches for every file.

- the manifest lists every file with its size and sha256;
- a torn checkpoint (a shard cut short) or a partial one (no manifest) is
  never loaded: resume says so and takes the previous one;
- keepLast never deletes the only complete checkpoint, and clears partial ones;
- a full disk while writing fails on every rank with a message that says so,
  and leaves the previous checkpoint intact and loadable (on a real tmpfs).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess

import pytest
import torch

from tests.dist._ckpt_worker import fake_worker, params
from tests.dist._spawn import run_on_ranks

pytestmark = pytest.mark.dist


def _save(rank, world, root, steps, keep_last, width=32):
    from distflow import checkpoint

    errors = []
    for step in steps:
        try:
            checkpoint.save(root, step, fake_worker(width, seed=step), keep_last)
        except checkpoint.CheckpointError as err:
            errors.append(str(err))
    return errors


def _load(rank, world, root, width=32):
    from distflow import checkpoint

    worker = fake_worker(width, seed=99)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        step = checkpoint.load_latest(root, worker)
    return step, params(worker), worker.loader.state_dict(), out.getvalue()


def _names(root):
    return sorted(os.listdir(root))


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    root = str(tmp_path / "ckpt")
    run_on_ranks(_save, 2, root, [1], 3)
    step_dir = tmp_path / "ckpt" / "step_00000001"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    on_disk = {p.name for p in step_dir.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert {"trainer.json", ".metadata", "rank_00000.pt", "rank_00001.pt"} <= on_disk
    for name, entry in manifest["files"].items():
        data = (step_dir / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manifest["step"] == 1


def test_torn_and_partial_checkpoints_are_skipped_for_the_previous_one(tmp_path):
    root = tmp_path / "ckpt"
    run_on_ranks(_save, 2, str(root), [1, 2, 3], 5)
    shard = next(p for p in (root / "step_00000003").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-7])  # torn: cut short
    (root / "step_00000002" / "manifest.json").unlink()  # partial: the commit never happened
    shutil.copytree(root / "step_00000001", root / "step_00000004.tmp")  # a write in progress
    results = run_on_ranks(_load, 2, str(root))
    expected = params(fake_worker(seed=1))
    for step, loaded, loader_state, _ in results:
        assert step == 1 and loader_state == {"epoch": 0, "offset": 4}
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key
    said = results[0][3]
    assert f"skipping checkpoint {root}/step_00000003: {shard.name} has" in said
    assert f"skipping checkpoint {root}/step_00000002: no manifest" in said
    assert "step_00000004" not in said and results[1][3] == ""  # rank 0 decides and speaks


def test_corrupt_shard_of_the_right_size_is_caught_by_its_checksum(tmp_path):
    root = tmp_path / "ckpt"
    run_on_ranks(_save, 2, str(root), [1, 2], 5)
    shard = next(p for p in (root / "step_00000002").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    step, _, _, said = run_on_ranks(_load, 2, str(root))[0]
    assert step == 1 and "does not match its sha256" in said


def test_keep_last_never_deletes_the_only_complete_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    run_on_ranks(_save, 2, str(root), [1], 1)
    shutil.copytree(root / "step_00000001", root / "step_00000002")
    (root / "step_00000002" / "manifest.json").unlink()  # partial (an object store's in-place write)
    run_on_ranks(_save, 2, str(root), [3], 1)
    assert _names(root) == ["step_00000003"]  # the partial one went, the older complete one was pruned
    assert run_on_ranks(_load, 2, str(root))[0][0] == 3


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1.5 MiB tmpfs: room for one checkpoint of the 256-wide model (~0.8 MiB), not two."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_disk_full_fails_clearly_and_keeps_the_previous_checkpoint(small_tmpfs):
    root = small_tmpfs / "ckpt"
    errors = run_on_ranks(_save, 2, str(root), [1, 2], 2, 256)
    assert errors[0] == errors[1] and len(errors[0]) == 1  # both ranks fail, at step 2, with one message
    message = errors[0][0]
    assert "writing the step-2 checkpoint failed: the disk is full" in message
    assert "the step-1 checkpoint is intact" in message and "free space" in message
    assert _names(root) == ["step_00000001"]  # the partial step 2 is gone, step 1 untouched
    step, loaded, _, said = run_on_ranks(_load, 2, str(root), 256)[0]
    assert step == 1 and said == ""
    for key, value in params(fake_worker(256, seed=1)).items():
        assert torch.equal(loaded[key], value), key
