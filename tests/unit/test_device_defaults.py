"""Device-dependent defaults: a CPU run keeps today's settings, a GPU run gets bf16 compute,
TF32, HSDP across nodes and a rollout micro-batch sized from the KV cache; bad combinations
fail naming the field."""

import pytest

from distflow.errors import DistflowConfigError
from distflow.spec import parse_spec
from distflow.spec.defaults import (
    data_parallel_degrees,
    kv_cache_bytes_per_token,
    kv_cache_micro_batch_size,
    bfloat16_fallback_note,
    resolve_device_defaults,
)

pytestmark = pytest.mark.unit

MINIMAL = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 8}}
TWO_NODES = {**MINIMAL, "cluster": {"numNodes": 2, "procsPerNode": 4}}
GIB = 1 << 30


def _problems(doc) -> list[str]:
    with pytest.raises(DistflowConfigError) as info:
        parse_spec(doc)
    return info.value.problems


def test_cpu_keeps_todays_settings():
    spec = resolve_device_defaults(parse_spec(TWO_NODES), "cpu")
    assert spec.model.compute_dtype == "float32" and spec.model.mixed_precision == "none"
    assert spec.model.tf32 is False
    assert (spec.cluster.data_parallel_replicate_degree, spec.cluster.data_parallel_shard_degree) == (1, 8)
    assert spec.rollout.micro_batch_size == 64
    # Nothing else moves: the resolved spec is the given one with these fields filled in.
    given = parse_spec({**TWO_NODES, "model": {"path": "tiny", "mixedPrecision": "none", "tf32": False},
                        "cluster": {"numNodes": 2, "procsPerNode": 4, "dataParallelReplicateDegree": 1,
                                    "dataParallelShardDegree": 8}, "rollout": {"microBatchSize": 64}})
    assert spec == given


def test_cuda_gets_bf16_compute_tf32_and_hsdp_over_nodes():
    spec = resolve_device_defaults(parse_spec(TWO_NODES), "cuda")
    assert spec.model.compute_dtype == "bfloat16" and spec.model.dtype == "float32"
    assert spec.model.tf32 is True
    assert (spec.cluster.data_parallel_replicate_degree, spec.cluster.data_parallel_shard_degree) == (2, 4)
    assert spec.rollout.micro_batch_size is None  # sized from the KV cache once the models are loaded
    one_node = resolve_device_defaults(parse_spec({**MINIMAL, "cluster": {"procsPerNode": 8}}), "cuda")
    assert (one_node.cluster.data_parallel_replicate_degree, one_node.cluster.data_parallel_shard_degree) == (1, 8)
    vllm = resolve_device_defaults(parse_spec({**MINIMAL, "rollout": {"engine": "vllm"}}), "cuda")
    assert vllm.rollout.micro_batch_size == 64


def test_given_values_win_on_cuda():
    doc = {**TWO_NODES, "model": {"path": "tiny", "mixedPrecision": "none", "tf32": False},
           "cluster": {"numNodes": 2, "procsPerNode": 4, "dataParallelShardDegree": 8},
           "rollout": {"microBatchSize": 16}}
    spec = resolve_device_defaults(parse_spec(doc), "cuda")
    assert (spec.model.compute_dtype, spec.model.tf32, spec.rollout.micro_batch_size) == ("float32", False, 16)
    assert (spec.cluster.data_parallel_replicate_degree, spec.cluster.data_parallel_shard_degree) == (1, 8)
    replicas = parse_spec({**TWO_NODES, "cluster": {"numNodes": 2, "procsPerNode": 4, "dataParallelReplicateDegree": 4}})
    assert data_parallel_degrees(replicas.cluster, cuda=False) == (4, 2)


@pytest.mark.parametrize("cluster, field, fix", [
    ({"numNodes": 2, "procsPerNode": 4, "dataParallelReplicateDegree": 3}, "cluster.dataParallelReplicateDegree",
     "pick a divisor of 8"),
    ({"numNodes": 2, "procsPerNode": 4, "dataParallelShardDegree": 5}, "cluster.dataParallelShardDegree",
     "pick a divisor of 8"),
    ({"numNodes": 2, "procsPerNode": 4, "dataParallelReplicateDegree": 2, "dataParallelShardDegree": 2},
     "cluster.dataParallelShardDegree", "set it to 4"),
])
def test_degrees_that_do_not_tile_the_workers_fail_naming_the_field(cluster, field, fix):
    (problem,) = [p for p in _problems({**MINIMAL, "cluster": cluster}) if field in p]
    assert fix in problem


def test_tf32_on_cpu_fails_naming_the_field():
    problems = _problems({**MINIMAL, "model": {"path": "tiny", "tf32": True}, "cluster": {"device": "cpu"}})
    assert any(p.startswith("spec.model.tf32") or "model.tf32" in p for p in problems), problems


