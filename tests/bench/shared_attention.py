"""Shared-prompt attention on CPU: forward time and peak memory against the per-sample path.

    python -m tests.bench.shared_attention [--lengths 256,512,1024,2048] [--out FILE.json]

One GRPO group (a prompt of ``prompt_len`` tokens, ``n`` responses of R tokens
each) runs the log-prob forward (no gradient) three ways, side by side in one
process, round-robin, median of ``repeats``:

- ``per_sample``: n left-padded rows ``[n, P + R]`` (sdpa, causal);
- ``dense``: one shared row ``[1, P + nR]`` with the ``[1, 1, S, S]`` boolean mask (sdpa);
- ``flex``: the same row with FlexAttention's ``BlockMask``, run eagerly:
  inductor's CPU build of flex attention takes minutes per shape on two cores,
  and FlexAttention has no backward on CPU, so this column shows what the CUDA
  default costs when it cannot compile, and stops at ``flex_max_len``.

Peak memory is the growth of the process's peak RSS (VmHWM, reset before each
forward) over its RSS before it (on CUDA: the allocator's peak). The model
has SmolLM2-135M's widths (hidden 576, 9 query / 3 key-value heads) with 2
layers instead of 30 and a vocabulary of 8192 instead of 49152, so that two
shared cores finish in minutes: the LM head runs on the same positions in
every column; attention and its mask are what differ.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tests.bench._common import median, peak_rss_bytes, reset_peak_rss, rotated

VARIANTS = ("per_sample", "dense", "flex")


def smollm2_sized(num_layers: int = 2, device: str = "cpu", vocab_size: int = 8192, attention: str = "sdpa"):
    """A random Llama with SmolLM2-135M's widths and ``num_layers`` layers, float32, ``attention``
    (a transformers attention implementation); the weights depend only on the sizes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=num_layers, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    return model.to(device).eval()


def eager_vs_sdpa(num_layers: int, device: str, vocab_size: int, prompt_len: int, response_len: int,
                  n: int) -> float:
    """Largest |log-prob difference| over the response tokens of one group, per-sample forward,
    between transformers' eager attention and sdpa on the same weights."""
    from distflow.engines import model_ops

    mb = model_ops.collate(group_batch(prompt_len, response_len, n, vocab_size=vocab_size), 0)
    log_probs = []
    for attention in ("sdpa", "eager"):
        with torch.no_grad():
            lp, _ = model_ops.forward_log_probs(smollm2_sized(num_layers, device, vocab_size, attention), mb, 1.0,
                                                False)
        log_probs.append(lp.float().cpu())
    return float((log_probs[1] - log_probs[0])[mb.response_mask.bool().cpu()].abs().max())


def group_batch(prompt_len: int, response_len: int, n: int, seed: int = 0, vocab_size: int = 8192):
    """One prompt with ``n`` responses of ``response_len`` tokens, as a ``PackedBatch``."""
    from distflow.data.batch import PackedBatch

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab_size, (prompt_len,), generator=gen)
    ids = [torch.cat([prompt, torch.randint(3, vocab_size, (response_len,), generator=gen)]) for _ in range(n)]
    mask = torch.tensor([0] * prompt_len + [1] * response_len, dtype=torch.int8).repeat(n)
    full = lambda v: torch.full((n,), v)  # noqa: E731
    return PackedBatch(full(prompt_len + response_len), {"input_ids": torch.cat(ids), "response_mask": mask},
                       {"group_index": full(0), "prompt_len": full(prompt_len), "response_len": full(response_len)})


def _current_rss() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


