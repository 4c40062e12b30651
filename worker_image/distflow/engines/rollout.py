"""Rollout with Hugging Face `generate` (CPU and GPU).

Each rollout dp rank generates the groups of the prompts it read itself; the
``n`` responses of a prompt stay together on that rank, so group statistics
(GRPO) need no communication. The output is a ``PackedBatch`` whose token
fields span prompt + response:

- ``input_ids``      [T_total] int64
- ``response_mask``  [T_total] int8, 1 on generated tokens (EOS included): the model's own
  tokens; a multi-turn response also holds tool tokens, with mask 0 (``distflow.fields``)

and whose sample fields are ``prompt_len``, ``response_len``, ``group_index``
(global prompt index in the step) [B] int64.

Sampling is seeded per global sample: response ``j`` of the prompt with global
index ``g`` draws its t-th token from a uniform fixed by ``(step seed, g, j, t)``
(``sample_seed``, ``_PerSampleSampler``), whatever rank, chunk or micro-batch it
is generated in. A run resumed on another number of workers samples the
responses the old size would have sampled (up to float rounding of the logits,
which differs with batch shapes); on the same layout it is bit-reproducible.

Generation runs in chunks of whole groups (``micro_batch_size // n`` prompts of
``n`` samples; a group larger than ``micro_batch_size`` is split over chunks of
one prompt). With ``SamplingParams.share_prefill`` each chunk's distinct prompts
are prefilled once, all but their last token, and the KV cache is repeated for
the group before ``generate`` continues from it (see ``_shared_prefill``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from distflow import process_group
from distflow.data.batch import PackedBatch
from distflow.data.model_tokens import last_model_token


@dataclass(frozen=True)
class SamplingParams:
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    micro_batch_size: int
    share_prefill: bool = True
    """Prefill each prompt once per chunk, not once per sample (``rollout.sharePrefill``).
    Falls back to the per-sample prefill where the model or transformers does not support it."""
    record_log_probs: bool = False
    """Add ``rollout_log_probs``: each sampled token's log-prob under the generating weights at
    ``temperature`` (before top-k/top-p, what the actor recomputes): the behaviour policy of
    asynchronous training's off-policy correction (``async.offPolicyCorrection``)."""


log = logging.getLogger(__name__)


