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
from pathlib import Path

import pytest
import torch

from tests.dist._ckpt_worker import fake_worker, params
from tests.dist._spawn import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1800)]


def _save(steps, keep_last, width):
    from distflow import checkpoint

    errors = []
    for step in steps:
        try:
            checkpoint.save(ROOT[0], step, fake_worker(width, seed=step), keep_last)
        except checkpoint.CheckpointError as err:
            errors.append(str(err))
    return errors


def _load(width):
    from distflow import checkpoint

    worker = fake_worker(width, seed=99)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        step = checkpoint.load_latest(ROOT[0], worker)
    return step, params(worker), worker.loader.state_dict(), out.getvalue()


ROOT = [""]


def _scenario(rank, world, root, steps, keep_last, damage=None, width=32):
    """One spawn per test (starting processes is the slow part): save ``steps``, let rank 0 apply
    ``damage(root)`` (``"module:function"``), then load. Returns (save errors, load result)."""
    import importlib

    import torch.distributed as dist

    ROOT[0] = root
    errors = _save(steps, keep_last, width)
    if damage and rank == 0:
        module, _, name = damage.partition(":")
        getattr(importlib.import_module(module), name)(root)
    dist.barrier()
    return errors, _load(width)


def _names(root):
    return sorted(os.listdir(root))


def test_manifest_lists_every_file_and_keep_last_never_deletes_the_only_complete_one(tmp_path):
    root = tmp_path / "ckpt"
    (root / "step_00000002").mkdir(parents=True)  # partial (an object store's in-place write): no manifest
    (root / "step_00000002" / ".metadata").write_bytes(b"x")
    errors, (step, _, _, said) = run_on_ranks(_scenario, 2, str(root), [1, 3], 1, timeout_s=600)[0]
    assert errors == [] and step == 3 and said == ""
    assert _names(root) == ["step_00000003"]  # the partial one went, the older complete one was pruned
    step_dir = root / "step_00000003"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    on_disk = {p.name for p in step_dir.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and manifest["step"] == 3
    assert {"trainer.json", ".metadata", "rank_00000.pt", "rank_00001.pt"} <= on_disk
    for name, entry in manifest["files"].items():
        data = (step_dir / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _tear_corrupt_and_cut(root: str) -> None:
    root = Path(root)
    shard = sorted(p for p in (root / "step_00000004").iterdir() if p.suffix == ".distcp")[-1]
    shard.write_bytes(shard.read_bytes()[:-7])  # torn: cut short
    shard = sorted(p for p in (root / "step_00000003").iterdir() if p.suffix == ".distcp")[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # corrupt, same size
    shard.write_bytes(bytes(data))
    (root / "step_00000002" / "manifest.json").unlink()  # partial: the commit never happened
    shutil.copytree(root / "step_00000001", root / "step_00000005.tmp")  # a write in progress


def test_torn_corrupt_and_partial_checkpoints_are_skipped_for_the_previous_one(tmp_path):
    root = tmp_path / "ckpt"
    results = run_on_ranks(_scenario, 2, str(root), [1, 2, 3, 4], 5, f"{__name__}:_tear_corrupt_and_cut", timeout_s=600)
    expected = params(fake_worker(seed=1))
    for errors, (step, loaded, loader_state, _) in results:
        assert errors == [] and step == 1 and loader_state == {"epoch": 0, "offset": 4}
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key
    said = results[0][1][3].splitlines()
    assert len(said) == 3 and results[1][1][3] == ""  # rank 0 decides and says why, once
    assert said[0].startswith(f"distflow: skipping checkpoint {root}/step_00000004: __1_0.distcp has ")
    assert said[1] == (f"distflow: skipping checkpoint {root}/step_00000003: __1_0.distcp does not match its "
                       "sha256 in the manifest (corrupt); trying the previous one")
    assert said[2].startswith(f"distflow: skipping checkpoint {root}/step_00000002: no manifest")


def _corrupt_the_only_one(root: str) -> None:
    shard = sorted(p for p in (Path(root) / "step_00000001").iterdir() if p.suffix == ".distcp")[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_when_no_checkpoint_is_left_resume_says_training_starts_from_step_0(tmp_path):
    root = tmp_path / "ckpt"
    results = run_on_ranks(_scenario, 2, str(root), [1], 5, f"{__name__}:_corrupt_the_only_one", timeout_s=600)
    for errors, (step, _, loader_state, _) in results:
        assert errors == [] and step == 0 and loader_state == {"epoch": 0, "offset": 4 * 99}  # untouched
    assert results[0][1][3] == (f"distflow: skipping checkpoint {root}/step_00000001: __1_0.distcp does not match "
                                "its sha256 in the manifest (corrupt); no other checkpoint is left: training "
                                "starts from step 0\n")


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
    results = run_on_ranks(_scenario, 2, str(root), [1, 2], 2, None, 256, timeout_s=600)
    (errors, (step, loaded, _, said)), (other_errors, _) = results
    assert errors == other_errors and len(errors) == 1  # both ranks fail, at step 2, with one message
    assert "writing the step-2 checkpoint failed: the disk is full" in errors[0]
    assert "the step-1 checkpoint is intact" in errors[0] and "free space" in errors[0]
    assert _names(root) == ["step_00000001"]  # the partial step 2 is gone, step 1 untouched
    assert step == 1 and said == ""
    for key, value in params(fake_worker(256, seed=1)).items():
        assert torch.equal(loaded[key], value), key