def _measure(model, mb, variant: str) -> tuple[float, int, torch.Tensor]:
    """(seconds, peak bytes above those held before, log-probs [b, R]) of one no-grad forward:
    process RSS on CPU, the caching allocator's peak on CUDA."""
    from distflow.engines import model_ops

    kwargs = {} if variant == "per_sample" else {"shared_attention": variant}
    cuda = next(model.parameters()).is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        reset_peak_rss()
        before = _current_rss()
    start = time.perf_counter()
    with torch.no_grad():
        lp, _ = model_ops.forward_log_probs(model, mb, 1.0, False, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    return seconds, max(0, peak - before), lp.float().cpu()


def max_grad_difference(model, batch, variant: str) -> float:
    """Largest |gradient difference| over the parameters between the per-sample path and
    ``variant`` for the loss sum(log-probs) (FlexAttention has a backward on CUDA only)."""
    from distflow.engines import model_ops

    def grads(mb, **kwargs):
        model.zero_grad(set_to_none=True)
        lp, _ = model_ops.forward_log_probs(model, mb, 1.0, False, **kwargs)
        (lp * mb.response_mask.to(lp.device)).sum().backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    plain = grads(model_ops.collate(batch, 0))
    shared = grads(model_ops.collate(batch, 0, share_prompt_prefix=True), shared_attention=variant)
    model.zero_grad(set_to_none=True)
    return max(float((a - b).abs().max()) for a, b in zip(plain, shared))


def _eager_flex() -> None:
    """Run FlexAttention uncompiled inside transformers (see the module docstring)."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex

    hf_flex.WrappedFlexAttention.__call__ = lambda self: flex_attention


def run(lengths=(256, 512, 1024, 2048), prompt_len: int = 256, n: int = 4, repeats: int = 2,
        num_layers: int = 2, flex_max_len: int = 512, device: str = "cpu", grad_check: bool | None = None,
        vocab_size: int = 8192) -> dict:
    """Rows per response length: median seconds and peak bytes per variant, and the
    largest |log-prob difference| of each shared variant from the per-sample path.
    On CUDA FlexAttention compiles (no ``flex_max_len``); gradients are compared when
    ``grad_check`` (default: on CUDA; on CPU only the dense path, as flex has no CPU backward)."""
    from distflow.engines import model_ops

    cuda = torch.device(device).type == "cuda"
    check_grads = cuda if grad_check is None else grad_check
    if not cuda:
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
        _eager_flex()
        lengths_for_flex = flex_max_len
    else:
        lengths_for_flex = max(lengths)
    model = smollm2_sized(num_layers, device, vocab_size)
    warm = group_batch(prompt_len, 16, n, vocab_size=vocab_size)
    warm_variants = VARIANTS if lengths_for_flex >= min(lengths) else VARIANTS[:2]
    for variant in warm_variants:  # first calls trace and allocate: keep them out of the timings
        _measure(model, model_ops.collate(warm, 0, share_prompt_prefix=variant != "per_sample"), variant)
    rows = []
    for response_len in lengths:
        batch = group_batch(prompt_len, response_len, n, vocab_size=vocab_size)
        mbs = {"per_sample": model_ops.collate(batch, 0),
               "dense": model_ops.collate(batch, 0, share_prompt_prefix=True)}
        mbs["flex"] = mbs["dense"]
        variants = [v for v in VARIANTS if v != "flex" or response_len <= lengths_for_flex]
        seconds = {v: [] for v in variants}
        peak, lps = {}, {}
        for k in range(repeats):
            for v in rotated(variants, k):
                s, p, lp = _measure(model, mbs[v], v)
                seconds[v].append(s)
                peak[v], lps[v] = max(peak.get(v, 0), p), lp
        mask = mbs["per_sample"].response_mask.bool()
        rows.append({"response_len": response_len, "prompt_len": prompt_len, "n": n,
                     "seconds": {v: median(t) for v, t in seconds.items()}, "peak_bytes": peak,
                     "max_abs_lp_diff": {v: float((lps[v] - lps["per_sample"])[mask].abs().max())
                                         for v in variants if v != "per_sample"}})
        if check_grads:
            rows[-1]["max_abs_grad_diff"] = {v: max_grad_difference(model, batch, v)
                                             for v in (("dense", "flex") if cuda else ("dense",))}
    return {"device": device, "num_layers": num_layers, "vocab_size": vocab_size, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "rows": rows}


def table(result: dict) -> str:
    """Markdown, the variants side by side: seconds, peak MiB, and each shared path over per-sample."""
    head = ("| R | tokens | per-sample s | dense s | flex s | per-sample MiB | dense MiB | flex MiB "
            "| dense/per-sample time | dense/per-sample mem |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        s, m = r["seconds"], {k: v / 2**20 for k, v in r["peak_bytes"].items()}
        fmt = lambda d, k, f: f.format(d[k]) if k in d else "-"  # noqa: E731
        lines.append(f"| {r['response_len']} | {r['prompt_len'] + r['n'] * r['response_len']} "
                     f"| {s['per_sample']:.2f} | {s['dense']:.2f} | {fmt(s, 'flex', '{:.2f}')} "
                     f"| {m['per_sample']:.0f} | {m['dense']:.0f} | {fmt(m, 'flex', '{:.0f}')} "
                     f"| {s['dense'] / s['per_sample']:.2f} | {m['dense'] / max(m['per_sample'], 1e-9):.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    result = run(tuple(int(x) for x in args.lengths.split(",")), repeats=args.repeats)
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