def render_prompt(tokenizer, record, system_prompt: str | None = None) -> list[int]:
    """A record's messages chat-templated into token ids, with the generation prompt.

    ``system_prompt`` replaces the record's own system message, if any.
    """
    messages = list(record.messages)
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}] + [
            m for m in messages if m.get("role") != "system"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def render_prompts(tokenizer, records, max_prompt_length: int, system_prompt: str | None = None) -> list[list[int]]:
    """``render_prompt`` of each record; keep the last ``max_prompt_length`` tokens
    (``data.truncation: left``; with ``error`` or ``filter`` every prompt fits already)."""
    return [render_prompt(tokenizer, rec, system_prompt)[-max_prompt_length:] for rec in records]


def eos_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Every token id that ends a response (and a model turn): the tokenizer's ``eos_token_id`` and
    all of ``generation_config.eos_token_id`` (an int or a list), sorted. Both engines stop at
    these: the hf engine with its model's ``generation_config``, the vllm engine with the one in
    the model's directory (what vLLM reads too).

    Chat models list their end-of-turn token there beside the tokenizer's EOS
    (Qwen2.5: ``<|im_end|>`` and ``<|endoftext|>``; Llama-3: ``<|eot_id|>``).
    """
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return sorted(ids)


def _trim_response(tokens: torch.Tensor, eos_ids: list[int], pad_id: int) -> list[int]:
    stops = set(eos_ids)
    out = []
    for t in tokens.tolist():
        out.append(t)
        if t in stops:
            break
    while out and out[-1] == pad_id and pad_id not in stops:
        out.pop()
    return out


def step_seed(seed: int, step: int, round_index: int = 0) -> int:
    """The rollout seed of a step (and refill round): the same on every rank, whatever the world size."""
    return hash((seed, step, round_index)) & 0x7FFFFFFF


def sample_seed(seed: int, group: int, sample: int) -> int:
    """The seed of one response: fixed by the step's seed, the prompt's global index and the sample index."""
    return hash((seed, group, sample)) & 0x7FFFFFFF


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def sample_uniforms(seeds: np.ndarray, position: int) -> np.ndarray:
    """One uniform in (0, 1) per sample for its ``position``-th response token: [B] float64.

    Counter-based (splitmix64 of ``seed << 32 | position``): a pure function of the
    sample's seed and the position, so no generator state ties samples that share a call.
    """
    z = (seeds.astype(np.uint64) << np.uint64(32)) | np.uint64(position)
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


class _PerSampleSampler:
    """A logits processor that samples each row with its own uniform (inverse CDF) and leaves only
    that token finite, so ``generate`` run greedily emits it. Temperature, top-k and top-p are
    transformers' own warpers, applied in their usual order."""

    def __init__(self, seeds: list[int], prompt_width: int, params: SamplingParams):
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.seeds = np.asarray(seeds, dtype=np.uint64)
        self.prompt_width = prompt_width
        self.warpers = [TemperatureLogitsWarper(params.temperature)]
        self.record = params.record_log_probs
        self.log_probs: list[torch.Tensor] = []
        """With ``record_log_probs``: [B] float32 per generated position, the sampled token's
        log-prob at the temperature (before top-k/top-p)."""
        if params.top_k:
            self.warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(params.top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tempered = None
        for i, warp in enumerate(self.warpers):
            scores = warp(input_ids, scores)
            if i == 0:
                tempered = scores
        cdf = torch.softmax(scores.float(), dim=-1).cumsum(dim=-1)  # [B, V]
        u = torch.from_numpy(sample_uniforms(self.seeds, input_ids.shape[1] - self.prompt_width))
        target = (u.to(cdf.device, cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
        token = torch.searchsorted(cdf, target).clamp_(max=scores.shape[-1] - 1)  # [B, 1]
        if self.record:
            self.log_probs.append(torch.log_softmax(tempered.float(), dim=-1).gather(-1, token)[:, 0].cpu())
        return torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], group_index: list[int],
             params: SamplingParams, seed: int, device: torch.device, independent: bool = False) -> PackedBatch:
    """Sample ``params.n`` responses per prompt; a response ends at any of ``eos_token_ids``.

    Args:
        prompts: token ids per prompt (this rank's).
        group_index: the global index of each prompt in the step.
        seed: the step's seed (``step_seed``), the same on every rank; response ``j`` of
            prompt ``group_index[i]`` samples from ``sample_seed(seed, group_index[i], j)``.
        independent: the ranks call this a different number of times (multi-turn rounds), on
            weights gathered for the whole session: no per-token sync with the other ranks.
    Returns:
        PackedBatch of len(prompts) * n samples, the n of a prompt adjacent.
    """
    from transformers import LogitsProcessorList

    gen = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device="cpu")))
    pad_id = tokenizer.pad_token_id
    eos_ids = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
    kwargs = dict(max_new_tokens=params.max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_ids, do_sample=False)
    if independent or process_group.pool_group() is not None:
        # transformers keeps the ranks of an FSDP model in step with an all-reduce over the WORLD
        # group at every token; with pools (distflow.pools) only this pool generates, on weights
        # gathered for the whole call (RolloutWeights), so no rank needs the others.
        kwargs["synced_gpus"] = False
    share = params.share_prefill and _supports_shared_prefill(model)
    seqs, meta, behaviour = [], [], []
    done = [0] * len(prompts)  # responses of each prompt generated so far (a group may span chunks)
    record = params.record_log_probs and params.temperature > 0
    for chunk in _group_chunks(len(prompts), params.n, params.micro_batch_size):
        reps = chunk[0][1]  # the same for every prompt of a chunk
        ids, mask = _left_pad([prompts[i] for i, _ in chunk], pad_id)
        width = ids.shape[1]
        sampler = None
        if params.temperature > 0:
            seeds = [sample_seed(seed, group_index[i], done[i] + j) for i, _ in chunk for j in range(reps)]
            sampler = _PerSampleSampler(seeds, width, params)
            kwargs["logits_processor"] = LogitsProcessorList([sampler])
        cache = _shared_prefill(model, ids, mask, reps, device) if share and reps > 1 and width > 1 else None
        prefilled = {} if cache is None else {"cache": cache}
        out = model.generate(input_ids=ids.repeat_interleave(reps, dim=0).to(device),
                             attention_mask=mask.repeat_interleave(reps, dim=0).to(device),
                             **prefilled, **kwargs).cpu()
        positions = torch.stack(sampler.log_probs, 1) if record and sampler.log_probs else None  # [rows, steps]
        for row, (i, _) in enumerate(chunk):
            done[i] += reps
            for j in range(reps):
                resp = _trim_response(out[row * reps + j, width:], eos_ids, pad_id)
                seqs.append((prompts[i], resp))
                meta.append(group_index[i])
                if record:
                    behaviour.append(positions[row * reps + j, :len(resp)] if positions is not None
                                     else torch.zeros(0))
    batch = pack_responses(seqs, meta, device)
    if record:  # 0 on prompt tokens, as the vllm engine's
        per_token = torch.cat([t for (p, _), lp in zip(seqs, behaviour) for t in (torch.zeros(len(p)), lp)])
        batch = batch.with_fields(token={"rollout_log_probs": per_token.to(device, torch.float32)})
    return batch


