"""The prose of docs/benchmarks.md and its targets table (numbers come from the results)."""

from __future__ import annotations

from tests.bench import render
from tests.bench._common import md_table

INTRO = """
# Benchmarks

What DistFlow (arXiv 2507.13833) claims, measured on this machine side by
side in one run, and projected to 512 and 1,024 GPUs with a cost model whose
inputs are those measurements. Regenerate everything (20 to 40 minutes,
depending on how busy the machine is) from the repository root with

    {command}

`--only SECTION[,SECTION]` re-runs some sections and keeps the others;
`--render` only rewrites this page from docs/benchmarks/results.json.
Benchmarks are not part of the default test run; `pytest -m bench
tests/bench` runs reduced versions with the targets as assertions (targets
missed today are marked xfail with the measured reason).

Machine: 2 CPU cores, 24 GiB, no GPU, **shared with other sessions' test
runs while these numbers were taken**: load averages of 5 to 30 on 2 cores
(given per section), memory at times exhausted. N gloo ranks are N
processes on these 2 cores, so N = 8 oversubscribes them at least 4x: the
funnel compares *wire, copy and bookkeeping time through loopback TCP* of
the two data planes, not cluster speed. Every comparison alternates its
variants in one run and reports medians (and, for the funnel, the best of
the repeats too).
"""

FUNNEL = """
One GRPO edge (advantage -> actor, the edge the planner redistributes): each
rank holds 16 samples it generated, with the actor's fields (input_ids int64,
response_mask int8, old/ref log-probs and advantages float32: 21 bytes per
token, plus 4 per-sample fields), lengths uniform in [L/2, 3L/2]; the samples
must end in the token-balanced train layout. *distflow* = all-gather lengths
+ balance + plan + `exchange` (one packed `all_to_all_single`);
*centralized* = the same planning + `exchange_centralized` (everything to
rank 0 and back, as a single controller does); *exchange only* = the two
exchange functions with the plan precomputed; *bare* = raw
`all_to_all_single` vs raw send-to-0-and-back of exactly the same byte
counts, no packing, no metadata: the floor each data plane can reach. Bytes
are the product's own counters (sent + received by the busiest rank); time
is the slowest rank's, median of 7 alternated repeats. Both planes return
bit-identical batches (checked every time: last column).

Reading it: the byte target holds everywhere (the busiest distflow rank
moves about 1/N of what rank 0 moves when centralized, because a balanced
plan keeps what it can in place). The 5x time target does not: on these two
shared cores even the bare collectives differ by only 1.3-3x at N = 8 (not
the 6-10x quoted in the issue; root-side `irecv`/`isend` of all peers at
once is a fast gather-then-scatter), and the distflow edge pays, on every
rank, three metadata all-gathers (each costs milliseconds when 8 processes
share 2 cores) and the replicated balancer, which the centralized variant
pays as well, so the ratio shrinks toward 1 at short lengths. The exchange
breakdown under the table says where one `exchange` spends its time;
"What the runtime should change" lists the fixes (items 3 to 5).
"""

BALANCER = """
Partitioners of `distflow.data.balance` on sequence lengths (cost = tokens):
`lpt` is the runtime default (constrained LPT + 2-opt refinement, also from
a Karmarkar-Karp start), `lpt_plain` without refinement, `karmarkar_karp`,
`contiguous` (no balancing), and `prototype`, a bench-local faster balancer
(`tests/bench/plan_prototype.py`, proposed for the runtime below). Every
rank gets the same number of samples (the runtime's equal counts). The
bound is max(mean load, longest item); the runtime's `lower_bound` adds the
pigeonhole and equal-count terms ("strong bound"): with 4 samples per rank a
single long sample often sets the max load, so max/mean is large for every
method while max/bound shows what is achievable.

Quality targets are met by the runtime's `lpt`; its planning time is not
(tens to hundreds of ms for 4,096 samples over 64 ranks on this loaded
machine, seconds at 512 ranks), while the prototype reaches the same quality
targets in a few ms. The per-edge planning table is what every rank runs
before each balanced move; it feeds the scaling projection.
"""

