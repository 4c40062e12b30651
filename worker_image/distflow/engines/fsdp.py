"""Actor and reference models under FSDP2 (`fully_shard`), on gloo or NCCL.

Parallelism lives here, apart from model code (torchtitan's split): the model
is an ordinary transformers causal LM; ``apply_fsdp`` shards each decoder
layer and then the root over the dp mesh (``dp_mesh``: 1-D, or HSDP's 2-D
replicate x shard mesh).

Mixed precision is FSDP2's ``MixedPrecisionPolicy``: the sharded parameters
(the master weights the optimizer steps) keep their dtype, float32 for a
trained model; each unit all-gathers and computes in the compute dtype (bf16
halves the gathered bytes), and gradients are reduce-scattered in float32.

The rollout engine generates with the policy's weights in one of two ways
(``RolloutWeights``, ``rollout.shareActorWeights``): by default with the
actor's own FSDP module, unsharded for the rollout (one all-gather per FSDP
unit, kept through the hundreds of forwards of ``generate``, resharded
after); or with its own unsharded copy (what a vLLM-style engine holds),
which ``sync_rollout_weights`` refreshes after every optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


from distflow.engines.model_ops import eval_mode
from distflow import process_group
from distflow.process_group import backend_for, collective_bytes


@dataclass(frozen=True)
class DeviceInfo:
    device: torch.device
    backend: str
    """``process_group.backend_for(device.type)``: "gloo", or "cpu:gloo,cuda:nccl"."""


def select_device(requested: str, device_index: int) -> DeviceInfo:
    """cuda + NCCL (with gloo for CPU tensors) when asked for (or `auto` and available), else CPU + gloo.

    Args:
        device_index: the worker's process index on its machine; it runs on that GPU.

    Raises:
        ValueError: `cuda` requested but no GPU is visible, or fewer GPUs than
            ``device_index + 1`` (two workers on one GPU would make NCCL fail).
    """
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("cluster.device: cuda requested but torch sees no GPU; use cpu or auto")
        if device_index >= torch.cuda.device_count():
            raise ValueError(f"worker {device_index} of this machine has no GPU of its own ({torch.cuda.device_count()} "
                             "visible); lower cluster.procsPerNode (and, locally, cluster.numNodes) to the GPU count")
        torch.cuda.set_device(device_index)
        return DeviceInfo(torch.device("cuda", torch.cuda.current_device()), backend_for("cuda"))
    return DeviceInfo(torch.device("cpu"), backend_for("cpu"))


def dp_mesh(device: torch.device, world_size: int, replicate: int = 1) -> DeviceMesh:
    """The FSDP2 mesh: 1-D ``("dp",)`` over every rank, or with ``replicate`` > 1 the HSDP mesh
    ``("dp_replicate", "dp_shard")`` of shape ``[replicate, world_size // replicate]``: each row
    (consecutive ranks: a node, when ``replicate`` is the node count) shards the parameters,
    the rows hold replicas, so per-layer all-gathers stay within a row and only the gradient
    all-reduce crosses rows (torchtitan's names)."""
    if replicate == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (replicate, world_size // replicate),
                            mesh_dim_names=("dp_replicate", "dp_shard"))


def pool_mesh(device: torch.device, num_ranks: int, replicate: int = 1) -> DeviceMesh:
    """``dp_mesh`` over ranks ``0 .. num_ranks - 1`` of a larger world (the trainer pool,
    ``distflow.pools``). Collective over the world: every rank builds it (the others are
    non-participating ranks of the mesh), so every rank creates the same process groups."""
    ranks = torch.arange(num_ranks)
    if replicate == 1:
        return DeviceMesh(device.type, ranks, mesh_dim_names=("dp",))
    return DeviceMesh(device.type, ranks.view(replicate, num_ranks // replicate),
                      mesh_dim_names=("dp_replicate", "dp_shard"))


def set_tf32(enabled: bool) -> None:
    """float32 matmuls and cuDNN convolutions on CUDA in TF32 (``model.tf32``), or full float32."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch < 2.9 (vLLM's pins)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
        return
    precision = "tf32" if enabled else "ieee"  # the new API only: torch refuses a mix of both
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision


def _decoder_layers(model) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh,
               compute_dtype: torch.dtype | None = None, reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard each decoder layer, then the root (FSDP2). Returns the same module.

    Args:
        compute_dtype: dtype of the all-gathered parameters and of the forward
            and backward (None: the parameters' own); gradients are reduced in float32.
        reshard_after_forward: as FSDP2's argument, for the decoder layers (the root
            never reshards after forward). False is the ZeRO-2 layout: a layer's full
            parameters stay gathered from its forward through its backward, and
            ``hold_unsharded`` keeps them from the rollout to the optimizer step.
    """
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model._distflow_reshard_after_forward = reshard_after_forward
    return model


def full_state_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """(name, full tensor) for every parameter, all-gathering DTensor shards (cast to ``dtype``
    before the gather, so a bf16 target gathers half the bytes of float32 master weights)."""
    for name, param in model.named_parameters():
        data = param.data if dtype is None else param.data.to(dtype)
        yield name, data.full_tensor() if isinstance(data, DTensor) else data


@torch.no_grad()
def sync_rollout_weights(actor: torch.nn.Module, rollout_model: torch.nn.Module) -> int:
    """Copy the actor's updated weights into the rollout copy.

    Returns:
        Bytes all-gathered by this rank.
    """
    targets = dict(rollout_model.named_parameters())
    moved = 0
    dtype = next(rollout_model.parameters()).dtype
    for name, full in full_state_tensors(actor, dtype):
        dst = targets[name]
        dst.copy_(full.to(dst.device, dst.dtype))
        moved += full.numel() * full.element_size()
    return moved


def rebind_mesh(mesh: DeviceMesh, new_mesh: DeviceMesh, models) -> None:
    """Serve ``mesh`` with ``new_mesh``'s process groups, in place: after the world was re-formed
    (``process_group.reform``) around ranks that keep their mesh (the trainer pool when only the
    rollout pool resizes), the models stay as they are: every parameter, gradient and optimizer
    state is a DTensor on ``mesh`` whose local shard is unchanged, so only the groups its
    collectives run on are replaced (the mesh's, and the ones FSDP2 took from it at ``fully_shard``).

    Args:
        mesh: the mesh the models were sharded over, whose groups the old world destroyed.
        new_mesh: the same ranks and shape, built in the new world (``pool_mesh``).
        models: the modules sharded over ``mesh`` (None entries are skipped).

    Raises:
        ValueError: the meshes' ranks or dimension names differ.
    """
    if mesh.mesh.tolist() != new_mesh.mesh.tolist() or mesh.mesh_dim_names != new_mesh.mesh_dim_names:
        raise ValueError(f"cannot rebind mesh {mesh} to {new_mesh}: ranks or dimensions differ")
    # DeviceMesh resolves its groups by name at each collective (get_group); no public setter exists.
    mesh._dim_group_names = list(new_mesh._dim_group_names)
    mesh._pg_registry = dict(new_mesh._pg_registry)
    for model in models:
        for unit in _fsdp_modules(model) if model is not None else ():
            group = unit._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            infos = [group.mesh_info, group.post_forward_mesh_info]
            infos += [i for p in group.fsdp_params for i in (p.mesh_info, p.post_forward_mesh_info)]
            for info in {id(i): i for i in infos if i is not None}.values():
                _refresh_groups(info)


def _refresh_groups(info) -> None:
    """An FSDP2 mesh info's groups, taken from its mesh again (what its ``__post_init__`` does)."""
    if getattr(info, "shard_mesh_dim", None) is not None:
        info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
        info.reduce_scatter_process_group = None
    if getattr(info, "replicate_mesh_dim", None) is not None and hasattr(info, "replicate_process_group"):
        info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)


def _fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _restore_reshard_settings(model: torch.nn.Module, units: list[FSDPModule]) -> None:
    """Back to ``apply_fsdp``'s settings: layers as configured, the root never after forward."""
    layers = getattr(model, "_distflow_reshard_after_forward", True)
    for unit in units:
        unit.set_reshard_after_forward(layers and unit is not model, recurse=False)
        unit.set_reshard_after_backward(True, recurse=False)


def hold_unsharded(model: torch.nn.Module) -> None:
    """All-gather every FSDP unit's parameters (a no-op for units already gathered) and keep
    them gathered through any number of forwards and backwards until ``release_unsharded``.

    Used between a rollout and the optimizer step that follows it (the parameters do not
    change in between), so the rollout's one all-gather per unit also serves the log-prob
    passes and the update's forwards and backwards. Costs the full parameters in the
    compute dtype (bytes: ``unsharded_nbytes(model, compute_dtype)``) for that time.
    """
    for unit in _fsdp_modules(model):
        unit.set_reshard_after_forward(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
        unit.unshard()


def release_unsharded(model: torch.nn.Module) -> None:
    """Free the gathered parameters (``hold_unsharded``, or any left by a forward) and go
    back to ``apply_fsdp``'s settings. Must precede ``optimizer.step``, gradient clipping
    and checkpointing, which read the sharded parameters. Idempotent."""
    units = _fsdp_modules(model)
    for unit in units:
        unit.reshard()
    _restore_reshard_settings(model, units)


@contextmanager
def unsharded(model: torch.nn.Module, keep: bool = False) -> Iterator[torch.nn.Module]:
    """``model`` (FSDP2, as ``apply_fsdp`` built it) with full parameters inside the block.

    Every FSDP unit all-gathers its parameters once on entry and keeps them
    through any number of forwards (``set_reshard_after_forward(False)``,
    FSDP2's setting for evaluation), then reshards on exit and goes back to
    ``apply_fsdp``'s settings. With ``keep`` they stay gathered after the
    block (``hold_unsharded``) until ``release_unsharded``. For inference only
    (no backward inside the block). A module without FSDP units is yielded as is.
    """
    units = _fsdp_modules(model)
    if not units:
        yield model
        return
    hold_unsharded(model)
    try:
        yield model
    except BaseException:
        release_unsharded(model)
        raise
    if not keep:
        release_unsharded(model)


def unsharded_nbytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the full (unsharded) parameters in ``dtype`` (None: their own):
    what ``unsharded`` all-gathers per rank when ``dtype`` is the compute dtype."""
    return sum(param.numel() * (param.element_size() if dtype is None else dtype.itemsize)
               for param in model.parameters())  # DTensor: global numel


class RolloutWeights:
    """The policy weights the rollout engine generates with.

    Shared (``copy`` is None): the actor's FSDP module itself, unsharded
    for each rollout (``unsharded``): no second copy in memory and nothing to
    sync after an update. Copy: a separate unsharded model, refreshed from
    the actor's shards by ``sync`` after every optimizer step.
    """

    def __init__(self, actor_model: torch.nn.Module, copy: torch.nn.Module | None = None,
                 keep_gathered: bool = False) -> None:
        self.actor_model = actor_model
        self.copy = copy
        self.keep_gathered = keep_gathered
        """Shared weights stay gathered after the rollout for the passes and the update that
        follow (``actor.reshardAfterForward: false``); the actor's optimizer step releases them."""

    @property
    def shared(self) -> bool:
        return self.copy is None

    @contextmanager
    def policy(self, metrics=None) -> Iterator[torch.nn.Module]:
        """The model to call ``generate`` on inside the block, in eval mode.

        Shared weights are all-gathered on entry; with ``metrics`` that costs
        ``timing_s/weight_sync`` and ``perf/weight_sync_bytes`` (bytes of the
        full weights this rank all-gathered, counted).
        """
        if not self.shared:
            yield self.copy
            return
        counter = collective_bytes()
        with ExitStack() as stack:
            stack.enter_context(eval_mode(self.actor_model))
            before = counter.all_gather
            with metrics.timer("weight_sync") if metrics is not None else nullcontext():
                model = stack.enter_context(unsharded(self.actor_model, keep=self.keep_gathered))
            if metrics is not None:  # counted: 0 when they were still gathered from before
                metrics.add_sum("perf/weight_sync_bytes", counter.all_gather - before)
            yield model

    def sync(self) -> int:
        """After an optimizer step (or a checkpoint load): refresh a copy; bytes all-gathered
        (0 when shared: the next ``policy`` gathers)."""
        if self.shared:
            return 0
        return sync_rollout_weights(self.actor_model, self.copy)


def grad_norm_and_clip(model: torch.nn.Module, max_norm: float) -> float:
    """Global L2 gradient norm over all shards (before clipping); clips in place."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def all_reduce_sum(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum a small float64 vector over the ranks of this worker's pool (metadata-sized; every
    rank in sync mode, ``process_group.pool_group``)."""
    buf = values.to(device=device, dtype=torch.float64)
    if process_group.pool_size() > 1:
        dist.all_reduce(buf, group=process_group.pool_group())
    return buf.cpu()
