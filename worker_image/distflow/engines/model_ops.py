"""Collation and forward passes shared by the actor, reference and critic.

A step's samples travel packed (``PackedBatch``: token fields ``[T_total]``
spanning prompt + response, ``response_mask`` 1 on generated tokens). For a
forward pass a micro-batch is left-padded into ``[b, L]`` so that every
response ends at column L-1; the model then only needs logits for the last
``R + 1`` positions (``logits_to_keep``), R = the longest response. Prompt
tokens never go through the LM head, which on a 49k vocabulary is a large
share of the FLOPs.

Every per-token tensor the algorithms see is this *response window*
``[b, R]``: column j of row i is token ``L - R + j`` of that row.

Shared prompt prefixes (Prefix Grouper, Liu et al. 2025, arXiv 2506.05433):
the n responses of a GRPO prompt repeat its P prompt tokens n times. With
``share_prompt_prefix`` the forward pass instead runs one row
``[prompt, r_1, ..., r_k]`` per prompt of the micro-batch (``PrefixRows``):
a 4-D attention mask lets each response see the whole prompt and its own
earlier tokens but no other response, and its position ids continue from P,
so every response's hidden states, and hence log-probs, entropies and
gradients, equal the per-sample pass's up to float rounding. The results are
scattered back into the same response window, so callers do not change.

The mask takes one of two forms (``SHARED_ATTENTION``). ``flex``:
FlexAttention's ``BlockMask`` (torch.nn.attention.flex_attention), built from
the ``[g, S]`` segment ids, so no ``[g, S, S]`` tensor is kept and fully masked
128x128 tiles (one response against another) are skipped; the default on CUDA.
``dense``: the ``[g, 1, S, S]`` boolean mask for sdpa/eager; the default on
CUDA where Triton cannot compile (no C compiler or Python headers: ``can_compile``) and on
CPU, where FlexAttention runs eagerly at ~8x the dense time or compiles for
minutes per shape (docs/benchmarks.md, shared-prompt attention).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import sysconfig
from dataclasses import dataclass

import torch

from distflow import process_group
from distflow.algorithms import log_probs_and_entropy
from distflow.data.batch import PackedBatch, from_padded
from distflow.engines import flex_masks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixRows:
    """A micro-batch regrouped so that samples with one prompt share one row.

    Samples share a row when their ``group_index`` is equal and their prompt
    tokens are identical (both are checked). Row r is ``[prompt, r_1, ..., r_k]``
    followed by right padding: g rows of width S. M counts the response tokens
    of the micro-batch.
    """

    input_ids: torch.Tensor
    """[g, S] int64, right-padded."""
    position_ids: torch.Tensor
    """[g, S] 0..P-1 on the prompt; P, P+1, ... again on every response; 0 on padding."""
    segment: torch.Tensor
    """[g, S] int64: 0 on the prompt, k on the row's k-th response (1-based), -1 on padding."""
    keep: torch.Tensor
    """[g, S] bool: positions whose logits are needed (the last prompt token, and
    every response token but the response's last)."""
    logit_index: torch.Tensor
    """[M] int64: for each response token, the position predicting it, as an index
    into the kept positions in row-major order."""
    labels: torch.Tensor
    """[M] int64: the response tokens."""
    window_index: torch.Tensor
    """[M] int64: where each response token sits in the flattened ``[b, R]`` response window."""

    def attention_allowed(self, device: torch.device) -> torch.Tensor:
        """[g, S, S] bool, True where query position q may attend key position k.

        Causal, and a key is visible when it is a prompt token or in the
        query's own segment: responses see the prompt and themselves, never
        each other; padding sees the prompt and padding (never an empty row),
        and no real token sees padding.
        """
        segment = self.segment.to(device)
        pos = torch.arange(segment.shape[1], device=device)
        causal = pos[:, None] >= pos[None, :]
        key, query = segment[:, None, :], segment[:, :, None]
        return causal & ((key == 0) | (key == query))

    def block_mask(self, device: torch.device):
        """``attention_allowed`` as a FlexAttention ``BlockMask`` over ``[g, 1, S, S]``.

        The mask function reads the ``[g, S]`` segment ids; the dense mask is
        never kept (on CUDA never built: the block mask is computed tile by tile).
        """
        from torch.nn.attention.flex_attention import create_block_mask

        segment = self.segment.to(device)

        def allowed(b, h, q, k):
            key = segment[b, k]
            return (q >= k) & ((key == 0) | (key == segment[b, q]))

        g, width = segment.shape
        return create_block_mask(allowed, g, None, width, width, device=device,
                                 _compile=device.type == "cuda")

    def padded(self, width: int) -> "PrefixRows":
        """The same rows right-padded to ``width`` >= S columns (``flex_masks.bucketed_width``).

        New columns are padding (segment -1, nothing kept), which no real token attends
        to; their token id 0 is never read. Kept positions keep their order, so
        ``logit_index``, ``labels`` and ``window_index`` stay as they are.
        """
        extra = width - self.segment.shape[1]
        assert extra >= 0, (width, self.segment.shape)
        pad = lambda t, value: torch.nn.functional.pad(t, (0, extra), value=value)  # noqa: E731
        return dataclasses.replace(self, input_ids=pad(self.input_ids, 0), position_ids=pad(self.position_ids, 0),
                                   segment=pad(self.segment, -1), keep=pad(self.keep, False))


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward's inputs."""

    input_ids: torch.Tensor
    """[b, L] int64, left-padded."""
    attention_mask: torch.Tensor
    """[b, L] 1 on real tokens."""
    position_ids: torch.Tensor
    """[b, L] positions counted from each row's first real token (as in generation)."""
    response_mask: torch.Tensor
    """[b, R] float, 1 on the model's own tokens in the response window (0 on a multi-turn response's tool tokens)."""
    source: PackedBatch
    """The packed samples this micro-batch came from."""
    prefix_rows: PrefixRows | None = None
    """The shared-prompt layout that ``forward_log_probs`` runs instead of
    ``input_ids``; None when not asked for or when no two samples share a prompt."""

    @property
    def window(self) -> int:
        """R: columns in the response window."""
        return self.response_mask.shape[1]


