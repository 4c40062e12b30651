"""Settings whose default depends on the device the workers run on, settled once it is known.

The spec leaves them open (``auto`` or None) because ``cluster.device: auto`` is
only decided on the worker; ``resolve_device_defaults`` fills them in:

    field                           cpu          cuda
    model.mixedPrecision            none         bfloat16 (float32 master weights and reduction)
    model.tf32                      false        true
    cluster.dataParallel*Degree     1 x W        numNodes x procsPerNode (HSDP) when numNodes > 1
    rollout.microBatchSize          64           from the KV cache's memory (hf; vllm: 64)

so a CPU run keeps its behaviour and a GPU run gets what a GPU user expects.
bfloat16 asked for (``model.mixedPrecision`` or ``model.dtype``) on a CPU that
has no native bfloat16 (neither AVX512-BF16 nor AMX: torch emulates its
matmuls, ~150x slower than float32 on an AVX2 core) computes in float32
instead on every worker, and the first worker says so (``distflow.precision``);
``DISTFLOW_CPU_BFLOAT16=1`` keeps bfloat16.
The KV-cache estimate (``kv_cache_micro_batch_size``) needs the model's shape
and the free GPU memory: the worker computes it once its models are loaded.
"""

from __future__ import annotations

from distflow.spec.models import ClusterSpec, JobSpec

CPU_ROLLOUT_MICRO_BATCH_SIZE = 64
"""Sequences generated at once per rank on CPU (and by default for vllm, which batches itself)."""


def data_parallel_degrees(cluster: ClusterSpec, cuda: bool) -> tuple[int, int]:
    """(replicate, shard) FSDP2 degrees: the given ones, the other one derived from the workers;
    neither given: HSDP over nodes (numNodes x procsPerNode) on cuda with several nodes, else
    (1, workers). Assumes ``validation.size_problems`` found nothing."""
    world = cluster.num_nodes * cluster.procs_per_node
    replicate, shard = cluster.data_parallel_replicate_degree, cluster.data_parallel_shard_degree
    if replicate is None and shard is None:
        replicate = cluster.num_nodes if cuda and cluster.num_nodes > 1 else 1
    if replicate is None:
        replicate = world // shard
    return replicate, world // replicate


def resolve_device_defaults(spec: JobSpec, device_type: str, native_bfloat16: bool = True) -> JobSpec:
    """``spec`` with the device-dependent defaults (module docstring) settled for ``device_type``
    ("cpu" or "cuda"); values the user gave are kept, but for bfloat16 on a CPU without native
    bfloat16 (``native_bfloat16`` False), which becomes float32. ``rollout.microBatchSize``
    stays None on cuda with the hf engine, for ``kv_cache_micro_batch_size``."""
    cuda = device_type == "cuda"
    mixed = ("bfloat16" if cuda else "none") if spec.model.mixed_precision == "auto" else spec.model.mixed_precision
    dtype = spec.model.dtype
    if not cuda and not native_bfloat16:
        mixed = "none" if mixed == "bfloat16" else mixed
        dtype = "float32" if dtype == "bfloat16" else dtype
    model = spec.model.model_copy(update={
        "mixed_precision": mixed, "dtype": dtype,
        "tf32": cuda if spec.model.tf32 is None else spec.model.tf32})
    replicate, shard = data_parallel_degrees(spec.cluster, cuda)
    cluster = spec.cluster.model_copy(update={"data_parallel_replicate_degree": replicate,
                                              "data_parallel_shard_degree": shard})
    micro = spec.rollout.micro_batch_size
    if micro is None and (not cuda or spec.rollout.engine != "hf"):
        micro = CPU_ROLLOUT_MICRO_BATCH_SIZE
    rollout = spec.rollout.model_copy(update={"micro_batch_size": micro})
    return spec.model_copy(update={"model": model, "cluster": cluster, "rollout": rollout})


def bfloat16_fallback_note(given: JobSpec, resolved: JobSpec, without: int, workers: int) -> str | None:
    """What ``resolve_device_defaults`` turned from bfloat16 into float32 because ``without`` of the
    job's ``workers`` run on a CPU with no native bfloat16, as one line for the run's log; None
    when it kept every bfloat16 asked for."""
    moved = [f"model.{name} bfloat16" for name, attr in (("mixedPrecision", "mixed_precision"), ("dtype", "dtype"))
             if getattr(given.model, attr) == "bfloat16" and getattr(resolved.model, attr) != "bfloat16"]
    if not moved:
        return None
    return (f"{without} of {workers} workers run on a CPU with no native bfloat16 (AVX512-BF16 or AMX), where "
            f"bfloat16 matmuls are emulated (~150x slower than float32): {' and '.join(moved)} "
            f"compute{'s' if len(moved) == 1 else ''} in float32 on every worker; DISTFLOW_CPU_BFLOAT16=1 "
            "on every worker keeps bfloat16")


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes: keys and values (2) x layers x KV heads x head dim x dtype bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_cache_micro_batch_size(free_bytes: int, memory_fraction: float, bytes_per_token: int,
                              tokens_per_sequence: int, n: int) -> int:
    """Sequences whose KV cache of ``tokens_per_sequence`` tokens fits in ``memory_fraction`` of
    ``free_bytes``, rounded down to whole groups of ``n`` when at least one group fits; at least 1.

    E.g. Qwen2.5-7B in bf16 (28 layers, 4 KV heads of 128): 57,344 bytes per token; 2,048-token
    sequences take 112 MiB each, so half of 40 GiB holds 182, 176 in groups of 8.
    """
    fits = int(free_bytes * memory_fraction) // (bytes_per_token * tokens_per_sequence)
    return max(1, fits - fits % n if fits >= n else fits)
