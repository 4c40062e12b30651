"""README's first command on a cold cache: what a new user runs first.

The machine's own cache (``~/.cache/distflow``) hides first-run failures: a
setup that only ever finds its venv built never runs the code that builds it.
This test runs README's first command (``bash .ci/setup && .venv/bin/distflow
run examples/quickstart.yaml``) in a copy of this checkout against an empty
``DISTFLOW_CACHE`` (uv's download cache is reused, so no wheel is fetched
twice), timing each half: setup must build the Python environment and nothing
of the test tiers (no Go builds, no vLLM environment), and the quickstart,
cut to one step without its held-out evaluations to keep the default run
short, must convert the model into the empty cache, train and print its step
line into a log file (no terminal). The venv it made holds every locked package at the
lock's version. A second setup, with two older venvs planted in the cache,
checks the pruning keeps this venv and the newest other.
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


README_FIRST_COMMAND = "bash .ci/setup && .venv/bin/distflow run examples/quickstart.yaml"
SETUP_LIMIT_S = 600  # README says about 2 min; what a new user waits before training starts, at most
QUICKSTART_CUT = ["--set", "trainer.totalSteps=1", "--set", "data.eval=null"]


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["DISTFLOW_CACHE"] = str(cache)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return env


def _setup(clone: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", ".ci/setup"], cwd=clone, env=_env(cache), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)


def _quickstart(clone: Path, cache: Path) -> tuple[int, str]:
    """README's quickstart, cut short, with stdout to a file as under nohup or CI: (exit code, log)."""
    log = clone / "run.log"
    with open(log, "w") as out:
        code = subprocess.run([".venv/bin/distflow", "run", "examples/quickstart.yaml", *QUICKSTART_CUT],
                              cwd=clone, env=_env(cache), stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL).returncode
    return code, log.read_text()


def test_readmes_first_command_on_an_empty_cache_trains_within_minutes(tmp_path: Path):
    assert README_FIRST_COMMAND in (REPO / "README.md").read_text()
    clone, cache = tmp_path / "clone", tmp_path / "cache"
    clone.mkdir()
    cache.mkdir()
    _copy_checkout(clone)

    started = time.monotonic()
    first = _setup(clone, cache)
    setup_s = time.monotonic() - started
    output = first.stdout + first.stderr
    assert first.returncode == 0, f"cold setup failed:\n{first.stdout[-3000:]}\n{first.stderr[-3000:]}"
    assert "setup: creating" in output, output  # it really built a venv
    assert "setup: python env ready at .venv" in first.stdout, first.stdout
    # Only what training needs: nothing of the test tiers.
    assert "control plane" not in output and "vllm" not in output, output
    assert not (clone / ".venv/bin/python-vllm").exists()
    assert setup_s < SETUP_LIMIT_S, f"cold setup took {setup_s:.0f} s"

    started = time.monotonic()
    code, log = _quickstart(clone, cache)
    quickstart_s = time.monotonic() - started
    assert code == 0, log[-3000:]
    assert "step:1/1 - critic/score/mean:" in log, log[-3000:]
    assert (cache / "models").is_dir()  # the model was converted into the empty cache
    print(f"README's first command on an empty cache: setup {setup_s:.0f} s, quickstart (1 step) {quickstart_s:.0f} s")
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
    assert "setup: creating" not in second.stdout + second.stderr  # warm: nothing installed
    assert sorted(p.name for p in cache.glob("venv-*")) == sorted([venvs[0].name, "venv-older"])
