"""Scaling cost model: GRPO/PPO step time from 32 to 1,024 GPUs, both data planes.

Pure arithmetic (no torch, no I/O). Weak scaling: every GPU keeps the same
samples per step, so compute per GPU is constant and efficiency(N) =
(throughput(N) / N) / (throughput(N0) / N0) with N0 = 32 exposes only what
grows with N. Data-plane costs come from measurements on this machine
(``Measured``); hardware and workload are assumptions (``Hardware``,
``Workload``), each one stated as a field with its reason.

    step(N) = rollout + log-prob passes + train x imbalance(N)
            + param sync(N) + weight sync + sum over routed edges of edge(N)

    planning:           balancer + plan + size bookkeeping per balanced edge,
                        on every rank (measured, interpolated in B_global)
    edge, distributed:  metadata all-gathers (latency x log2 N + bytes)
                        + host staging (PCIe both ways) + pack/assemble
                        copies on the device + moved bytes / per-GPU network
    edge, centralized:  host staging on every worker + every byte into one
                        controller and back out over its link, 2 host copies
                        per byte there (assemble + pack, as
                        ``exchange_centralized`` does, at the measured host
                        rate), per-worker dispatch latency

Deliberately not modelled: rollout tail latency growing with N (the longest
response per step is capped by max length, the same at every N), failures,
stragglers from noisy neighbours, and any overlap of data movement with
compute (none is assumed: a conservative choice for both planes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Hardware:
    """Target cluster: assumptions, not measurements."""

    gpus_per_node: int = 8
    """H100/H200 SXM nodes (8 GPUs each)."""
    peak_flops: float = 989e12
    """Dense bf16 FLOP/s per GPU (H100 SXM datasheet)."""
    train_mfu: float = 0.40
    """Model FLOPs utilisation of FSDP training at long sequence lengths."""
    inference_mfu: float = 0.50
    """MFU of log-prob / value forward passes (prefill-like, compute bound)."""
    decode_mfu: float = 0.10
    """Effective MFU of batched decoding (memory bound; vLLM at large batch)."""
    network_bytes_per_s: float = 40e9
    """Per-GPU inter-node bandwidth: one 400 Gb/s NIC per GPU at 80% efficiency."""
    network_latency_s: float = 10e-6
    """Per collective step (NCCL over InfiniBand, small messages)."""
    pcie_bytes_per_s: float = 25e9
    """Host <-> device copy bandwidth per GPU (PCIe Gen5 x16, pinned, effective)."""
    device_copy_bytes_per_s: float = 1.5e12
    """Device-to-device gather copies (half of H100 HBM3's 3.35 TB/s; read + write)."""
    controller_bytes_per_s: float = 10e9
    """Link of a single controller process: 100 Gb/s host network at 80% efficiency."""
    controller_dispatch_s: float = 3e-4
    """Per-worker, per-edge dispatch/RPC cost of a single controller (sequential)."""
    fsdp_collectives_per_layer: int = 3
    """all-gather forward, all-gather backward, reduce-scatter gradients."""


@dataclass(frozen=True)
class Workload:
    """One GRPO or PPO setting (per GPU under weak scaling)."""

    name: str
    params: float
    """Policy parameters."""
    num_layers: int
    algorithm: str
    """``grpo`` or ``ppo``."""
    samples_per_gpu: int = 16
    prompt_tokens: int = 1024
    response_tokens: int = 2048
    """Mean response length (tokens)."""
    kl_reference: bool = True
    """GRPO with a KL loss runs a reference forward pass."""

    @property
    def tokens_per_sample(self) -> int:
        return self.prompt_tokens + self.response_tokens


@dataclass(frozen=True)
class Measured:
    """Inputs measured by the other benchmarks (see docs/benchmarks.md for each source)."""

    bytes_per_token: float
    """Wire bytes per token of an edge's fields (funnel benchmark's realistic fields)."""
    host_copy_bytes_per_s: float
    """Single-thread gather-copy throughput of ``PackedBatch.select`` (pack/assemble)."""
    metadata_collectives_per_edge: int
    """all-gathers per redistributed edge (counted in the funnel benchmark)."""
    planning_points: tuple[tuple[int, float], ...]
    """(global samples, seconds) of the coordinator's plan (balancer benchmark)."""
    imbalance_points: tuple[tuple[int, float], ...]
    """(dp size, max/mean train load) at ``samples_per_gpu`` per rank (balancer benchmark)."""


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds per step by component, plus tokens per step."""

    num_gpus: int
    compute: float
    imbalance_loss: float
    param_sync: float
    data_plane: float
    tokens: float
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.compute + self.imbalance_loss + self.param_sync + self.data_plane

    @property
    def throughput(self) -> float:
        """Tokens per second per GPU (verl's definition)."""
        return self.tokens / (self.total * self.num_gpus)


EDGES = {"grpo": {"moved": 1, "routed": 3, "balanced": 1},
         "ppo": {"moved": 3, "routed": 5, "balanced": 2}}
"""Per step, from ``DataCoordinator.ensure`` on the built-in chains: *moved* =
placement changes in distributed mode (GRPO: advantage -> actor; PPO: ->
values, -> advantage (back to the rollout layout), -> critic; the actor then
finds the batch in place); *routed* = edges centralized mode sends through
rank 0 (every node after rollout); *balanced* = moves that run the balancer
(the planning cost; the move back to the rollout layout needs none)."""


def edge_counts(w: Workload) -> tuple[int, int, int]:
    """(moved in distributed mode, routed in centralized mode, balanced) edges per step."""
    e = EDGES[w.algorithm]
    return e["moved"], e["routed"], e["balanced"]


def interpolate_loglog(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise power law through ``points`` (sorted by x); the end segments extend beyond.

    Raises:
        ValueError: fewer than one point, or a non-positive value (log of it).
    """
    pts = sorted(points)
    if not pts or any(px <= 0 or py <= 0 for px, py in pts):
        raise ValueError(f"interpolate_loglog: need positive points, got {pts}")
    if len(pts) == 1:
        return pts[0][1] * x / pts[0][0]  # one point: assume linear in x
    i = 1
    while i < len(pts) - 1 and x > pts[i][0]:
        i += 1
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y0 * (x / x0) ** slope


def step_at_flat(points: Sequence[tuple[float, float]], x: float) -> float:
    """Value at the largest measured x <= ``x`` (held flat beyond the last point)."""
    pts = sorted(points)
    below = [y for px, y in pts if px <= x]
    return below[-1] if below else pts[0][1]


def compute_seconds(w: Workload, hw: Hardware) -> dict[str, float]:
    """Per-GPU compute of one step: rollout decode, forward passes, training."""
    tokens = w.samples_per_gpu * w.tokens_per_sample
    generated = w.samples_per_gpu * w.response_tokens
    forward = 2 * w.params * tokens / (hw.peak_flops * hw.inference_mfu)
    out = {"rollout": 2 * w.params * generated / (hw.peak_flops * hw.decode_mfu),
           "reference": forward if (w.algorithm == "ppo" or w.kl_reference) else 0.0,
           "train": 6 * w.params * tokens / (hw.peak_flops * hw.train_mfu)}
    if w.algorithm == "ppo":  # critic as large as the actor: values pass + critic update
        out["values"] = forward
        out["train"] *= 2
    return out


def param_sync_seconds(w: Workload, hw: Hardware, n: int) -> float:
    """FSDP collectives (bandwidth term constant per GPU, latency term ~ log2 N per
    collective) plus the actor -> rollout weight all-gather, bf16 weights."""
    models = 2 if w.algorithm == "ppo" else 1
    weight_bytes = 2 * w.params
    bandwidth = 3 * weight_bytes * (n - 1) / n / hw.network_bytes_per_s * models
    latency = hw.fsdp_collectives_per_layer * w.num_layers * 2 * math.log2(n) * hw.network_latency_s * models
    weight_sync = weight_bytes * (n - 1) / n / hw.network_bytes_per_s
    return bandwidth + latency + weight_sync


def distributed_edge_seconds(w: Workload, hw: Hardware, m: Measured, n: int) -> dict:
    """One redistributed edge on every rank (the slowest rank's time).

    On GPUs the runtime stages the local batch to the device, packs and
    assembles there (device copies) and stages the result back."""
    local = w.samples_per_gpu * w.tokens_per_sample * m.bytes_per_token
    moved = local * (n - 1) / n  # conservative: a balanced plan moves almost every sample
    global_samples = n * w.samples_per_gpu
    metadata = m.metadata_collectives_per_edge * (
        2 * math.log2(n) * hw.network_latency_s + 8 * global_samples / hw.network_bytes_per_s)
    return {
        "metadata": metadata,
        "staging": 2 * local / hw.pcie_bytes_per_s,
        "copies": 2 * moved / hw.device_copy_bytes_per_s,
        "wire": moved / hw.network_bytes_per_s,
    }


def centralized_edge_seconds(w: Workload, hw: Hardware, m: Measured, n: int) -> dict:
    """One edge through a single controller: everything in, reorder, everything out.

    The controller is a host process (as in single-controller frameworks):
    its copies run at the measured host rate; workers stage their own batch
    to and from their GPU in parallel."""
    local = w.samples_per_gpu * w.tokens_per_sample * m.bytes_per_token
    total = n * local
    through = total * (n - 1) / n
    return {
        "staging": 2 * local / hw.pcie_bytes_per_s,
        "wire": 2 * through / hw.controller_bytes_per_s,
        "copies": 2 * total / m.host_copy_bytes_per_s,
        "dispatch": 2 * (n - 1) * hw.controller_dispatch_s,
    }


def planning_seconds(w: Workload, m: Measured, n: int) -> float:
    """Balancing + planning of one balanced edge (every rank computes it; a controller
    computes it once, on the same critical path)."""
    return interpolate_loglog(m.planning_points, n * w.samples_per_gpu)


def project(w: Workload, hw: Hardware, m: Measured, n: int, mode: str) -> StepBreakdown:
    """Step time at ``n`` GPUs for ``mode`` = ``distributed`` or ``centralized``.

    Raises:
        ValueError: unknown mode.
    """
    if mode not in ("distributed", "centralized"):
        raise ValueError(f"mode {mode!r}: choose distributed or centralized")
    comp = compute_seconds(w, hw)
    imbalance = step_at_flat(m.imbalance_points, n)
    moved, routed, balanced = edge_counts(w)
    if mode == "distributed":
        edge = distributed_edge_seconds(w, hw, m, n)
        count = moved
    else:
        edge = centralized_edge_seconds(w, hw, m, n)
        count = routed
    edge["planning"] = planning_seconds(w, m, n) * balanced / count
    data = count * sum(edge.values())
    return StepBreakdown(
        num_gpus=n, compute=sum(comp.values()), imbalance_loss=comp["train"] * (imbalance - 1.0),
        param_sync=param_sync_seconds(w, hw, n), data_plane=data,
        tokens=n * w.samples_per_gpu * w.tokens_per_sample, parts={**comp, **{f"edge/{k}": v for k, v in edge.items()}})


def scaling_table(workloads: Sequence[Workload], hw: Hardware, m: Measured,
                  gpu_counts: Sequence[int] = (32, 64, 128, 256, 512, 1024)) -> list[dict]:
    """Rows of (workload, N, mode, step seconds, tokens/s/GPU, efficiency vs the first N)."""
    rows = []
    for w in workloads:
        for mode in ("distributed", "centralized"):
            base = None
            for n in gpu_counts:
                step = project(w, hw, m, n, mode)
                base = base or step.throughput
                rows.append({"workload": w.name, "mode": mode, "num_gpus": n, "step_seconds": step.total,
                             "data_plane_seconds": step.data_plane, "param_sync_seconds": step.param_sync,
                             "imbalance_seconds": step.imbalance_loss, "compute_seconds": step.compute,
                             "tokens_per_s_per_gpu": step.throughput,
                             "efficiency": step.throughput / base})
    return rows


WORKLOADS = (
    Workload("7B GRPO", 7.6e9, 28, "grpo", response_tokens=2048),
    Workload("32B GRPO", 32.8e9, 64, "grpo", response_tokens=4096),
    Workload("72B GRPO", 72.7e9, 80, "grpo", response_tokens=4096),
    Workload("7B PPO", 7.6e9, 28, "ppo", response_tokens=2048),
    Workload("32B PPO", 32.8e9, 64, "ppo", response_tokens=4096),
    Workload("72B PPO", 72.7e9, 80, "ppo", response_tokens=4096),
)
"""Qwen2.5-like sizes (params, layers); 16 samples per GPU per step (e.g. 512
prompts x 16 responses on 512 GPUs), 1k-token prompts, mean responses of 2k
(7B) and 4k tokens (32B, 72B)."""
