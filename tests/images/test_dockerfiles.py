"""The Dockerfiles lint clean and their install steps work in a clean environment (no engine needed)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.images, pytest.mark.timeout(1200)]


def test_dockerfiles_lint_and_install_steps_work():
    script = Path(__file__).with_name("check_install.py")
    proc = subprocess.run([sys.executable, str(script), "--skip-vllm"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " 0 failed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