def collate(batch: PackedBatch, pad_token_id: int, share_prompt_prefix: bool = False,
            host: PackedBatch | None = None) -> MicroBatch:
    """Left-pad packed samples for a forward pass.

    Needs token fields ``input_ids`` and ``response_mask`` ([T_total]);
    ``share_prompt_prefix`` also needs sample fields ``prompt_len``,
    ``response_len`` and ``group_index`` (without ``group_index`` nothing is shared).
    The lengths and the shared rows are read from ``host``, the same samples'
    ``metadata_on_host`` (default: ``batch`` itself, a device sync per read on CUDA).
    An empty ``batch`` (``fill_micro_batches``' padding) gives one row of two pad
    tokens and an all-zero ``response_mask`` [1, 1]: a forward that trains nothing.
    """
    if batch.num_samples == 0:
        pad = torch.full((1, 2), pad_token_id, dtype=torch.long)
        return MicroBatch(pad, torch.ones_like(pad), torch.arange(2).unsqueeze(0), torch.zeros(1, 1), batch)
    lens = batch.seq_lens
    width = int(lens.max())
    input_ids = batch.to_padded("input_ids", pad_value=pad_token_id, max_len=width, left_pad=True)
    attention_mask = (torch.arange(width).unsqueeze(0) >= (width - lens).unsqueeze(1)).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    resp_full = batch.to_padded("response_mask", pad_value=0, max_len=width, left_pad=True)
    host = batch if host is None else host
    window = max(1, int(host.sample_fields["response_len"].max()))
    # Older transformers (no boolean logits_to_keep) run the per-sample path: same results, more FLOPs.
    shared = share_prompt_prefix and _logits_to_keep_takes_a_mask()
    rows = share_prompts(host, pad_token_id, window) if shared else None
    return MicroBatch(input_ids, attention_mask, position_ids,
                      resp_full[:, -window:].float(), batch, rows)


