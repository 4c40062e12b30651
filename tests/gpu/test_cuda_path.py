"""The CUDA path at toy size (skipped without CUDA): the prepared check's parts on the GPU.

``tests.bench.gpu_check`` in its quick mode, on CUDA: the exchange over NCCL
(with two or more GPUs) delivers every sample bit for bit and leaves the node
buffer unused, the shared-prompt forward matches the per-sample one, and two
GRPO runs finish. The full measurement is ``python -m tests.bench.gpu_check``.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpu_check_parts_run_on_cuda():
    from tests.bench import gpu_check

    out = gpu_check.run(torch.device("cuda", 0), quick=True, budget_s=800)
    failed = {k: v for k, v in out.items() if isinstance(v, dict) and "error" in v}
    assert not failed, failed
    assert out["device_copy"]["d2d_bytes_per_s"] > 0
    exchange = out["exchange"]
    if "skipped" not in exchange:
        assert exchange["content_ok"]
        assert all(r["node_buffer_bytes"] == 0 for r in exchange["rows"])  # NCCL carries same-node pieces
    (row,) = out["shared_attention"]["rows"]
    assert row["max_abs_lp_diff"]["dense"] <= 1e-4
    for name in ("smollm2", "large"):
        assert len(out["grpo"][name]["steps"]) == 2, out["grpo"][name]
