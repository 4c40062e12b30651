"""Markdown sections and PNG plots of docs/benchmarks.md, from the saved results.

Each ``render_<section>(result) -> str`` turns one section's JSON (as the
benchmark modules return it) into markdown and writes that section's plots
under docs/benchmarks/; ``stale_reason`` says when a saved result predates the runtime it
describes. The prose and the targets table are in ``notes``.
"""

from __future__ import annotations

from tests.bench._common import FIGURES_DIR, fmt_bytes, md_table

FIG_LINK = "benchmarks"  # figures' folder relative to docs/benchmarks.md
BALANCER_METHODS = ("lpt", "lpt_plain", "karmarkar_karp", "contiguous")
"""Partitioners the balancer section shows (results from before the runtime took over the
bench prototype also hold a ``prototype`` method; it is not shown)."""
PLANNING_COLUMNS = {**{m: m for m in BALANCER_METHODS}, "coordinator_plan_runtime": "per-edge plan"}
"""Planning-time columns shown, by result key (older results hold prototype variants too)."""


def stale_reason(name: str, result: dict) -> str | None:
    """Why a saved section result predates the runtime it describes, or None.

    Judged from what the result holds, so results recorded before the report
    kept commits are recognised too.
    """
    if not result or "error" in result:
        return None
    if name == "balancer":
        planning = next(iter(result.get("planning", {}).get("seconds", {}).values()), {})
        if any(r.get("method") == "prototype" for r in result.get("rows", ())) or "prototype" in planning:
            return ("recorded when the fast planner was still a bench prototype (before commit dad7056): "
                    "`lpt` and the per-edge plan are the former runtime's")
    if name == "funnel":
        phases = (result.get("rows") or [{}])[-1].get("exchange_phases_rank0", {})
        if "size matrix" in phases:
            return ("recorded before each rank built only its own part of the plan (commit dad7056): "
                    "planning and the exchange's bookkeeping are the former runtime's")
    if name == "e2e" and "share_prompt_prefix" not in result.get("settings", {}):
        return ("recorded before distflow shared prompt prefixes (`actor.sharePromptPrefix`, "
                "`rollout.sharePrefill`): its step processed every prompt once per sample, as TRL does")
    return None


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_x_axis(ax, ticks) -> None:
    """Log-scale x axis labelled with plain numbers at ``ticks`` only."""
    from matplotlib.ticker import NullFormatter, NullLocator

    ax.set_xscale("log")
    ax.set_xticks(list(ticks), labels=[str(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def save_figure(fig, name: str) -> str:
    FIGURES_DIR.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(FIGURES_DIR / name, dpi=110)
    pyplot().close(fig)
    return f"![{name}]({FIG_LINK}/{name})"


def funnel_rows(result: dict) -> list[dict]:
    """Per (N, L): the ratios the targets are about."""
    out = []
    for row in result["rows"]:
        s, b = row["seconds"], row["busiest_rank_bytes"]
        n = row["world_size"]
        out.append({
            "N": n, "L": row["nominal_tokens"], "total": row["total_bytes"],
            "bytes_dist": b["distflow"], "bytes_cent": b["centralized"],
            "bytes_ratio": b["distflow"] / b["centralized"], "bytes_target": 1.25 / n,
            "t_dist": s["distflow"], "t_cent": s["centralized"],
            "speedup": s["centralized"] / s["distflow"],
            "speedup_best": min(row["seconds_all"]["centralized"]) / min(row["seconds_all"]["distflow"]),
            "speedup_exchange": s["centralized_exchange"] / s["distflow_exchange"],
            "speedup_bare": s["bare_gather_scatter"] / s["bare_all_to_all"],
            "t_bare_a2a": s["bare_all_to_all"], "t_xchg": s["distflow_exchange"],
            "planning": row["planning_seconds"], "allgather": row["allgather_seconds"],
            "identical": row["identical_results"],
            "moved": row["moved_samples"] / row["total_samples"],
        })
    return out


def render_funnel(result: dict) -> str:
    rows = funnel_rows(result)
    table = md_table(
        ["N", "L", "batch (all ranks)", "busiest rank: distflow", "centralized", "ratio", "target 1.25/N",
         "edge ms: distflow", "centralized", "speedup", "best-of speedup", "exchange-only speedup",
         "bare a2a vs gather-scatter",
         "planning ms", "1 all_gather ms", "moved", "identical"],
        [[r["N"], r["L"], fmt_bytes(r["total"]), fmt_bytes(r["bytes_dist"]), fmt_bytes(r["bytes_cent"]),
          f"{r['bytes_ratio']:.3f}", f"{r['bytes_target']:.3f}", f"{r['t_dist'] * 1e3:.1f}",
          f"{r['t_cent'] * 1e3:.1f}", f"**{r['speedup']:.2f}x**", f"{r['speedup_best']:.2f}x",
          f"{r['speedup_exchange']:.2f}x",
          f"{r['speedup_bare']:.2f}x", f"{r['planning'] * 1e3:.1f}", f"{r['allgather'] * 1e3:.2f}",
          f"{r['moved']:.0%}", "yes" if r["identical"] else "**NO**"] for r in rows])
    mem = result.get("memory", {})
    mem_table = ""
    if mem.get("per_rank") and not mem["per_rank"][0].get("unsupported"):
        mem_table = md_table(
            ["rank", "own batch", "peak growth: distflow", "centralized"],
            [[r, fmt_bytes(x["batch_bytes"]), fmt_bytes(x["distflow"]), fmt_bytes(x["centralized"])]
             for r, x in enumerate(mem["per_rank"])])
        mem_table = (f"\nPeak resident-memory growth of each rank during one edge (N = {mem['world_size']}, "
                     f"L = {mem['nominal_tokens']}; fresh processes, VmHWM reset before each edge):\n\n"
                     + mem_table + "\n")
    phases = result["rows"][-1].get("exchange_phases_rank0")
    phase_line = ""
    if phases:
        last = result["rows"][-1]
        phase_line = (f"\nWhere one `exchange` call spends its time on rank 0 (N = {last['world_size']}, "
                      f"L = {last['nominal_tokens']}, plan precomputed, median of 5): "
                      + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items())
                      + ". torch.distributed calls per edge on rank 0: "
                      + "; ".join(f"{k}: " + ", ".join(f"{n} x {c}" for n, c in v.items())
                                  for k, v in last["messages_rank0"].items()) + ".\n")
    return "\n".join([table, "", _funnel_plots(rows), phase_line, mem_table])


def _funnel_plots(rows: list[dict]) -> str:
    plt = pyplot()
    lengths = sorted({r["L"] for r in rows})
    sizes = sorted({r["N"] for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for length in lengths:
        sel = [r for r in rows if r["L"] == length]
        ax1.plot([r["N"] for r in sel], [r["bytes_ratio"] for r in sel], "o-", label=f"L={length}")
        ax2.plot([r["N"] for r in sel], [r["speedup"] for r in sel], "o-", label=f"distflow, L={length}")
        ax2.plot([r["N"] for r in sel], [r["speedup_bare"] for r in sel], "x:", color=ax2.lines[-1].get_color())
    ax1.plot(sizes, [1.25 / n for n in sizes], "k--", label="target 1.25/N")
    ax1.set(xlabel="gloo ranks N", ylabel="busiest-rank bytes, distributed / centralized",
            title="Bytes through the busiest process")
    ax2.axhline(5, color="k", ls="--", label="target 5x (N=8, 16k)")
    ax2.set(xlabel="gloo ranks N", ylabel="centralized time / distributed time",
            title="Edge speedup, median (x: bare collectives)")
    log_x_axis(ax1, sizes)
    log_x_axis(ax2, sizes)
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=7)
    by_n = save_figure(fig, "funnel_vs_n.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sizes:
        sel = [r for r in rows if r["N"] == n]
        line, = ax.plot([r["L"] for r in sel], [r["speedup"] for r in sel], "o-", label=f"N={n} edge")
        ax.plot([r["L"] for r in sel], [r["speedup_exchange"] for r in sel], "s--", color=line.get_color(),
                label=f"N={n} exchange only")
        ax.plot([r["L"] for r in sel], [r["speedup_bare"] for r in sel], "x:", color=line.get_color(),
                label=f"N={n} bare")
    ax.set(xlabel="nominal tokens per sample", ylabel="centralized / distributed time",
           title="Speedup vs sample length (median)")
    log_x_axis(ax, lengths)
    ax.legend(fontsize=7)
    return by_n + "\n" + save_figure(fig, "funnel_vs_length.png")


def render_balancer(result: dict) -> str:
    rows = [r for r in result["rows"] if r["method"] in BALANCER_METHODS]
    methods = [m for m in BALANCER_METHODS if any(r["method"] == m for r in rows)]
    parts = []
    for dataset in ("gsm8k", "long_tail"):
        body = []
        for per in sorted({r["per_rank"] for r in rows}):
            for dp in sorted({r["dp"] for r in rows}):
                cell = {r["method"]: r for r in rows if (r["dataset"], r["per_rank"], r["dp"]) == (dataset, per, dp)}
                body.append([per, dp] + [f"{cell[m]['vs_bound_mean']:.4f}" for m in methods]
                            + [f"{cell['lpt']['vs_mean_mean']:.4f}", f"{cell['lpt']['vs_strong_bound_mean']:.4f}"])
        parts.append(f"**{dataset}** (max load / max(mean load, longest item), mean over seeds):\n\n" + md_table(
            ["samples/rank", "dp"] + methods + ["lpt max/mean", "lpt / strong bound"], body))
    plan = result["planning"]
    columns = [k for k in PLANNING_COLUMNS if k in next(iter(plan["seconds"].values()))]
    timing = md_table(["dataset"] + [PLANNING_COLUMNS[k] for k in columns],
                      [[d] + [f"{t[k] * 1e3:.1f}" for k in columns] for d, t in plan["seconds"].items()])
    scaling = md_table(["ranks", "samples", "per-edge plan (s)"],
                       [[r["num_ranks"], r["num_samples"], f"{r['runtime']:.3f}" if "runtime" in r else "not run"]
                        for r in result["plan_scaling"]])
    stats = result["gsm8k_length_stats"]
    return "\n\n".join(parts + [
        f"GSM8K-derived lengths: {stats['count']} records, mean {stats['mean']:.0f}, "
        f"min {stats['min']}, max {stats['max']} tokens.",
        f"Planning time for {plan['num_samples']} samples over {plan['num_ranks']} ranks, ms (median of 7; "
        "*per-edge plan* = what every rank runs before a balanced move: `balanced_assignment` "
        "(balancer + bin-to-rank matching) + `plan_for_rank` + the exchange's per-rank wire sizes):\n\n"
        + timing,
        "Per-edge plan on every rank as the job grows (16 samples per rank, long-tailed lengths; "
        "median of 3 below 256 ranks, one run from 256 up):\n\n" + scaling,
        _balancer_plot(rows)])


def _balancer_plot(rows: list[dict]) -> str:
    plt = pyplot()
    methods = [m for m in BALANCER_METHODS if any(r["method"] == m for r in rows)]
    pers = sorted({r["per_rank"] for r in rows})
    fig, axes = plt.subplots(2, len(pers), figsize=(4 * len(pers), 7), squeeze=False)
    for i, dataset in enumerate(("gsm8k", "long_tail")):
        for j, per in enumerate(pers):
            ax = axes[i][j]
            for m in methods:
                sel = sorted((r for r in rows if (r["dataset"], r["per_rank"], r["method"]) == (dataset, per, m)),
                             key=lambda r: r["dp"])
                ax.plot([r["dp"] for r in sel], [r["vs_bound_mean"] for r in sel], "o-", label=m, ms=4)
            ax.axhline(1.01, color="k", ls=":", lw=1)
            ax.set(title=f"{dataset}, {per} samples/rank", xlabel="dp size",
                   ylabel="max load / max(mean, longest)")
            log_x_axis(ax, sorted({r["dp"] for r in rows}))
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, "imbalance_vs_dp.png")


def render_double_buffer(result: dict) -> str:
    rows = result["rows"]
    table = md_table(
        ["generation size", "swap (us, median)", "swap max (us)", "inline free (ms)", "background free (ms)",
         "RSS returned"],
        [[fmt_bytes(r["bytes"]), f"{r['swap_seconds'] * 1e6:.1f}", f"{r['swap_seconds_max'] * 1e6:.1f}",
          f"{r['inline_free_seconds'] * 1e3:.2f}", f"{r['background_free_seconds'] * 1e3:.2f}",
          fmt_bytes(r["rss_returned_bytes"])] for r in rows])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = [r["bytes"] / 2**20 for r in rows]
    ax.plot(sizes, [r["swap_seconds"] for r in rows], "o-", label="StepBuffer.swap (critical path)")
    ax.plot(sizes, [r["inline_free_seconds"] for r in rows], "s--", label="inline free (what swap avoids)")
    ax.plot(sizes, [r["background_free_seconds"] for r in rows], "x:", label="background free (off the path)")
    ax.set(yscale="log", xlabel="generation size (MiB)", ylabel="seconds", title="Double buffer swap vs freeing")
    log_x_axis(ax, [int(x) for x in sizes])
    ax.legend(fontsize=8)
    return table + "\n\n" + save_figure(fig, "double_buffer.png")


def render_e2e(result: dict) -> str:
    if "error" in result:
        return f"**Not measured:** {result['error']}"
    s = result["settings"]
    distflow_only = {"share_prefill": "distflow only (`rollout.sharePrefill`)",
                     "share_prompt_prefix": "distflow only (`actor.sharePromptPrefix`)",
                     "reshard_after_forward": "distflow only (`actor.reshardAfterForward`)",
                     "workers": "distflow (TRL: one process)"}
    settings = md_table(["setting", "value", "applies to"],
                        [[k, v, distflow_only.get(k, "both")] for k, v in s.items()])
    summ = result["summary"]
    table = md_table(
        ["framework", "median step (s)", "tokens/step", "tokens/s (machine)", "mean response", "steps measured",
         "run wall times (s)"],
        [[name, f"{x['median_step_seconds']:.2f}", f"{x['median_step_tokens']:.0f}",
          f"{x['median_tokens_per_s']:.1f}", f"{x['mean_response_length']:.1f}", x["steps_measured"],
          ", ".join(f"{w:.0f}" for w in x["run_wall_seconds"])] for name, x in summ.items()])
    per_run = md_table(["run", "step seconds", "step tokens"],
                       [[f"{name} #{i}", ", ".join(f"{v:.2f}" for v in r["step_seconds"]),
                         ", ".join(f"{v:.0f}" for v in r["step_tokens"])] if "error" not in r
                        else [f"{name} #{i}", f"failed: {r['error'][:200]}", ""]
                        for name, runs in result["runs"].items() for i, r in enumerate(runs)])
    stages = summ["distflow"].get("median_stage_seconds", {})
    if stages:
        table += "\n\ndistflow's median step by stage (slowest rank): " + ", ".join(
            f"{k} {v:.2f} s" for k, v in stages.items())
    single = summ.get("distflow_1_worker")
    if single:
        table += (f"\n\n`distflow_1_worker` is one extra distflow run with 1 worker x {s['threads']} threads "
                  "(no second process, FSDP over a group of one): it separates what the two-process "
                  "data-parallel split costs on 2 cores from what the single-process path costs.")
    return (f"TRL {result['trl_version']}. Settings:\n\n{settings}\n\n{table}\n\n"
            f"distflow / TRL throughput: **{result['speedup']:.2f}x**.\n\nEvery step (first of each run dropped "
            f"from the medians as warm-up):\n\n{per_run}")


def render_async(result: dict) -> str:
    """Section 9: ``tests.bench.async_pools``."""
    if "error" in result:
        return f"**Not measured:** {result['error']}"
    from tests.bench import async_pools

    s, summ = result["settings"], async_pools.summary_of(result)
    a = summ["async"]
    table = md_table(["mode", "median step (s)", "generate (s)", "train (s)", "step / max(generate, train)"],
                     [["sync (2 workers generate, then train)", f"{summ['sync']['median_step_seconds']:.2f}",
                       "", "", ""],
                      [f"async (1 trainer + 1 rollout worker, maxStaleness {s['max_staleness']})",
                       f"{a['median_step_seconds']:.2f}", f"{a['median_generate_seconds']:.2f}",
                       f"{a['median_train_seconds']:.2f}", f"**{a['median_step_over_floor']:.2f}**"]])
    steps = sorted(int(k) for k in summ["curves"]["sync"])
    curve = md_table(["step", *[f"sync seed {r['seed']}" for r in result["runs"]["sync"]],
                      *[f"async seed {r['seed']}" for r in result["runs"]["async"]], "async mean within sync's spread",
                      "async mean >= sync's worst seed"],
                     [[k, *[f"{v:.3f}" for v in summ["curves"]["sync"][str(k)]],
                       *[f"{v:.3f}" for v in summ["curves"]["async"][str(k)]],
                       "yes" if summ["async_mean_within_sync_spread"][str(k)] else "no",
                       "yes" if summ["async_mean_at_least_sync_min"][str(k)] else "no"] for k in steps])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for mode, color in (("sync", "tab:blue"), ("async", "tab:orange")):
        for r in result["runs"][mode]:
            xs, ys = zip(*r["eval"])
            ax.plot(xs, ys, color=color, alpha=0.35, lw=1)
        mean = [sum(summ["curves"][mode][str(k)]) / len(summ["curves"][mode][str(k)]) for k in steps]
        ax.plot(steps, mean, color=color, lw=2.2, label=f"{mode} (mean of {len(result['runs'][mode])} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out score (mean@4)")
    ax.legend()
    plot = save_figure(fig, "async_convergence.png")
    doc = async_pools.__doc__.split(chr(10) * 2, 1)[1].strip()
    order = ", ".join(f"{m} {seed}" for m, seed in result["order"])
    speed = (f"Async / sync step time: sync step {summ['sync']['median_step_seconds']:.2f} s, async step "
             f"{a['median_step_seconds']:.2f} s (**{summ['speedup']:.2f}x**).")
    return "\n\n".join([doc, f"Settings: {s}. Order: {order}.", table, speed, "Held-out score:", curve, plot])


def render_memory(result: dict) -> str:
    if "error" in result:
        return f"**Not measured:** {result['error']}"
    need = result["need_bytes"]
    rows = []
    for mode, summ in result["summary"].items():
        for rank, (peak, anon) in enumerate(zip(summ["peak_rss"], summ["peak_anon"])):
            rows.append([mode, rank, fmt_bytes(peak), fmt_bytes(anon), f"{peak / need:.2f}"])
    p, w = result["num_params"], result["world_size"]
    arithmetic = (f"P = {p:,} parameters, W = {w} workers: full weights for the rollout 4P = {fmt_bytes(4 * p)}, actor shard "
                  f"4P/W = {fmt_bytes(4 * p / w)}, gradient shard 4P/W = {fmt_bytes(4 * p / w)}, Adam moments "
                  f"8P/W = {fmt_bytes(8 * p / w)}; need = {fmt_bytes(need)}; 1.5 x need = {fmt_bytes(1.5 * need)}.")
    spread = md_table(["mode", "max peak / median peak"],
                      [[m, f"{s['max_over_median']:.3f}"] for m, s in result["summary"].items()])
    return "\n\n".join([arithmetic, md_table(["mode", "rank", "peak RSS (VmHWM)", "peak anonymous RSS",
                                              "peak / need"], rows), spread])


def render_loading(result: dict) -> str:
    """Peak host RSS per rank while loading, before (whole model, then ``fully_shard``) and after."""
    rows = []
    for world in sorted({int(k.split("=")[1]) for k in result}):
        for rank, (b, a) in enumerate(zip(result[f"before/W={world}"], result[f"after/W={world}"])):
            rows.append([world, rank, f"{b['peak_mib']:.1f}", f"{a['peak_mib']:.1f}",
                         f"{a['peak_mib'] / b['peak_mib']:.2f}", f"{a['local_shard_mib']:.1f}"])
    return md_table(["W", "rank", "whole then shard: peak MiB", "sharded load: peak MiB", "sharded / whole",
                     "local shard MiB"], rows)


def render_logprob(result: dict) -> str:
    """Peak RSS growth of the log-prob pass, per logits dtype and pass, before and after."""
    rows = []
    for dtype in dict.fromkeys(k.split("/")[1] for k in result):
        b, a = result[f"before/{dtype}"], result[f"after/{dtype}"]
        for name in ("no_grad", "forward_backward"):
            rows.append([dtype, f"{b['logits_mib']:.0f}", name.replace("_", " "), f"{b[name + '_mib']:.0f}",
                         f"{a[name + '_mib']:.0f}", f"{a[name + '_mib'] / b[name + '_mib']:.2f}"])
    return md_table(["logits dtype", "[b, R, V] logits MiB", "pass", "before MiB", "after MiB", "after / before"],
                    rows)


RESIZE_FIXES = {
    "trained on": "it is training, not lost time: the gang trains on at the old size until a step boundary finds "
                  "the joiners of a grow Ready (each a fresh interpreter that imports torch and serves its metrics, "
                  "competing with the running workers for the cores) or, for a shrink, the step in flight done; "
                  "joiners started from a warm pool would take the new size sooner",
    "checkpoint + re-form": "the step's checkpoint: the model and both Adam moments (float32: 12 bytes a "
                            "parameter, 1.6 GB for SmolLM2) written with fsync and read back to hash them for "
                            "the manifest (each worker a share); resharding the state in memory across the "
                            "re-formed world would spare it",
    "resume": "the old world's groups closed, the new world formed, the actor built again (without reading the "
              "pretrained files) and the checkpoint verified and read into it at the new world size; resharding "
              "the state in memory would spare the verification and the read",
    "first step": "nothing resize-specific: the first step of a worker built again is slower than the next ones",
}
"""What would shorten each phase of an in-place resize when it is the one most over its share."""


def render_resize(result: dict) -> str:
    """Section 11: ``tests.bench.resize_cost``."""
    from tests.bench import resize_cost

    phases = resize_cost.PHASES
    if not all(set(phases) <= set(r["phases"]) for r in result.get("resizes", [{"phases": {}}])):
        return ("**Recorded on the stop path** (the gang stopped, its pods were recreated and it resumed), before "
                "whole-gang resizes were done in place: its phases are not this benchmark's. Re-run "
                "`PYTHONPATH=worker_image:operator:. python -m tests.bench.report --only resize`.")
    rows = []
    for r in result["resizes"]:
        rows.append([f"{r['from']} -> {r['to']}", f"**{r['phases']['total']:.1f}**",
                     *[f"{r['phases'][p]:.1f}" for p in phases], f"{r['phases']['without training']:.1f}",
                     f"{r['pods_seconds']:.1f}", f"{r['target_seconds']:.1f}", f"{r['ratio']:.2f}",
                     "met" if r["met"] else "**missed**", f"{r['operator_cost_seconds']:g}"])
        rows.append(["over its share of the target", f"{r['phases']['total'] - r['target_seconds']:+.1f}",
                     *[f"{r['excess'][p]:+.1f}" for p in phases], "", "", "", "", "", ""])
    costs = md_table(["resize", "cost (s)", *phases, "without training (s)", "joiners Ready / leavers exited (s)",
                      "target (s)", "cost / target", "target", "lastResize.costSeconds"], rows)
    fresh = md_table(["fresh start", *resize_cost.FRESH_PHASES, "total (s)"],
                     [[f"{n} nodes", *[f"{f[p]:.1f}" for p in resize_cost.FRESH_PHASES], f"{f['total']:.1f}"]
                      for n, f in sorted(result["fresh_start"].items())])
    medians = result["median_step_seconds"]
    reference = ("Reference: median step " + ", ".join(f"{medians[n]:.1f} s at {n} nodes" for n in sorted(medians))
                 + " (the first step at each size left out); steps: "
                 + ", ".join(f"{k}: {v:.1f}" for k, v in result["step_seconds"].items()) + " s.")
    reference += (" One run on 2 cores: 4 nodes (4 node processes and 4 workers) oversubscribe them, so "
                  "every 4-node figure, step and start alike, is slower than the 2-node one; this measures what a "
                  "resize costs, not what it gains.")
    checks = "Checks in this run: " + "; ".join(f"{name}: {'yes' if ok else '**no**'}"
                                               for name, ok in result["checks"].items()) + \
        f". Status at the end: {result['status']}."
    reading = ["Each phase's share of the target: trained on's is the median step at the size left plus the "
               "fresh start's worker start (the joiners of a grow start meanwhile), resume's and the first "
               "step's are the fresh start's initialisation and first step; checkpoint + re-form has none."]
    reading += [_resize_reading(r, result) for r in result["resizes"]]
    doc = resize_cost.__doc__.split(chr(10) * 2, 1)[1].strip()
    return "\n\n".join([doc, f"Settings: {result['settings']}.", costs, fresh, reference, checks,
                         *reading, _resize_plot(result)])


def _resize_reading(r: dict, result: dict) -> str:
    """One resize's verdict, its largest phase and the phase most over its share (with its fix)."""
    start, over = result["fresh_start"][str(r["to"])], r["largest_excess"]
    step = result["median_step_seconds"][str(r["from"])]
    spare = r["target_seconds"] - r["phases"]["total"]
    narrow = r["met"] and spare < 0.05 * r["target_seconds"]
    pods = "its joiners were Ready" if r["to"] > r["from"] else "its leaving nodes had exited"
    text = (f"{r['from']} -> {r['to']}: {r['phases']['total']:.1f} s against {r['target_seconds']:.1f} s "
            f"(step {step:.1f} s + fresh start at {r['to']} nodes {start['total']:.1f} s), "
            + (f"met with {spare:.1f} s to spare" if r["met"] else f"missed by {-spare:.1f} s ({r['ratio'] - 1:.0%})")
            + (" (under 5% of a target that this run's own step and fresh-start times set, so the "
               "verdict moves with the machine's load)" if narrow else "")
            + f". The gang trained {r['steps_trained_on']} step{'s' * (r['steps_trained_on'] != 1)} at "
            f"{r['from']} nodes after the request and re-formed after step {r['reformed_after']}; {pods} "
            f"{r['pods_seconds']:.1f} s after the request, and it trained nothing for "
            f"{r['phases']['without training']:.1f} s. Its largest part is {r['dominant']} "
            f"({r['phases'][r['dominant']]:.1f} s); the part most over its share is {over} "
            f"({r['excess'][over]:+.1f} s)")
    return text + (f": {RESIZE_FIXES[over]}." if r["excess"][over] > 0 else ".")


def _resize_plot(result: dict) -> str:
    from tests.bench import resize_cost

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    labels = [f"{r['from']} -> {r['to']}" for r in result["resizes"]]
    for y, r in enumerate(result["resizes"]):
        left = 0.0
        for k, phase in enumerate(resize_cost.PHASES):
            width = r["phases"][phase]
            ax.barh(y, width, left=left, color=f"C{k}", label=phase if y == 0 else None)
            left += width
        ax.plot([r["target_seconds"]] * 2, [y - 0.4, y + 0.4], "k--", lw=1.5,
                label="target" if y == 0 else None)
        ax.plot([r["pods_seconds"]], [y - 0.45], "kv", ms=6, label="joiners Ready / leavers exited" if y == 0 else None)
    ax.set_yticks(range(len(labels)), labels=labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the scale request")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    return save_figure(fig, "resize_cost.png")


def render_gpu(result: dict | None) -> str:
    if not result:
        return "**Not run yet.** No GPU machine was lent to a session since the check was written."
    from tests.bench.gpu_check import markdown

    return markdown(result).split("\n", 1)[1].strip()  # without its title: this section has one


def speedup_at(result: dict, n: int, length: int) -> float | None:
    for r in funnel_rows(result):
        if (r["N"], r["L"]) == (n, length):
            return r["speedup"]
    return None