DOUBLE_BUFFER = """
`DoubleBuffer.swap()` at a step boundary with the retiring generation
holding S bytes (16 tensors, pages touched), against dropping the same bytes
on the caller's thread. Run in a fresh process with a fixed mmap threshold
(128 KiB) so freed buffers go back to the OS at once; at 1 MiB the 64 KiB
tensors live in the heap and are not returned (RSS returned 0), as expected.
The swap stays at microseconds from 1 MiB to 1 GiB; freeing 1 GiB costs
about 0.1 s, which the background thread pays instead of the step.
"""

SCALING = """
Weak scaling from 32 GPUs: every GPU keeps 16 samples per step, so compute
per GPU is constant and only what grows with N costs efficiency: metadata
all-gathers (log N latency, N x 8 bytes per sample), planning (measured:
runs on every rank, grows with the global batch), imbalance (measured at 16
samples per rank), FSDP collective latency, and, for the centralized plane,
every byte through one controller. Planning above the largest measured size
is extrapolated (power law through the last two points); imbalance above dp
64 is held at its dp-64 value. The projection is computed three times, for
the runtime's planning as it is and for the two prototype variants, because
planning is what decides the answer: with the runtime's O(N^2) planning the
distributed plane loses most of its efficiency between 256 and 1,024 GPUs;
with the prototype balancer and per-rank wire plan it stays above 97%.

The paper reports 90-94% efficiency and up to 2.63x over verl. Here the
centralized plane is charged only transport (its link, two host copies per
byte, per-worker dispatch) and the same planning; verl's driver also pays
Ray object-store serialisation and driver-side work, so the projected
speedups over it (1.0-1.4x) are a lower bound on what the paper measures.
"""

E2E = """
Both frameworks run as separate processes, alternating (distflow, TRL, TRL,
distflow); see `tests/bench/e2e_trl.py` for the exact configuration of each.
They read the same GSM8K prompts in file order and produce the same number
of tokens per step (the token columns match). distflow's step includes
rollout, reward, advantage, the balanced redistribution, the actor update and
the weight sync to its rollout copy; TRL's includes generation, reward,
advantages and the update. Throughput is prompt + response tokens per step
over the step's wall time for the whole machine (both use both cores; a
per-process figure would only count distflow's two workers against it).
distflow gains from running its two dp ranks as two processes (generation
and the Python-heavy parts run in parallel), TRL from needing no FSDP
collectives; on 2 cores the comparison says little about a GPU cluster.
"""

MEMORY = """
Peak RSS (VmHWM) of each worker process over a quickstart run shortened to
2 steps (no eval, no checkpoints), distributed then centralized. The
quickstart's batch is a few KB (arithmetic prompts, 8-token answers), so the
data plane cannot show in these peaks (max/median is the same in both
modes): model weights, optimizer state, autograd and allocator caches
dominate. Where the data plane does matter, the funnel section measures each
rank's peak during a 32k-token edge: centralized rank 0 grows by many times
what any distributed rank does. The 1.5x target is missed by a wide margin:
see "What the runtime should change", item 6.
"""


def _get(results: dict, name: str) -> dict:
    return results.get(name, {}).get("result", {})


