"""One compute dtype for the whole job, where CPUs differ in native bfloat16.

bfloat16 asked for (``model.mixedPrecision`` or ``model.dtype``) on a CPU with
neither AVX512-BF16 nor AMX runs emulated matmuls (0.37 GFLOP/s against 58 for
float32 on one AVX2 core, measured 2026-12-07): there the job computes in
float32 (``spec.defaults.resolve_device_defaults``). FSDP's all-gathers and the
weight sync move tensors of the compute dtype, so the workers must choose
alike: they agree at start (:func:`settle`, any CPU without it makes every
worker fall back), and a worker joining a running rollout pool is checked
against it (:func:`check_joiner`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from distflow.spec import JobSpec
from distflow.spec.defaults import bfloat16_fallback_note, resolve_device_defaults


def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 in hardware: always on cuda; on a CPU, AVX512-BF16 or
    AMX. ``DISTFLOW_CPU_BFLOAT16=1`` answers True (keep bfloat16 on any CPU, e.g. to check its
    numerics)."""
    if device.type != "cpu" or os.environ.get("DISTFLOW_CPU_BFLOAT16") == "1":
        return True
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    if all(check is None for check in checks):  # a torch without these probes: trust the spec
        return True
    return any(bool(check()) for check in checks if check is not None)


def settle(given: JobSpec, device: torch.device, rank: int, joining: bool = False) -> JobSpec:
    """``given`` with its device-dependent defaults settled (``resolve_device_defaults``), one
    compute dtype for every worker: collective over the world on cpu, where bfloat16 stays only
    when no worker's CPU lacks it, and rank 0 prints what fell back to float32
    (``bfloat16_fallback_note``). A worker ``joining`` a running rollout pool has no world yet:
    it settles for its own CPU and is checked as it joins (:func:`check_joiner`)."""
    native = native_bfloat16(device)
    resolved = resolve_device_defaults(given, device.type, native)
    if device.type != "cpu" or joining:
        return resolved
    without = torch.tensor([0 if native else 1])
    dist.all_reduce(without)
    agreed = resolve_device_defaults(given, "cpu", native_bfloat16=False) if without.item() else resolved
    if rank == 0 and (note := bfloat16_fallback_note(given, agreed, int(without.item()), dist.get_world_size())):
        print(f"distflow: {note}", flush=True)
    return agreed


def check_joiner(mine: str, pool: str, rank: int) -> None:
    """Collective over a rollout pool's new world (``pools.elastic.hand_over``): every rank raises
    the same error when a joiner computes in another dtype (``mine``) than the running job
    (``pool``), before a weight sync would move buffers of different sizes.

    Raises:
        RuntimeError: naming the ranks and the dtypes, and the fix.
    """
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (rank, mine) if mine != pool else None)
    if odd := [part for part in parts if part is not None]:
        ranks = ", ".join(f"rank {r} ({dtype})" for r, dtype in odd)
        raise RuntimeError(f"{ranks} would compute in another dtype than the running job ({pool}): their CPUs "
                           "differ in native bfloat16 (AVX512-BF16 or AMX); set DISTFLOW_CPU_BFLOAT16=1 on every "
                           "worker, or model.mixedPrecision: none, or run the rollout pool on CPUs like the rest")