def share_prompts(batch: PackedBatch, pad_token_id: int, window: int) -> PrefixRows | None:
    """The shared-prompt layout of ``batch``, rows in order of their first sample.

    Args:
        window: R, the response window's width (>= every ``response_len``).
    Returns:
        None when ``batch`` has no ``group_index`` or no two samples share a prompt.
    Raises:
        ValueError: a sample whose ``prompt_len`` is 0 or whose ``prompt_len +
            response_len`` is not its length.
    """
    if "group_index" not in batch.sample_fields:
        return None
    ids = batch.token_fields["input_ids"].cpu()
    offsets = batch.token_offsets
    prompt_lens = batch.sample_fields["prompt_len"].tolist()
    resp_lens = batch.sample_fields["response_len"].tolist()
    rows: dict[tuple, list[int]] = {}
    for i, (group, p, r, n) in enumerate(zip(batch.sample_fields["group_index"].tolist(), prompt_lens,
                                             resp_lens, batch.seq_lens.tolist())):
        if p < 1 or p + r != n:
            raise ValueError(f"sample {i}: prompt_len {p} + response_len {r} must be its length {n}, "
                             "with a prompt of at least one token")
        rows.setdefault((group, tuple(ids[offsets[i]:offsets[i] + p].tolist())), []).append(i)
    if len(rows) == batch.num_samples:
        return None
    members = list(rows.values())
    width = max(prompt_lens[m[0]] + sum(resp_lens[i] for i in m) for m in members)
    input_ids = torch.full((len(members), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(members), width), dtype=torch.long)
    segment = torch.full((len(members), width), -1, dtype=torch.long)
    keep = torch.zeros((len(members), width), dtype=torch.bool)
    predictor, labels, window_index = [], [], []
    for row, samples in enumerate(members):
        p = prompt_lens[samples[0]]
        input_ids[row, :p] = ids[offsets[samples[0]]:offsets[samples[0]] + p]
        position_ids[row, :p] = torch.arange(p)
        segment[row, :p] = 0
        keep[row, p - 1] = True
        start = p
        for k, i in enumerate(samples, start=1):
            r = resp_lens[i]
            labels.append(ids[offsets[i] + p:offsets[i + 1]])
            input_ids[row, start:start + r] = labels[-1]
            position_ids[row, start:start + r] = torch.arange(p, p + r)
            segment[row, start:start + r] = k
            keep[row, start:start + r - 1] = True
            # Token 0 is predicted by the last prompt position, token t > 0 by token t - 1.
            predictor += [row * width + p - 1] + [row * width + c for c in range(start, start + r - 1)]
            window_index += range(i * window + window - r, (i + 1) * window)
            start += r
    kept_rank = keep.flatten().cumsum(0) - 1
    return PrefixRows(input_ids, position_ids, segment, keep,
                      logit_index=kept_rank[torch.tensor(predictor, dtype=torch.long)],
                      labels=torch.cat(labels), window_index=torch.tensor(window_index, dtype=torch.long))


def window_field(mb: MicroBatch, name: str) -> torch.Tensor:
    """Token field ``name`` of the micro-batch as its response window ``[b, R]``."""
    width = mb.input_ids.shape[1]
    return mb.source.to_padded(name, pad_value=0, max_len=width, left_pad=True)[:, -mb.window:]


