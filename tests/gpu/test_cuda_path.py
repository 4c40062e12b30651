"""The CUDA path at toy size (skipped without CUDA): the GPU check's parts on the tiny model.

The full measurement, with its verdict per part, is ``python3 -m tests.bench.gpu_check``
(docs/benchmarks.md); these run its parts with the tiny model so that a CUDA
machine with pytest finds a broken part in a minute.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _ctx(tmp_path):
    from tests.bench import gpu_check

    return gpu_check.Context(torch.device("cuda", 0), torch.cuda.get_device_name(0), tmp_path)


def test_update_on_cuda_lowers_the_loss_and_token_budgets_keep_the_gradients(tmp_path):
    from tests.bench import gpu_check, gpu_update

    ctx = _ctx(tmp_path)
    out = gpu_check._single_rank(lambda: gpu_update.update_check(ctx.device, "tiny", ctx.device_name), ctx.device)
    assert out["status"] == "pass", out["checks"]
    assert out["peak_device_bytes"] > 0


@pytest.mark.parametrize("workflow", ["grpo", "dapo", "ppo"])
def test_a_job_step_runs_on_cuda(workflow, tmp_path):
    from tests.bench import gpu_runs

    out = gpu_runs.job_check(torch.device("cuda", 0), "tiny", workflow, 1, tmp_path)
    assert out["status"] == "pass", out


def test_resume_on_cuda_is_bit_identical(tmp_path):
    from tests.bench import gpu_runs

    out = gpu_runs.resume_check(torch.device("cuda", 0), tmp_path)
    assert out["status"] == "pass", out["checks"]
