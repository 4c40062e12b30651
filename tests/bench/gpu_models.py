"""Random-initialised models for the GPU check, built offline, and the FLOP arithmetic of an update.

The GPU machine has no network and no model package, so every model here is a
Qwen2-shaped decoder built from a config with random weights, with distflow's
byte tokenizer (259 ids, built offline: ``distflow.models.build_byte_tokenizer``).
The vocabulary is the tokenizer's, so the parameter counts below are the real
models' without their 151,936-row embedding tables (Qwen2-1.5B: 1.31 B of its
1.54 B parameters are outside the embeddings).
"""

from __future__ import annotations

from pathlib import Path

import torch

QWEN2_SHAPES = {  # name -> (hidden, intermediate, layers, heads, kv heads), the published Qwen2/2.5 configs
    "7b": (3584, 18944, 28, 28, 4),
    "3b": (2048, 11008, 36, 16, 2),
    "1.5b": (1536, 8960, 28, 12, 2),
    "0.5b": (896, 4864, 24, 14, 2),
    "tiny": (64, 128, 2, 4, 2),
}
"""``tiny`` is the CPU rehearsal's stand-in for every size: the same code path at toy size."""

TRAIN_BYTES_PER_PARAM = 20
"""Training state per parameter with fp32 master weights: weights, gradients and two AdamW
moments (16 B), the bf16 copy FSDP gathers for compute (2 B), and 2 B for activations."""

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 peak FLOP/s by device-name fragment (SXM parts, no sparsity), from the vendors' data sheets."""

MFU_ANCHOR = ("a public trainer-only figure: Qwen3-0.6B on one H100, 11,896 tokens/s at 11% MFU; "
              "target for the actor update on one H200: >= 40% MFU on the ~1.5B model")
MFU_TARGET = 0.40


def qwen2_config(shape: tuple, tokenizer, max_positions: int = 4096):
    """A ``Qwen2Config`` of ``shape`` with ``tokenizer``'s vocabulary and special ids."""
    from transformers import Qwen2Config

    hidden, inter, layers, heads, kv = shape
    return Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       max_position_embeddings=max_positions, tie_word_embeddings=True,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)


def num_params(shape: tuple, vocab_size: int) -> int:
    """Parameters of a Qwen2 decoder of ``shape`` with tied embeddings (q/k/v biases included)."""
    hidden, inter, layers, heads, kv = shape
    head_dim = hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv) + head_dim * (heads + 2 * kv)
    return layers * (attention + 3 * hidden * inter + 2 * hidden) + vocab_size * hidden + hidden


def largest_fitting(free_bytes: int) -> str:
    """The largest of ``QWEN2_SHAPES`` (but ``tiny``) whose training state fits 0.8 of ``free_bytes``."""
    for name, shape in QWEN2_SHAPES.items():
        if name != "tiny" and num_params(shape, 259) * TRAIN_BYTES_PER_PARAM <= 0.8 * free_bytes:
            return name
    return "0.5b"


def build_model(shape: tuple, device: torch.device, seed: int = 0):
    """(fp32 model on ``device`` with random weights from ``seed``, byte tokenizer)."""
    from transformers import AutoModelForCausalLM

    from distflow.models import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(qwen2_config(shape, tokenizer), dtype=torch.float32,
                                                     attn_implementation="sdpa")
    return model, tokenizer


def write_model(shape: tuple, out_dir: Path, device: torch.device) -> Path:
    """``build_model`` saved as a Hugging Face directory (bf16 safetensors, tokenizer) for ``distflow run``."""
    model, tokenizer = build_model(shape, device)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def peak_bf16_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak FLOP/s (``PEAK_BF16_FLOPS``), None when unknown (CPU)."""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name), None)


def update_mfu(params: int, tokens: int, seconds: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation of a training update: 6 * params * tokens (forward 2, backward 4
    FLOPs per parameter per token; attention's quadratic term left out, as is usual) over
    ``seconds`` at ``peak_flops``; None without a peak."""
    if not peak_flops or seconds <= 0:
        return None
    return 6 * params * tokens / seconds / peak_flops