def unwindow(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
    """Inverse of ``window_field``: ``[b, R]`` -> packed ``[T_total]`` with 0 on prompt tokens."""
    full = values.new_zeros(mb.input_ids.shape)
    full[:, -mb.window:] = values * mb.response_mask.to(values.dtype)
    return from_padded(full, mb.source.seq_lens, left_pad=True)


def forward_log_probs(model, mb: MicroBatch, temperature: float, with_entropy: bool,
                      entropy_grad: bool = False, shared_attention: str = "auto"):
    """Log-probabilities of the response tokens under ``model``.

    Runs ``mb.prefix_rows`` when set (see ``_shared_prompt_forward``; its mask
    form is ``shared_attention``, one of ``SHARED_ATTENTION``), else the
    left-padded ``[b, L]`` micro-batch. The model computes in its (FSDP
    mixed-precision) parameter dtype; the logits are reduced blockwise in
    float32 (``log_probs_and_entropy``), never copied whole.

    Args:
        entropy_grad: let the entropy take part in backward (an entropy bonus).

    Returns:
        (log_probs [b, R] float32, entropy [b, R] float32 or None). Positions
        outside the response mask hold garbage; callers mask them.
    """
    device = next(model.parameters()).device
    if mb.prefix_rows is not None:
        backend = shared_attention_backend(model, device, shared_attention)
        if backend is not None:
            return _shared_prompt_forward(model, mb, temperature, with_entropy, entropy_grad, backend)
    out = model(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                position_ids=mb.position_ids.to(device), logits_to_keep=mb.window + 1, use_cache=False)
    # All R + 1 kept positions, the last with a dummy label: slicing it off the logits
    # would make autograd allocate a second [b, R + 1, V] gradient.
    labels = torch.nn.functional.pad(mb.input_ids[:, -mb.window:], (0, 1)).to(device)
    log_probs, entropy = log_probs_and_entropy(out.logits, labels, temperature, entropy_grad)
    return log_probs[:, :-1], entropy[:, :-1] if with_entropy else None


def _shared_prompt_forward(model, mb: MicroBatch, temperature: float, with_entropy: bool,
                           entropy_grad: bool, backend: str):
    """``forward_log_probs`` over ``mb.prefix_rows``: each prompt runs once per row.

    The model gets the ``[g, S]`` rows, the attention mask (a ``BlockMask``
    under FlexAttention for ``backend`` flex, S bucketed and the mask built once
    per micro-batch by ``flex_masks``; else ``[g, 1, S, S]``) and,
    as ``logits_to_keep``, the ``[g, S]`` boolean ``keep`` mask, so only the
    ``N = keep.sum()`` needed positions go through the LM head ([N, V] logits;
    needs a transformers whose models accept a boolean ``logits_to_keep``).
    The last prompt position's logits serve the first token of every response
    of its row.

    Returns:
        (log_probs [b, R] float32, entropy [b, R] float32 or None), 0 outside
        the responses.

    Raises:
        ValueError: the model's attention implementation is neither sdpa nor eager.
        RuntimeError: the installed transformers takes no boolean ``logits_to_keep``.
    """
    if not _logits_to_keep_takes_a_mask():
        import transformers

        raise RuntimeError(f"actor.sharePromptPrefix needs a transformers whose models take a boolean [b, L] "
                           f"logits_to_keep; {transformers.__version__} does not: upgrade it or set "
                           "actor.sharePromptPrefix: false")
    rows = mb.prefix_rows
    device = next(model.parameters()).device
    if backend == "flex":
        rows = rows.padded(flex_masks.bucketed_width(rows.segment.shape[1]))
        mask, attention = flex_masks.block_mask(rows, device), _attention_implementation(model, "flex_attention")
    else:
        mask, attention = _attention_mask(model, rows.attention_allowed(device)), contextlib.nullcontext()
    with attention:
        out = model(input_ids=rows.input_ids.to(device), attention_mask=mask,
                    position_ids=rows.position_ids.to(device), logits_to_keep=rows.keep.to(device),
                    use_cache=False)
    index, where = rows.logit_index.to(device), rows.window_index.to(device)
    b, window = mb.response_mask.shape

    def to_window(per_token: torch.Tensor) -> torch.Tensor:
        return per_token.new_zeros(b * window).index_put((where,), per_token).view(b, window)

    # Each row's last prompt position serves all its responses: a [M, V] copy of the
    # N kept positions' logits, with M - N = responses - rows.
    log_probs, entropy = log_probs_and_entropy(out.logits[index], rows.labels.to(device), temperature,
                                               entropy_grad)
    return to_window(log_probs), to_window(entropy) if with_entropy else None


@functools.cache
def _logits_to_keep_takes_a_mask() -> bool:
    """Whether transformers' causal LMs slice hidden states by a boolean [b, L] ``logits_to_keep``."""
    from transformers import modeling_utils

    slice_fn = getattr(modeling_utils, "slice_logits_to_keep", None)
    return slice_fn is not None and slice_fn(torch.zeros(1, 2, 1), torch.tensor([[True, False]])).shape == (1, 1)


_MASKABLE_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take a 4-D mask as is; others (flash attention)
run the per-sample path unless FlexAttention serves the shared layout."""

SHARED_ATTENTION = ("auto", "flex", "dense")
"""How the shared-prompt layout's mask reaches attention: ``flex`` (a FlexAttention
``BlockMask``), ``dense`` (a ``[g, 1, S, S]`` mask for sdpa/eager), or ``auto``
(flex on CUDA when torch has FlexAttention and ``can_compile``, else dense)."""


def shared_attention_backend(model, device: torch.device, requested: str = "auto") -> str | None:
    """``flex`` or ``dense`` for the shared-prompt forward, or None: run the per-sample path.

    Raises:
        ValueError: ``requested`` is not one of ``SHARED_ATTENTION``, or is
            flex and this torch has no FlexAttention.
    """
    if requested not in SHARED_ATTENTION:
        raise ValueError(f"shared_attention is {requested!r}; choose one of {SHARED_ATTENTION}")
    flex = _has_flex_attention()
    if requested == "flex" and not flex:
        raise ValueError(f"shared_attention 'flex' needs torch.nn.attention.flex_attention, which torch "
                         f"{torch.__version__} lacks; use 'dense' or 'auto'")
    if requested == "flex" or (requested == "auto" and flex and device.type == "cuda" and can_compile()):
        return "flex"
    return "dense" if model.config._attn_implementation in _MASKABLE_ATTENTION else None


@functools.cache
def _has_flex_attention() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def can_compile() -> bool:
    """Whether Triton can build its kernels' launchers here: a C compiler where Triton looks
    for one (``$CC``, else ``gcc`` or ``clang`` on PATH: triton/runtime/build.py) and the
    Python headers (``Python.h``). FlexAttention on CUDA is ``torch.compile``d into Triton
    kernels; without either, the first forward fails deep inside Inductor. Cached, so the
    warning is logged once per process."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    headers = os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if compiler and headers:
        return True
    missing = "a C compiler ($CC, gcc or clang)" if not compiler else "the Python headers (Python.h)"
    log.warning(
        "no %s: FlexAttention cannot compile, so the shared-prompt forward uses the dense "
        "attention mask (install gcc and python3-dev, as the worker image does)", missing)
    return False


