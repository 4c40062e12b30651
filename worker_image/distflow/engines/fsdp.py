"""Actor and reference models under FSDP2 (`fully_shard`), on gloo or NCCL.

Parallelism lives here, apart from model code (torchtitan's split): the model
is an ordinary transformers causal LM; ``apply_fsdp`` shards each decoder
layer and then the root over a 1-D dp mesh.

The rollout engine keeps its own unsharded copy of the policy (what vLLM
would hold); ``sync_rollout_weights`` all-gathers the updated shards into it
after every optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class DeviceInfo:
    device: torch.device
    backend: str  # "gloo" or "nccl"


def select_device(requested: str, local_rank: int) -> DeviceInfo:
    """cuda + NCCL when asked for (or `auto` and available), else CPU + gloo.

    Raises:
        ValueError: `cuda` requested but no GPU is visible.
    """
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("cluster.device: cuda requested but torch sees no GPU; use cpu or auto")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return DeviceInfo(torch.device("cuda", torch.cuda.current_device()), "nccl")
    return DeviceInfo(torch.device("cpu"), "gloo")


def dp_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))


def _decoder_layers(model) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Shard each decoder layer, then the root (FSDP2). Returns the same module."""
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state_tensors(model: torch.nn.Module):
    """(name, full tensor) for every parameter, all-gathering DTensor shards."""
    for name, param in model.named_parameters():
        data = param.data
        yield name, data.full_tensor() if isinstance(data, DTensor) else data


@torch.no_grad()
def sync_rollout_weights(actor: torch.nn.Module, rollout_model: torch.nn.Module) -> int:
    """Copy the actor's updated weights into the rollout copy.

    Returns:
        Bytes all-gathered by this rank.
    """
    targets = dict(rollout_model.named_parameters())
    moved = 0
    for name, full in full_state_tensors(actor):
        dst = targets[name]
        dst.copy_(full.to(dst.device, dst.dtype))
        moved += full.numel() * full.element_size()
    return moved


def grad_norm_and_clip(model: torch.nn.Module, max_norm: float) -> float:
    """Global L2 gradient norm over all shards (before clipping); clips in place."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def all_reduce_sum(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum a small float64 vector over all ranks (metadata-sized)."""
    buf = values.to(device=device, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(buf)
    return buf.cpu()
