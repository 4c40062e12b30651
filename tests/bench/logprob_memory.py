"""Peak host memory of the log-prob pass: whole-tensor float32 logits (before) vs blockwise (after).

One micro-batch of b sequences with R-token responses through the tiny
model with SmolLM2's 49k vocabulary (so the logits, not the layers,
dominate), as the reference pass (no grad) and as the actor's pass (forward
+ backward of a token-mean log-prob loss with an entropy bonus). "before"
is the pre-issue-11 path, kept here only to measure against: the kept
logits upcast whole (``.float()`` of a non-contiguous slice: a copy),
tempered (another), then chunked log_softmax/softmax whose float32 chunks
autograd keeps. "after" is ``model_ops.forward_log_probs``. Each (way,
logits dtype) runs in a fresh process with a fixed mmap threshold (so freed
tensors go back to the kernel) and reports VmHWM less the RSS before the
pass. The [b, R, V] logits themselves are printed for scale.

    PYTHONPATH=worker_image:operator:. python -m tests.bench.logprob_memory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from tests.bench._common import REPO_ROOT, peak_rss_bytes, reset_peak_rss
from tests.bench.render import render_logprob

MIB = 1 << 20
_ROWS_PER_CHUNK = 1024


def _before(model, mb, temperature: float, entropy: bool):
    """The pre-issue-11 forward_log_probs (per-sample path), for measurement only."""
    import torch

    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                logits_to_keep=mb.window + 1, use_cache=False)
    logits = out.logits[:, :-1].float()
    logits = logits / temperature if temperature not in (0, 1) else logits
    labels = mb.input_ids[:, -mb.window:]
    flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1, 1)
    lp = torch.cat([rows.float().gather(-1, lab).squeeze(-1) - torch.logsumexp(rows.float(), -1)
                    for rows, lab in zip(flat.split(_ROWS_PER_CHUNK), flat_labels.split(_ROWS_PER_CHUNK))])
    ent = None
    if entropy:
        ent = torch.cat([torch.logsumexp(r, -1) - (torch.softmax(r, -1) * r).sum(-1)
                         for r in flat.float().split(_ROWS_PER_CHUNK)]).reshape(labels.shape)
    return lp.reshape(labels.shape), ent


def measure(way: str, dtype: str, batch: int, response: int, prompt: int, temperature: float) -> dict:
    """In this process: peak RSS growth of a no-grad pass and of a forward + backward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    from distflow import models
    from distflow.data.batch import PackedBatch
    from distflow.engines import model_ops

    torch.manual_seed(0)
    config = models.tiny_llama_config(49152, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    lens = torch.full((batch,), prompt + response)
    ids = torch.randint(3, 49152, (int(lens.sum()),))
    mask = torch.tensor(([0] * prompt + [1] * response) * batch, dtype=torch.int8)
    packed = PackedBatch(lens, {"input_ids": ids, "response_mask": mask},
                         {"prompt_len": torch.full((batch,), prompt), "response_len": torch.full((batch,), response)})
    mb = model_ops.collate(packed, 0)
    out = {"logits_mib": batch * (response + 1) * 49152 * torch.finfo(getattr(torch, dtype)).bits / 8 / MIB}
    for name, grad in (("no_grad", False), ("forward_backward", True)):
        with torch.set_grad_enabled(grad):
            reset_peak_rss()
            base = peak_rss_bytes()
            if way == "before":
                lp, ent = _before(model, mb, temperature, grad)
            else:
                lp, ent = model_ops.forward_log_probs(model, mb, temperature, grad, entropy_grad=grad)
            if grad:
                (lp.mean() - 0.01 * ent.mean()).backward()
            out[f"{name}_mib"] = (peak_rss_bytes() - base) / MIB
            out[f"{name}_checksum"] = float(lp.detach().double().sum())
        model.zero_grad(set_to_none=True)
        del lp, ent
    return out


def run(batch: int, response: int, prompt: int, temperature: float,
        dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(str(REPO_ROOT / p) for p in ("worker_image", "operator", "."))}
    results = {}
    for dtype in dtypes:
        for way in ("before", "after"):
            code = (f"import json; from tests.bench.logprob_memory import measure; print(json.dumps(measure("
                    f"{way!r}, {dtype!r}, {batch}, {response}, {prompt}, {temperature})))")
            done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, check=True,
                                  capture_output=True, text=True)
            results[f"{way}/{dtype}"] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{way}/{dtype}", json.dumps(results[f"{way}/{dtype}"]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    results = run(args.batch, args.response, args.prompt, args.temperature, tuple(args.dtypes))
    print(json.dumps(results, indent=1))
    print(render_logprob(results))


if __name__ == "__main__":
    main()