def _group_chunks(num_prompts: int, n: int, micro_batch_size: int) -> list[list[tuple[int, int]]]:
    """The generate calls: lists of (prompt index, samples), whole groups of ``n`` where
    ``n <= micro_batch_size``, else one prompt per chunk with its group split over chunks."""
    if n <= micro_batch_size:
        k = micro_batch_size // n
        return [[(i, n) for i in range(s, min(s + k, num_prompts))] for s in range(0, num_prompts, k)]
    return [[(i, min(micro_batch_size, n - s))] for i in range(num_prompts) for s in range(0, n, micro_batch_size)]


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to one width, built on the host: ``generate`` moves them once, repeated."""
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long, device="cpu")
        mask[i, width - len(p):] = 1
    return ids, mask


_WARNED: set[str] = set()


def _supports_shared_prefill(model) -> bool:
    """Whether ``generate`` may continue from a cache prefilled by ``_shared_prefill``.

    Checked against transformers 5's generation code (the ``cache`` kwarg, no
    ``cache_position``): with the full left-padded prompt and mask, ``_prefill``
    slices the input to the tokens past ``cache.get_seq_length()`` and takes
    their position ids from the full mask. Other layouts (transformers 4's
    ``past_key_values``/``cache_position``, custom ``generate`` or input
    preparation, remote code, encoder-decoders, sliding-window, chunked or
    linear-attention cache layers, a preset ``cache_implementation``) keep the
    per-sample prefill.
    """
    try:
        from transformers import DynamicCache, GenerationMixin
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return _unsupported("transformers has no DynamicCache/DynamicLayer")
    reason = None
    config = getattr(model, "config", None)
    forward = inspect.signature(model.forward).parameters
    gen_config = getattr(model, "generation_config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        reason = "not a decoder-only transformers model"
    elif not {"cache", "position_ids"} <= forward.keys() or "cache_position" in forward:
        reason = "forward() does not take `cache` and `position_ids` without `cache_position`"
    elif (type(model).generate is not GenerationMixin.generate
          or type(model).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation):
        reason = "custom generate() or prepare_inputs_for_generation()"
    elif getattr(type(model), "is_remote_code", lambda: False)():
        reason = "remote code model"
    elif gen_config is not None and getattr(gen_config, "cache_implementation", None) is not None:
        reason = f"generation_config.cache_implementation={gen_config.cache_implementation!r}"
    elif not hasattr(DynamicCache, "batch_repeat_interleave"):
        reason = "DynamicCache has no batch_repeat_interleave"
    else:
        layers = getattr(_new_cache(model), "layers", None)
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            reason = "the KV cache is not plain full attention (sliding window, chunked, linear or shared layers)"
    return True if reason is None else _unsupported(reason)


def _unsupported(reason: str) -> bool:
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.warning("rollout.sharePrefill: %s; each sample prefills its own prompt", reason)
    return False


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config.get_text_config(decoder=True))


def _shared_prefill(model, ids: torch.Tensor, mask: torch.Tensor, reps: int, device: torch.device):
    """The KV cache of all but the last token of each left-padded prompt, repeated ``reps`` times.

    Position ids follow the mask, as ``generate`` computes them for the full prompt
    (pads at 0). ``generate`` then runs only the last prompt token on top of it.
    """
    cache = _new_cache(model)
    prefix = mask[:, :-1]
    kw = {"logits_to_keep": 1} if getattr(model, "_supports_logits_to_keep", lambda: False)() else {}
    model(input_ids=ids[:, :-1].to(device), attention_mask=prefix.to(device),
          position_ids=(prefix.cumsum(-1) - 1).clamp(min=0).to(device), cache=cache, use_cache=True, **kw)
    if cache.get_seq_length() != ids.shape[1] - 1:
        raise RuntimeError(f"shared prefill: the cache holds {cache.get_seq_length()} tokens, "
                           f"expected {ids.shape[1] - 1}")
    cache.batch_repeat_interleave(reps)
    return cache


def pack_responses(seqs: list[tuple[list[int], list[int]]], groups: list[int], device: torch.device,
                   masks: list[list[int]] | None = None) -> PackedBatch:
    """(prompt ids, response ids) per sample and its group index -> the rollout's PackedBatch, its
    fields on ``device`` (the worker's: every round of a step, DAPO's refills too, lands where the
    step's data lives; ``seq_lens`` stays on the host, as ``PackedBatch`` keeps it).

    Args:
        masks: each response's ``response_mask`` [len(response)] (a multi-turn trajectory's 0s on
            tool tokens); None: all 1, every response token sampled by the model.
    """
    def field(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    if masks is None:
        masks = [[1] * len(r) for _, r in seqs]
    return PackedBatch(
        seq_lens=torch.tensor([len(p) + len(r) for p, r in seqs], dtype=torch.long, device="cpu"),
        token_fields={"input_ids": field([t for p, r in seqs for t in p + r], torch.long),
                      "response_mask": field([m for (p, _), mask in zip(seqs, masks, strict=True)
                                              for m in [0] * len(p) + mask], torch.int8)},
        sample_fields={
            "prompt_len": field([len(p) for p, _ in seqs], torch.long),
            "response_len": field([len(r) for _, r in seqs], torch.long),
            "group_index": field(groups, torch.long),
        },
    )


class HfRollout:
    """The hf engine: ``generate`` with the policy weights ``RolloutWeights`` holds.

    The engine interface the stages call (``VllmRollout`` has the same):
    ``generate(prompts, group_index, params, seed, metrics) -> PackedBatch``; ``session(metrics)``
    (a multi-turn round); ``shared`` (nothing to sync after an update), ``records_log_probs`` and
    ``sync(actor_model) -> bytes``.
    """

    records_log_probs = False
    """``rollout_log_probs`` only with ``SamplingParams.record_log_probs`` (and a temperature)."""

    def __init__(self, weights, tokenizer, device: torch.device) -> None:
        self.weights = weights
        self.tokenizer = tokenizer
        self.device = device

    @property
    def shared(self) -> bool:
        return self.weights.shared

    def generate(self, prompts: list[list[int]], group_index: list[int], params: SamplingParams,
                 seed: int, metrics=None) -> PackedBatch:
        with self.weights.policy(metrics) as model:
            return generate(model, self.tokenizer, prompts, group_index, params, seed, self.device)

    @contextmanager
    def session(self, metrics=None):
        """Weights held for several ``generate`` calls that no other rank joins (a multi-turn
        round: each rank runs as many turns as its own samples need). Entered on every rank
        together (it all-gathers shared weights); yields ``(generate_fn, end_ids)``, with
        ``generate_fn(prompts, group_index, params, seed) -> PackedBatch``."""
        with self.weights.policy(metrics) as model:
            yield (functools.partial(generate, model, self.tokenizer, device=self.device, independent=True),
                   eos_token_ids(self.tokenizer, getattr(model, "generation_config", None)))

    def sync(self, actor_model=None) -> int:
        """Refresh a separate copy from the actor it was built with; bytes all-gathered."""
        return self.weights.sync()


def response_texts(tokenizer, batch: PackedBatch) -> list[str]:
    """Decoded responses (special tokens dropped), in batch order: each sample's tokens after its
    ``prompt_len`` up to its last model token, so a multi-turn response reads as its trajectory,
    tool outputs between the model's turns included (as verl's reward managers decode it), not as
    the model's turns glued together; a tool output the budget cut off after the model's last
    turn is not part of it (the model never answered from it, so it cannot earn the reward)."""
    # one device-to-host read of the fields, not one sync per sample
    ids = batch.token_fields["input_ids"].cpu()
    prompt_lens = batch.sample_fields["prompt_len"].tolist()
    offsets = batch.cu_seqlens(dtype=torch.long).tolist()
    ends = (last_model_token(batch).cpu() + 1).tolist()
    return [tokenizer.decode(ids[offsets[b] + prompt_lens[b]:max(ends[b], offsets[b] + prompt_lens[b])].tolist(),
                             skip_special_tokens=True)
            for b in range(batch.num_samples)]
