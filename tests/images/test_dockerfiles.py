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


def _apt_packages(stage_name: str, stages) -> set[str]:
    """Packages ``apt-get install`` adds in a stage and the stages it is built FROM."""
    by_name = {stage.name: stage for stage in stages}
    packages: set[str] = set()
    stage = by_name[stage_name]
    while stage is not None:
        for command, _ in stage.runs:
            for part in command.split("&&"):
                words = part.split()
                if words[:2] == ["apt-get", "install"]:
                    packages.update(w for w in words[2:] if not w.startswith("-"))
        stage = by_name.get(stage.base)
    return packages


def test_worker_runtime_stage_installs_a_c_compiler_and_python_headers():
    """Triton (FlexAttention under torch.compile, vLLM) builds its launchers at run time:
    it needs gcc or clang and Python.h in the image that runs the workers."""
    from tests.images.check_install import parse_dockerfile

    parsed = parse_dockerfile(Path(__file__).resolve().parents[2] / "worker_image" / "Dockerfile")
    packages = _apt_packages(parsed.stages[-1].name, parsed.stages)
    assert packages & {"gcc", "clang", "build-essential"}, packages
    assert packages & {"python3-dev", "python3.12-dev", "libpython3-dev"}, packages