def runtime_changes(results: dict, tables: dict) -> str:
    """What the runtime should change, each with the measurement behind it."""
    funnel, balancer = _get(results, "funnel"), _get(results, "balancer")
    if "rows" not in funnel or "rows" not in balancer:
        return ""
    plan = balancer["planning"]["seconds"]["long_tail"]
    scale = {r["num_ranks"]: r for r in balancer["plan_scaling"]}
    big = max(k for k in scale if "runtime" in scale[k])
    last = funnel["rows"][-1]
    phases = last.get("exchange_phases_rank0", {})
    eff = {p: min(r["efficiency"] for r in t if r["mode"] == "distributed" and r["num_gpus"] == 512)
           for p, t in tables.items()}
    items = [
        f"""1. **Balancer speed** (`distflow/data/balance.py`: `balance_partition`, `_refine_by_swaps`,
   `_best_exchange`, `karmarkar_karp_partition`). 4,096 long-tailed samples over 64 ranks take
   {plan['lpt'] * 1e3:.0f} ms (target 10 ms): the 2-opt fixes one rank per Python step (each step loops
   over ranks and bisects per item, up to 4B steps) and always repeats itself from a Karmarkar-Karp
   start. Port `tests/bench/plan_prototype.py::fast_balance_partition`: a numpy round-robin-by-load
   start, *pairwise* heavy/light swap rounds (k/2 ranks fixed per numpy step), the vectorised 2-opt
   for the rest, a stop at 0.1% above `lower_bound`, and the KK start only at <= 8 samples per rank:
   {plan['prototype'] * 1e3:.1f} ms here, within 0.1% of the bound at >= 16 samples per rank, never
   worse than KK at 4 (`tests/bench/test_plan_prototype.py` carries over as unit tests).""",
        """2. **Bin-to-rank matching** (`distflow/data/redistribute.py::balanced_assignment`) sorts all k^2
   (bin, rank) pairs in Python. Score only pairs that share samples
   (`plan_prototype.sparse_balanced_assignment`): identical output (tested against the runtime on 300
   random layouts), O(B log B).""",
        f"""3. **O(N^2) plan bookkeeping on every rank** (`plan_redistribution` builds the whole [N][N]
   `sends` table; `exchange._size_matrix`, `_shm_routes` and the `wire` list are [N][N] too). Each
   rank only needs its send row and receive column (`plan_prototype.rank_wire_plan`, O(B + N)). With
   1-3: per-edge planning at {big} ranks goes from {scale[big]['runtime']:.2f} s to
   {scale[big]['prototype_rank_plan'] * 1e3:.0f} ms, and the projected worst-case efficiency at 512 GPUs
   from {eff.get('runtime', float('nan')):.1%} to {eff.get('prototype_rank_plan', float('nan')):.1%}.
   Keep `RedistributionPlan` as the tested reference; add a per-rank view the exchange uses.""",
        f"""4. **Three metadata all-gathers per edge** (`exchange.allgather_lengths`: counts, then padded
   lengths; `exchange._gather_metadata`: a schema-digest all-gather even when `all_lengths` is given).
   One all-gather of `[digest, count, lengths padded to the planned per-rank maximum]` does the same.
   At N = {last['world_size']} one all-gather costs {last['allgather_seconds'] * 1e3:.1f} ms here
   (oversubscribed cores); on a cluster each costs 2 log2 N network latencies.""",
        f"""5. **The assemble copy** (`exchange._assemble`): every received byte is copied once more into a
   contiguous batch ({phases.get('assemble', 0) * 1e3:.1f} ms of {phases.get('total', 0) * 1e3:.1f} ms
   of one exchange at N = {last['world_size']}, L = {last['nominal_tokens']}), and the actor then
   copies it again into padded micro-batches (`model_ops.collate`). Returning the pieces (or
   collating straight from them) saves one full copy per edge.""",
    ]
    return "## What the runtime should change\n\n" + "\n".join(items) + "\n" + _extra_changes(results)


def _extra_changes(results: dict) -> str:
    """Items that depend on the end-to-end and memory sections."""
    out = []
    mem = _get(results, "memory")
    if "summary" in mem:
        d = mem["summary"]["distributed"]
        out.append(f"""6. **Worker memory** (quickstart): the largest worker peak is
   {max(d['peak_rss']) / mem['need_bytes']:.1f}x what its weights, gradient and Adam shards and rollout
   copy need (section 6). Suspects to profile, in `distflow/worker.py::DagWorker._build_models` and
   `engines/fsdp.py`: each worker materialises the full actor before `fully_shard` (plus the rollout
   copy, plus the reference when KL is on), `sync_rollout_weights` materialises every parameter's
   `full_tensor()`, and freed CPU tensors stay in glibc's arenas (RSS does not drop after sharding).""")
    return "\n".join(out) + ("\n" if out else "")


def _status(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "**missed**")