@contextlib.contextmanager
def _attention_implementation(model, name: str):
    """Run ``model``'s attention as ``name`` for one forward (transformers looks the
    implementation up per call; setting it on the config reaches every sub-config)."""
    before = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = before


def _attention_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """``allowed`` [g, S, S] as the [g, 1, S, S] mask the model's attention takes as is.

    transformers passes a 4-D mask through unchanged: sdpa takes it boolean
    (True = attend), eager adds it to the scores, so it gets 0 / float min.

    Raises:
        ValueError: another attention implementation (flash attention takes no 4-D mask).
    """
    impl = model.config._attn_implementation
    allowed = allowed.unsqueeze(1)
    if impl == "sdpa":
        return allowed
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)
    raise ValueError(f"actor.sharePromptPrefix needs a 4-D attention mask, which the model's "
                     f"{impl!r} attention does not take; use sdpa or eager, or set "
                     "actor.sharePromptPrefix: false")


def split_micro_batches(batch: PackedBatch, micro_batch_size: int,
                        max_tokens: int | None = None) -> list[PackedBatch]:
    """Consecutive chunks of ``batch`` (order kept), one per forward/backward.

    Args:
        micro_batch_size: samples per chunk at most (when ``max_tokens`` is None).
        max_tokens: instead a token budget (verl's dynamic batch size): a chunk
            of b samples whose longest has L tokens is the left-padded [b, L]
            forward, so each chunk is the longest run with b * L <= max_tokens
            (a single longer sample goes alone).
    """
    n = batch.num_samples
    if max_tokens is None:
        return [batch.select(range(i, min(n, i + micro_batch_size))) for i in range(0, n, micro_batch_size)]
    chunks, start, longest = [], 0, 0
    for i, length in enumerate(batch.seq_lens.tolist()):
        longest = max(longest, length)
        if i > start and (i - start + 1) * longest > max_tokens:
            chunks.append(batch.select(range(start, i)))
            start, longest = i, length
    if n > start:
        chunks.append(batch.select(range(start, n)))
    return chunks


def fill_micro_batches(batch: PackedBatch, chunks: list[PackedBatch], count: int) -> list[PackedBatch]:
    """``chunks`` (consecutive pieces of ``batch``) made ``count`` long, order kept.

    The chunk of two or more samples with the largest padded forward (b x L
    tokens) is halved until there are ``count`` chunks, so a token budget still
    holds; when every chunk is down to one sample, empty chunks (no samples)
    follow, each a zero-weight forward/backward (see ``collate``).

    Raises:
        ValueError: ``count`` is less than ``len(chunks)``.
    """
    if count < len(chunks):
        raise ValueError(f"fill_micro_batches: cannot make {len(chunks)} micro-batches into {count}")
    chunks = list(chunks)
    while len(chunks) < count:
        splittable = [i for i, c in enumerate(chunks) if c.num_samples > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda j: chunks[j].num_samples * int(chunks[j].seq_lens.max()))
        half = (chunks[i].num_samples + 1) // 2
        chunks[i:i + 1] = [chunks[i].slice(0, half), chunks[i].slice(half, chunks[i].num_samples)]
    return chunks + [batch.select([])] * (count - len(chunks))


