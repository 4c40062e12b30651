"""Load a model straight into its FSDP2 shards: no rank ever holds the whole model.

``load_sharded_causal_lm`` builds the model from its config with parameters
on the meta device (buffers such as rotary frequencies stay real), shards it
(``apply_fsdp``), allocates only this rank's shards on the target device,
and fills them from the safetensors files with row slices: rank r of W
reads rows ``[r * ceil(n / W), (r + 1) * ceil(n / W))`` of each parameter,
FSDP2's dim-0 sharding. Host memory per rank hence falls as 1/W (plus the
file pages of those slices), and the device never sees an unsharded copy.
The actor and the reference load so (``load_sharded_causal_lm``), the critic's
value model too (``load_sharded`` with its new head ``fresh``); a rollout
engine's own copy (``rollout_copy``) is filled from the actor's shards, one
gathered parameter at a time, not from the files. A model that a checkpoint
will fill (a resumed run's actor and critic) is allocated the same way but
not read (``fill=False``): the checkpoint load writes every parameter.

Deliberately simplified: the checkpoint's tensor names must be the model's
parameter names (true of models saved by transformers; checkpoints that
need transformers' key renaming are rejected, naming the missing keys).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from distflow.engines.fsdp import apply_fsdp, sync_rollout_weights


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Parameter name -> the safetensors file that holds it (single file or sharded index).

    Raises:
        ValueError: the directory holds no safetensors weights.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"model.path {str(model_dir)!r}: no model.safetensors (or its index); "
                         "save the model with safe_serialization=True")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _shard_rows(param: DTensor) -> tuple[int, int]:
    """[start, stop) rows of the full parameter held by this rank (FSDP2: torch.chunk on dim 0
    over the mesh dimension it shards on; the others, HSDP's replicas, hold the same rows)."""
    rows = param.shape[0]
    start, stop = 0, rows
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            assert placement.dim == 0, (param.shape, param.placements)
            per_rank = -(-(stop - start) // param.device_mesh.size(dim))
            start = min(stop, start + param.device_mesh.get_local_rank(dim) * per_rank)
            stop = min(stop, start + per_rank)
    return start, stop


@torch.no_grad()
def _fill_shards(model: torch.nn.Module, model_dir: Path, fresh: frozenset[str] = frozenset(),
                 prefix: tuple[str, str] = ("", "")) -> None:
    """Copy this rank's rows of every parameter but those named in ``fresh`` from the
    safetensors files into its shard; a name starting ``prefix[0]`` is read as ``prefix[1]`` + the rest."""
    from safetensors import safe_open

    files = _tensor_files(model_dir)
    ours, theirs = prefix
    params = {theirs + name[len(ours):] if name.startswith(ours) else name: p
              for name, p in model.named_parameters() if name not in fresh}
    missing = sorted(set(params) - set(files))
    if missing:
        raise ValueError(f"model.path {str(model_dir)!r}: the checkpoint lacks {missing[:5]} "
                         f"({len(missing)} parameters); re-save it with transformers' save_pretrained")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                param = params[name]
                local = param.to_local() if isinstance(param, DTensor) else param
                start, stop = _shard_rows(param) if isinstance(param, DTensor) else (0, param.shape[0])
                assert stop - start == local.shape[0], (name, start, stop, local.shape)
                if stop > start:
                    local.copy_(f.get_slice(name)[start:stop])


def load_sharded(model: torch.nn.Module, model_dir: str | os.PathLike, mesh: DeviceMesh, device: torch.device,
                 compute_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
                 fresh: frozenset[str] = frozenset(), prefix: tuple[str, str] = ("", ""),
                 fill: bool = True) -> torch.nn.Module:
    """``model``, built with its parameters on the meta device, sharded over ``mesh`` (FSDP2)
    with this rank's shards allocated on ``device`` and read from the safetensors in ``model_dir``.

    Args:
        fresh: parameters the checkpoint does not hold (a new head); they are left
            uninitialised (``to_empty``) for the caller to set.
        prefix: (the model's, the checkpoint's) name prefix of the same parameters, e.g. a
            backbone kept as ``model.`` but saved under its ``base_model_prefix``.
        fill: False: allocate the shards but leave every parameter uninitialised (the
            safetensors files are not opened), for a checkpoint load to write them all
            (``distflow.checkpoint.load``, which refuses a checkpoint that lacks one).

    Raises:
        ValueError: (``fill``) no safetensors weights, or a parameter (not in ``fresh``) they lack.
    """
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    apply_fsdp(model, mesh, compute_dtype, reshard_after_forward)
    _allocate(model, device, buffers)  # only the shards
    if fill:
        _fill_shards(model, Path(model_dir), fresh, prefix)
    return model


@torch.no_grad()
def _allocate(model: torch.nn.Module, device: torch.device, buffers: dict[str, torch.Tensor]) -> None:
    """``to_empty`` on ``device``, then the buffers' values back (``to_empty`` drops them too)."""
    model.to_empty(device=device)
    for name, buf in model.named_buffers():
        buf.copy_(buffers[name])


def empty_causal_lm(model_dir: str | os.PathLike, dtype: torch.dtype, auto_class: str = "AutoModelForCausalLM"):
    """The model of ``model_dir``'s config with parameters on the meta device (buffers, such as
    rotary frequencies, real); ``auto_class`` ``AutoModel`` gives the backbone without its LM head."""
    from accelerate import init_empty_weights
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model = getattr(transformers, auto_class).from_config(config, dtype=dtype)
    model.tie_weights()  # from_pretrained ties (e.g. lm_head to the embeddings); from_config may not
    return model


def load_sharded_causal_lm(model_dir: str | os.PathLike, mesh: DeviceMesh, device: torch.device,
                           dtype: torch.dtype, compute_dtype: torch.dtype | None = None,
                           gradient_checkpointing: bool = False,
                           reshard_after_forward: bool = True, fill: bool = True) -> torch.nn.Module:
    """The causal LM in ``model_dir`` under FSDP2 over ``mesh``, this rank's shards only.

    Args:
        dtype: dtype of the sharded (master) parameters.
        compute_dtype: the all-gather and compute dtype (``apply_fsdp``).
        gradient_checkpointing: enable it before sharding (for a trained model).
        reshard_after_forward: the decoder layers' FSDP2 setting (``apply_fsdp``).
        fill: False: the parameters are allocated, not read (``load_sharded``): only the
            config (and generation config) of ``model_dir`` is read, for a checkpoint to fill.

    Returns:
        The model, its parameters equal bit for bit to ``from_pretrained(model_dir, dtype=dtype)``'s
        (``fill``; else uninitialised).

    Raises:
        ValueError: (``fill``) no safetensors weights, or tensor names that are not the model's parameters.
    """
    model = empty_causal_lm(model_dir, dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    load_sharded(model, model_dir, mesh, device, compute_dtype, reshard_after_forward, fill=fill)
    model.generation_config = _generation_config(Path(model_dir), model.generation_config)
    return model


@torch.no_grad()
def rollout_copy(model_dir: str | os.PathLike, actor: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype) -> torch.nn.Module:
    """An unsharded copy of the actor's weights in ``dtype`` on ``device``, for a rollout engine
    that keeps its own (``rollout.shareActorWeights: false``).

    Filled from the actor's shards one parameter at a time (``sync_rollout_weights``, as after
    every update), not read from disk: no rank holds the checkpoint's full state dict beside
    the copy, which the engine needs whole to generate.
    """
    copy = rollout_replica(model_dir, device, dtype)
    sync_rollout_weights(actor, copy)
    return copy


def rollout_replica(model_dir: str | os.PathLike, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """An unsharded model of ``model_dir``'s architecture in ``dtype`` on ``device``, in eval mode,
    its parameters allocated but NOT filled: the caller copies weights in (``rollout_copy`` from
    the actor's shards; a rollout pool worker from the trainer pool's weight sync,
    ``distflow.pools.weight_sync``). Buffers (rotary frequencies) are the config's."""
    copy = empty_causal_lm(model_dir, dtype)
    _allocate(copy, device, {name: buf.clone() for name, buf in copy.named_buffers()})
    copy.tie_weights()  # to_empty gives each module its own tensor, untying lm_head from the embeddings
    copy.generation_config = _generation_config(Path(model_dir), copy.generation_config)
    return copy.eval()


def _generation_config(model_dir: Path, default):
    """The directory's generation_config.json, as ``from_pretrained`` would attach it."""
    from transformers import GenerationConfig

    if (model_dir / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(model_dir)
    return default
