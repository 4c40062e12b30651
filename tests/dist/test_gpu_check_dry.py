"""The prepared GPU script's dry run: every part on CPU at toy size, so it cannot rot.

``python -m tests.bench.gpu_check --device cpu --quick`` runs what a lent GPU
runs (exchange with its content check, shared-prompt attention, two GRPO runs
through the local launcher, the vLLM hook) on gloo and CPU tensors, and
writes the same files. The values asserted hold on any device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.bench, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]


def test_every_part_of_the_gpu_check_runs_on_cpu(tmp_path):
    subprocess.run([sys.executable, "-m", "tests.bench.gpu_check", "--device", "cpu", "--quick",
                    "--out-dir", str(tmp_path), "--budget-s", "3000"],
                   cwd=REPO, env={**os.environ, "OUT": ""}, check=True, timeout=1700)
    (json_file,) = tmp_path.glob("gpu-*-dry.json")
    assert json_file.with_suffix(".md").is_file()
    result = json.loads(json_file.read_text())
    failed = {name: part for name, part in result.items() if isinstance(part, dict) and "error" in part}
    assert not failed, failed

    exchange = result["exchange"]
    assert exchange["content_ok"] and exchange["world_size"] == 2
    (row,) = exchange["rows"]
    assert row["mismatched_samples"] == 0
    assert row["node_buffer_bytes"] > 0  # CPU batches hand same-node pieces over in shared memory

    (attention,) = result["shared_attention"]["rows"]
    assert attention["max_abs_lp_diff"]["dense"] <= 1e-5
    assert attention["max_abs_grad_diff"]["dense"] <= 1e-4

    for name in ("smollm2", "large"):
        run = result["grpo"][name]
        assert "error" not in run and "skipped" not in run, run
        assert len(run["steps"]) == 2 and run["tokens_per_s"] > 0
    assert result["grpo"]["large"]["parameters"] > 0
    assert "vllm" in result