_HOST_SAMPLE_FIELDS = ("prompt_len", "response_len", "group_index")


def metadata_on_host(batch: PackedBatch, with_input_ids: bool = False) -> PackedBatch:
    """What ``collate`` reads on the host, as a CPU batch copied in one device->host transfer.

    Sample fields ``prompt_len``, ``response_len`` and ``group_index`` (those present) and,
    with ``with_input_ids`` (shared prompt rows are laid out from the tokens), token field
    ``input_ids`` [T_total], all integers.
    """
    sample = {k: batch.sample_fields[k] for k in _HOST_SAMPLE_FIELDS if k in batch.sample_fields}
    token = {"input_ids": batch.token_fields["input_ids"]} if with_input_ids else {}
    fields = {**token, **sample}
    if not fields:
        return PackedBatch(batch.seq_lens)
    flat = torch.cat([v.reshape(-1).long() for v in fields.values()]).cpu()
    host = {k: piece.view(v.shape).to(v.dtype)
            for (k, v), piece in zip(fields.items(), flat.split([v.numel() for v in fields.values()]))}
    return PackedBatch(batch.seq_lens, {k: host[k] for k in token}, {k: host[k] for k in sample})


def dp_micro_batches(batch: PackedBatch, micro_batch_size: int, max_tokens: int | None = None,
                     share_prompt_prefix: bool = False) -> list[tuple[PackedBatch, PackedBatch]]:
    """``split_micro_batches`` with the same number of chunks on every rank (collective).

    FSDP2 all-gathers parameters and reduce-scatters gradients in every
    forward/backward, so ranks running different numbers of them wait on each
    other forever. The count is the largest any rank cuts (verl's
    ``same_micro_num_in_dp``); a rank with fewer cuts finer or pads
    (``fill_micro_batches``). Every rank must call it, once per pass.

    Returns:
        (chunk, its ``metadata_on_host``) pairs for ``collate``: the metadata of the
        whole batch crosses to the host once, not once per micro-batch.
    """
    host = metadata_on_host(batch, with_input_ids=share_prompt_prefix)
    chunks = split_micro_batches(host, micro_batch_size, max_tokens)
    pairs, start = [], 0
    for chunk in fill_micro_batches(host, chunks, process_group.max_over_ranks(len(chunks))):
        pairs.append((batch.slice(start, start + chunk.num_samples), chunk))
        start += chunk.num_samples
    return pairs


@torch.no_grad()
def compute_log_probs(model, batch: PackedBatch, pad_token_id: int, micro_batch_size: int,
                      temperature: float, share_prompt_prefix: bool = False,
                      max_tokens: int | None = None) -> torch.Tensor:
    """Per-token log-probs of a whole local batch, packed ``[T_total]`` (0 on prompt tokens).

    ``share_prompt_prefix``: run each micro-batch's prompts once (see ``collate``);
    ``micro_batch_size`` and ``max_tokens``: see ``split_micro_batches``; every
    rank runs as many forwards (``dp_micro_batches``), so every rank must call it.
    """
    pieces = []
    for chunk, host in dp_micro_batches(batch, micro_batch_size, max_tokens, share_prompt_prefix):
        mb = collate(chunk, pad_token_id, share_prompt_prefix, host)
        lp, _ = forward_log_probs(model, mb, temperature, False)
        if chunk.num_samples:
            pieces.append(unwindow(mb, lp.to(batch.device)))  # stays on the step data's device
    if not pieces:
        return torch.zeros(0, device=batch.device)
    return torch.cat(pieces)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """``model`` in eval mode inside the block, its previous mode restored after.

    Inference stages (rollout, old and reference log-probs) run in it: the
    actor update leaves the policy in train mode, where dropout would perturb
    what is sampled and scored.
    """
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
