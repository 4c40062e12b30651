"""The previous release's spec package, from git history, importable beside today's.

The version-skew contract (docs/operations.md, Upgrade) says a worker image of
release N-1 reads what the operator of release N renders. Tests hold today's
operator to it with the ``distflow.spec`` package of an older commit, imported
as ``distflow_prev.spec``.
"""

from __future__ import annotations

import importlib
import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
PREVIOUS_RELEASE = "081279f"
"""The operator-faults release of 2 December: its spec lacks data.truncation,
rollout.gpuMemoryUtilization and rollout.weightSyncBucketMb, and rejects them as unknown fields."""


def previous_spec_package(directory: Path) -> ModuleType:
    """``distflow.spec`` as of PREVIOUS_RELEASE, unpacked under ``directory``; skips the test when
    the clone lacks that commit (a shallow clone)."""
    try:
        raw = subprocess.run(["git", "archive", PREVIOUS_RELEASE, "worker_image/distflow"], cwd=REPO,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"commit {PREVIOUS_RELEASE} is not in this clone's history (a shallow clone?)")
    with tarfile.open(fileobj=io.BytesIO(raw)) as archive:
        for member in archive.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                target = directory / "distflow_prev" / member.name.removeprefix("worker_image/distflow/")
                target.parent.mkdir(parents=True, exist_ok=True)
                text = archive.extractfile(member).read().decode()
                target.write_text(re.sub(r"\b(from|import) distflow\b", r"\1 distflow_prev", text))
    sys.path.insert(0, str(directory))
    try:
        return importlib.import_module("distflow_prev.spec")
    finally:
        sys.path.remove(str(directory))
