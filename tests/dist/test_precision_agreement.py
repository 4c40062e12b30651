"""Workers on CPUs that differ in native bfloat16 agree on one compute dtype before any collective
moves model tensors (an AVX2 node next to an AVX512-BF16 one: the all-gathers and the weight sync
would otherwise exchange buffers of different sizes, and gloo aborts one side)."""

import pytest
import torch

from _spawn import run_on_ranks

pytestmark = pytest.mark.dist

DOC = {"model": {"path": "tiny", "mixedPrecision": "bfloat16"},
       "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 2}}


def _agreed(rank, world, natives):
    """This rank's CPU made native (the override) or not (the probes answer no), then settled."""
    import os

    from distflow.precision import settle
    from distflow.spec import parse_spec

    if natives[rank]:
        os.environ["DISTFLOW_CPU_BFLOAT16"] = "1"
    else:
        os.environ.pop("DISTFLOW_CPU_BFLOAT16", None)
        torch.cpu._is_avx512_bf16_supported = torch.cpu._is_amx_tile_supported = lambda: False
    return settle(parse_spec(DOC), torch.device("cpu"), rank).model.compute_dtype


@pytest.mark.parametrize("natives, want", [((True, False), "float32"), ((False, True), "float32"),
                                           ((True, True), "bfloat16"), ((False, False), "float32")])
def test_workers_agree_on_float32_when_any_cpu_lacks_native_bfloat16(natives, want, capfd):
    assert run_on_ranks(_agreed, 2, natives, timeout_s=120) == [want, want]
    printed = capfd.readouterr().out
    if want == "float32":
        assert f"distflow: {sum(not n for n in natives)} of 2 workers run on a CPU with no native bfloat16" in printed
    else:
        assert "no native bfloat16" not in printed


def _joined(rank, world, dtypes):
    from distflow.precision import check_joiner

    try:
        check_joiner(dtypes[rank], dtypes[0], rank)
    except RuntimeError as err:
        return str(err)
    return None


def test_a_joiner_computing_in_another_dtype_fails_the_join_on_every_rank():
    errors = run_on_ranks(_joined, 3, ("float32", "float32", "bfloat16"), timeout_s=120)
    assert errors[0] == errors[1] == errors[2] == (
        "rank 2 (bfloat16) would compute in another dtype than the running job (float32): their CPUs differ in "
        "native bfloat16 (AVX512-BF16 or AMX); set DISTFLOW_CPU_BFLOAT16=1 on every worker, or "
        "model.mixedPrecision: none, or run the rollout pool on CPUs like the rest")
    assert run_on_ranks(_joined, 2, ("bfloat16", "bfloat16"), timeout_s=120) == [None, None]
