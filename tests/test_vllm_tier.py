"""Run the `vllm` tier (tests/vllm) in its own environment: the venv .ci/setup-vllm builds.

vLLM's CPU build pins a torch other than the main venv's, so its tests cannot run in this
interpreter. DISTFLOW_VLLM_PYTHON names that venv's python, else .venv/bin/python-vllm (the link
.ci/setup --tests makes); without either the tier is skipped, saying how to get it.
"""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3900)]

TIER_TIMEOUT_S = 3600
"""The default tier (`-m "not long"`) took 585 s of a 47-min CI run on 2 cores before the 8-step
learning run and the asynchronous vLLM run moved to `long`: now the engine's parity checks, a
2-step colocated GRPO run (every step synced, log-probs close to the actor's) and the colocated
multi-turn rounds (406 s on 2 AVX2 cores with the rollout pool's isolated-engine syncs, which then
moved to `long` too). Its `long` tests (those two runs, the isolated engine's syncs and multi-turn
rounds, the calculator example end to end, a 2-worker uneven-turns run; ~14 min more) are opt-in:
`.venv/bin/python-vllm -m pytest -m long tests/vllm`. The limit is
generous for a loaded machine; the tier's slowest phases are listed under "figures"."""

REPO = Path(__file__).resolve().parents[1]


def test_vllm_tier_passes_in_its_own_venv(report_figure):
    python = os.environ.get("DISTFLOW_VLLM_PYTHON")
    if not python and (REPO / ".venv/bin/python-vllm").exists():
        python = str(REPO / ".venv/bin/python-vllm")
    if not python:
        pytest.skip("no vllm tier env: run `bash .ci/setup --tests` (it links .venv/bin/python-vllm), or set "
                    "DISTFLOW_VLLM_PYTHON to the python of the venv `bash .ci/setup-vllm` prints")
    if not Path(python).is_file():
        pytest.fail(f"DISTFLOW_VLLM_PYTHON={python} does not exist; rerun .ci/setup-vllm")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable here: tests/vllm run directly in this interpreter")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "operator")])}
    try:
        proc = subprocess.run([python, "-m", "pytest", "-x", "-v", "-p", "no:cacheprovider", "-m", "not long",
                               "--durations=0", "--durations-min=5", "tests/vllm"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=TIER_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        pytest.fail(f"tests/vllm did not finish in {TIER_TIMEOUT_S} s in {python}; its output so far:\n{out[-6000:]}")
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"tests/vllm failed in {python}:\n{tail}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1], tail
    for line in _durations(proc.stdout):  # the tier's own slowest phases, in this run's summary
        report_figure(f"vllm tier: {line}")


def _durations(out: str) -> list[str]:
    """The lines of pytest's ``slowest durations`` section in ``out`` (``12.34s call tests/...``)."""
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if "slowest" in line and "durations" in line), None)
    if start is None:
        return []
    return [line.strip() for line in lines[start + 1:] if line.strip() and line.split()[0].endswith("s")
            and line.split()[0][:-1].replace(".", "", 1).isdigit()]
