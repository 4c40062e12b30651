"""`.ci/setup` on a cold cache: what a new user's first command runs.

The machine's own cache (``~/.cache/distflow``) hides first-run failures: a
setup that only ever finds its venv built never runs the code that builds it.
This test runs the setup script of this checkout, copied to a fresh folder,
against an empty ``DISTFLOW_CACHE`` (the control plane skipped; uv's download
cache is reused, so no wheel is fetched twice and it takes about a minute),
then checks the ``.venv`` it made: ``distflow --help`` runs and every locked
package is installed at the lock's version. A second run, with two older venvs
planted in the cache, checks the pruning keeps this venv and the newest other.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.images, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]


def _copy_checkout(dest: Path) -> None:
    """The files git tracks or would track (what a clone of this working tree holds)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _setup(clone: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(DISTFLOW_CACHE=str(cache), DISTFLOW_SKIP_CONTROLPLANE="1")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return subprocess.run(["bash", ".ci/setup"], cwd=clone, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)


def test_setup_on_an_empty_cache_makes_a_working_venv(tmp_path: Path):
    clone, cache = tmp_path / "clone", tmp_path / "cache"
    clone.mkdir()
    cache.mkdir()
    _copy_checkout(clone)

    first = _setup(clone, cache)
    assert first.returncode == 0, f"cold setup failed:\n{first.stdout[-3000:]}\n{first.stderr[-3000:]}"
    assert "setup: creating" in first.stdout, first.stdout  # it really built a venv
    assert "setup: python env ready at .venv" in first.stdout, first.stdout
    venvs = sorted(cache.glob("venv-*"))
    assert len(venvs) == 1 and (venvs[0] / ".complete").is_file(), venvs

    cli = subprocess.run([str(clone / ".venv/bin/distflow"), "--help"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert "run" in cli.stdout and "plan" in cli.stdout, cli.stdout

    # The venv holds the lock's versions (tests/unit/test_lock.py, run by the venv it checks).
    lock = subprocess.run([str(clone / ".venv/bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/unit/test_lock.py"], cwd=clone, capture_output=True, text=True)
    assert lock.returncode == 0, lock.stdout[-3000:] + lock.stderr[-2000:]

    # Two older venvs: setup keeps its own and the newest other one, removes the oldest.
    older, oldest = cache / "venv-older", cache / "venv-oldest"
    for i, stale in enumerate((oldest, older)):
        stale.mkdir()
        (stale / ".complete").touch()
        stamp = time.time() - 3600 * (2 - i)
        os.utime(stale / ".complete", (stamp, stamp))
    second = _setup(clone, cache)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "setup: creating" not in second.stdout  # warm: nothing installed
    assert sorted(p.name for p in cache.glob("venv-*")) == sorted([venvs[0].name, "venv-older"])
