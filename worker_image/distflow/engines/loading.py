"""Load a causal LM straight into its FSDP2 shards: no rank ever holds the whole model.

``load_sharded_causal_lm`` builds the model from its config with parameters
on the meta device (buffers such as rotary frequencies stay real), shards it
(``apply_fsdp``), allocates only this rank's shards on the target device,
and fills them from the safetensors files with row slices: rank r of W
reads rows ``[r * ceil(n / W), (r + 1) * ceil(n / W))`` of each parameter,
FSDP2's dim-0 sharding. Host memory per rank hence falls as 1/W (plus the
file pages of those slices), and the device never sees an unsharded copy.

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
from torch.distributed.tensor import DTensor

from distflow.engines.fsdp import apply_fsdp


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


def _shard_rows(param: torch.nn.Parameter, mesh: DeviceMesh) -> tuple[int, int]:
    """[start, stop) rows of the full parameter held by this rank (FSDP2: torch.chunk on dim 0)."""
    rows = param.shape[0]
    per_rank = -(-rows // mesh.size())
    start = min(rows, mesh.get_local_rank() * per_rank)
    return start, min(rows, start + per_rank)


@torch.no_grad()
def _fill_shards(model: torch.nn.Module, model_dir: Path, mesh: DeviceMesh) -> None:
    """Copy this rank's rows of every parameter from the safetensors files into its shard."""
    from safetensors import safe_open

    files = _tensor_files(model_dir)
    params = dict(model.named_parameters())
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
                start, stop = _shard_rows(param, mesh) if isinstance(param, DTensor) else (0, param.shape[0])
                assert stop - start == local.shape[0], (name, start, stop, local.shape)
                if stop > start:
                    local.copy_(f.get_slice(name)[start:stop])


def load_sharded_causal_lm(model_dir: str | os.PathLike, mesh: DeviceMesh, device: torch.device,
                           dtype: torch.dtype, compute_dtype: torch.dtype | None = None,
                           gradient_checkpointing: bool = False,
                           reshard_after_forward: bool = True) -> torch.nn.Module:
    """The causal LM in ``model_dir`` under FSDP2 over ``mesh``, this rank's shards only.

    Args:
        dtype: dtype of the sharded (master) parameters.
        compute_dtype: the all-gather and compute dtype (``apply_fsdp``).
        gradient_checkpointing: enable it before sharding (for a trained model).
        reshard_after_forward: the decoder layers' FSDP2 setting (``apply_fsdp``).

    Returns:
        The model, its parameters equal bit for bit to ``from_pretrained(model_dir, dtype=dtype)``'s.

    Raises:
        ValueError: no safetensors weights, or tensor names that are not the model's parameters.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # from_pretrained ties (e.g. lm_head to the embeddings); from_config may not
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    apply_fsdp(model, mesh, compute_dtype, reshard_after_forward)
    model.to_empty(device=device)  # allocates the shards; buffers come back empty, so refill them
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    _fill_shards(model, model_dir, mesh)
    model.generation_config = _generation_config(model_dir, model.generation_config)
    return model


def _generation_config(model_dir: Path, default):
    """The directory's generation_config.json, as ``from_pretrained`` would attach it."""
    from transformers import GenerationConfig

    if (model_dir / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(model_dir)
    return default
