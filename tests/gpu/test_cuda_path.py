"""The CUDA path: NCCL redistribution and one training step on the GPU (skipped without CUDA).

Runs the prepared device check (tests/bench/gpu_check.py) and asserts what it
measured: the device-to-device copy bandwidth, the redistribution over NCCL
(when two or more GPUs are visible) and a finished FSDP2 step on CUDA.
"""

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def test_gpu_check_measures_copy_redistribution_and_a_training_step():
    from tests.bench import gpu_check

    out = gpu_check.run()
    assert "skipped" not in out, out
    assert out["device_copy"]["d2d_bytes_per_s"] > 0
    assert out["pack"]
    if "skipped" not in out["redistribution"]:
        assert out["redistribution"]["rows"]
    assert len(out["train_step"]["steps"]) == 2 and out["train_step"]["wall_seconds"] > 0