def test_kv_cache_estimate_by_hand():
    # Qwen2.5-7B, bf16: 28 layers x 4 KV heads x 128 x 2 bytes x 2 (K and V) = 57,344 bytes per token.
    per_token = kv_cache_bytes_per_token(num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2)
    assert per_token == 57_344
    # 2,048 tokens: 112 MiB a sequence; half of 40 GiB = 20,480 MiB holds 182 of them, 176 in groups of 8.
    assert kv_cache_micro_batch_size(40 * GIB, 0.5, per_token, 2048, n=8) == 176
    assert kv_cache_micro_batch_size(40 * GIB, 0.5, per_token, 2048, n=1) == 182
    # Less than a group fits: what fits (the group is split over calls), and never 0.
    assert kv_cache_micro_batch_size(1 * GIB, 0.5, per_token, 2048, n=8) == 4
    assert kv_cache_micro_batch_size(0, 0.5, per_token, 2048, n=8) == 1


def test_the_worker_sizes_rollout_micro_batches_from_the_free_gpu_memory(monkeypatch):
    from types import SimpleNamespace

    import torch

    from distflow.engines import fsdp
    from distflow.models import load_causal_lm, model_cache_dir, resolve_model
    from distflow.worker import DagWorker

    spec = resolve_device_defaults(parse_spec({**MINIMAL, "data": {"train": {"path": "arithmetic"},
                                                                   "maxPromptLength": 256, "maxResponseLength": 64}}),
                                   "cuda")
    worker = DagWorker.__new__(DagWorker)
    worker.spec, worker.device = spec, torch.device("cuda", 0)
    worker.actor_model = load_causal_lm(resolve_model("tiny:byte", model_cache_dir()))
    worker.rollout = SimpleNamespace(shared=True)
    # tiny: 2 layers x 2 KV heads x head dim 16 x 2 (K, V) x 2 bytes (bf16) = 256 bytes a token;
    # 320 tokens a sequence = 81,920 bytes. Free: the gathered bf16 weights + room for 10 at 0.5.
    gathered = fsdp.unsharded_nbytes(worker.actor_model, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (gathered + 10 * 81_920 * 2 + 100, 0))
    worker._size_rollout_micro_batches()
    assert worker.spec.rollout.micro_batch_size == 8  # 10 fit, in whole groups of rollout.n = 4


def test_a_cpu_without_native_bfloat16_computes_in_float32():
    """An AVX2-only CPU emulates bfloat16 matmuls (0.37 GFLOP/s against 58 for float32 on one core,
    measured): bfloat16 asked for there computes in float32, the rest of the spec unchanged."""
    doc = {**TWO_NODES, "model": {"path": "tiny", "mixedPrecision": "bfloat16", "dtype": "bfloat16"}}
    spec = resolve_device_defaults(parse_spec(doc), "cpu", native_bfloat16=False)
    assert (spec.model.mixed_precision, spec.model.dtype, spec.model.compute_dtype) == ("none", "float32", "float32")
    kept = resolve_device_defaults(parse_spec(doc), "cpu", native_bfloat16=True)
    assert (kept.model.mixed_precision, kept.model.dtype, kept.model.compute_dtype) == ("bfloat16", "bfloat16", "bfloat16")
    assert spec.model_copy(update={"model": kept.model}) == kept
    # A GPU computes bfloat16 whatever the host CPU does.
    cuda = resolve_device_defaults(parse_spec(doc), "cuda", native_bfloat16=False)
    assert cuda.model.compute_dtype == "bfloat16"
    assert bfloat16_fallback_note(parse_spec(doc), spec, 1, 4) == (
        "1 of 4 workers run on a CPU with no native bfloat16 (AVX512-BF16 or AMX), where bfloat16 matmuls "
        "are emulated (~150x slower than float32): model.mixedPrecision bfloat16 and model.dtype bfloat16 "
        "compute in float32 on every worker; DISTFLOW_CPU_BFLOAT16=1 on every worker keeps bfloat16")
    assert bfloat16_fallback_note(parse_spec(doc), kept, 0, 4) is None


def test_native_bfloat16_reads_the_cpu_and_the_override(monkeypatch):
    import torch

    from distflow.precision import native_bfloat16

    monkeypatch.delenv("DISTFLOW_CPU_BFLOAT16", raising=False)
    assert native_bfloat16(torch.device("cuda", 0)) is True
    for avx512_bf16, amx, want in [(False, False, False), (True, False, True), (False, True, True)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert native_bfloat16(torch.device("cpu")) is want
    monkeypatch.setenv("DISTFLOW_CPU_BFLOAT16", "1")
    assert native_bfloat16(torch.device("cpu")) is True