def targets_table(results: dict, tables: dict, gpu: dict | None) -> str:
    rows = []
    funnel = results.get("funnel", {}).get("result", {})
    if "rows" in funnel:
        fr = render.funnel_rows(funnel)
        worst = max(fr, key=lambda r: r["bytes_ratio"] / r["bytes_target"])
        rows.append(["busiest-process bytes <= 1.25/N of centralized (all N, L)",
                     f"worst {worst['bytes_ratio']:.3f} vs {worst['bytes_target']:.3f} "
                     f"(N={worst['N']}, L={worst['L']})",
                     _status(all(r["bytes_ratio"] <= r["bytes_target"] for r in fr))])
        s = render.speedup_at(funnel, 8, 16384)
        bare = next((r["speedup_bare"] for r in fr if (r["N"], r["L"]) == (8, 16384)), None)
        if s is not None:
            rows.append(["distributed >= 5x faster at N=8, 16k tokens",
                         f"{s:.2f}x (bare collectives on this machine: {bare:.2f}x)", _status(s >= 5)])
    balancer = results.get("balancer", {}).get("result", {})
    if "rows" in balancer:
        br = balancer["rows"]
        dense = [r for r in br if r["method"] == "lpt" and r["per_rank"] >= 16]
        worst = max(r["vs_bound_worst"] for r in dense)
        rows.append(["imbalance within 1% of max(mean, longest) at >= 16 samples/rank",
                     f"worst {worst:.4f}", _status(worst <= 1.01)])
        kk = {(r["dataset"], r["dp"]): r["vs_bound_mean"] for r in br
              if r["method"] == "karmarkar_karp" and r["per_rank"] == 4}
        lpt4 = [r for r in br if r["method"] == "lpt" and r["per_rank"] == 4]
        margin = max(r["vs_bound_mean"] / kk[(r["dataset"], r["dp"])] for r in lpt4)
        rows.append(["at 4 samples/rank no worse than Karmarkar-Karp",
                     f"worst lpt / KK = {margin:.4f}", _status(margin <= 1.0 + 1e-9)])
        plan = balancer["planning"]["seconds"]
        runtime = max(t["lpt"] for t in plan.values())
        proto = max(t["prototype"] for t in plan.values())
        rows.append(["planning 4096 samples over 64 ranks < 10 ms",
                     f"runtime {runtime * 1e3:.1f} ms; prototype {proto * 1e3:.1f} ms", _status(runtime < 0.010)])
    dbuf = results.get("double_buffer", {}).get("result", {})
    if "rows" in dbuf:
        swaps = [r["swap_seconds"] for r in dbuf["rows"]]
        big = dbuf["rows"][-1]
        rows.append(["double-buffer swap flat from 1 MB to 1 GB; freeing off the critical path",
                     f"swap {min(swaps) * 1e6:.0f}-{max(swaps) * 1e6:.0f} us; 1 GiB freed in background "
                     f"({big['background_free_seconds'] * 1e3:.0f} ms) instead of inline "
                     f"({big['inline_free_seconds'] * 1e3:.0f} ms)", _status(max(swaps) < 1e-3)])
    for planner, table in tables.items():
        dist512 = [r for r in table if r["mode"] == "distributed" and r["num_gpus"] == 512]
        worst = min(dist512, key=lambda r: r["efficiency"])
        rows.append([f"projected efficiency >= 95% at 512 GPUs ({planner} planner)",
                     f"worst {worst['efficiency']:.1%} ({worst['workload']})", _status(worst["efficiency"] >= 0.95)])
    e2e = results.get("e2e", {}).get("result", {})
    rows.append(["distflow >= 2x TRL GRPOTrainer throughput",
                 f"{e2e['speedup']:.2f}x" if "speedup" in e2e else e2e.get("error", "not run")[:120],
                 _status(e2e["speedup"] >= 2 if "speedup" in e2e else None)])
    mem = results.get("memory", {}).get("result", {})
    if "summary" in mem:
        d = mem["summary"]["distributed"]
        rows.append(["distributed: no rank's peak > 1.10 x median rank's", f"{d['max_over_median']:.3f}",
                     _status(d["max_over_median"] <= 1.10)])
        worst = max(d["peak_rss"]) / mem["need_bytes"]
        rows.append(["each worker's peak <= 1.5 x (model + grad + optimizer shards + rollout copy)",
                     f"worst {worst:.2f}x", _status(worst <= 1.5)])
    rows.append(["GPU check (NCCL bandwidth vs device copy, one CUDA step)",
                 gpu.get("date", "skipped") if gpu else "not run yet (no GPU lent)",
                 _status(None if not gpu else True)])
    return "## Targets\n\n" + md_table(["target (issue)", "measured", "status"], rows)
