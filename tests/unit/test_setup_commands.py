"""README's two commands and the scripts behind them agree: the first sets up only what training
needs, the test command is what CI runs, and the cached venv's key ignores edits of .ci/setup."""

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_readmes_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    tests_section = readme[readme.index("## Tests"):]
    assert tests_section.split("\n\n")[1].strip() == "bash .ci/run"
    run = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^bash \.ci/setup --tests$", run, re.M) and "\n.venv/bin/python -m pytest\n" in run


def test_default_setup_stops_before_the_test_tiers():
    code = "\n".join(line for line in (REPO / ".ci" / "setup").read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    stop = code.index('[ "$TESTS" = 1 ] || exit 0')
    for tier_step in ("setup-vllm", "tests/controlplane/build.sh", "build_kueue.sh", "apt-get install"):
        assert code.index(tier_step) > stop, tier_step


def test_the_venv_key_hashes_the_lock_and_the_venv_script_only(tmp_path):
    script = (REPO / ".ci" / "setup-venv").read_text()
    (key_line,) = [line for line in script.splitlines() if line.startswith("KEY=")]
    assert key_line == "KEY=$(cat pyproject.toml requirements.lock .ci/setup-venv | sha256sum | cut -c1-16)"
    bad = subprocess.run(["bash", str(REPO / ".ci" / "setup"), "--everything"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert bad.returncode == 1
    assert "setup: failed: unknown argument --everything (usage: bash .ci/setup [--tests])" in bad.stderr
