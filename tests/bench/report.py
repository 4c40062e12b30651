"""Run every benchmark and write docs/benchmarks.md (tables, plots under docs/benchmarks/).

    PYTHONPATH=worker_image:operator:. python -m tests.bench.report            # everything (~20 min)
    PYTHONPATH=worker_image:operator:. python -m tests.bench.report --only funnel,balancer
    PYTHONPATH=worker_image:operator:. python -m tests.bench.report --render   # re-render saved results

Results are kept in docs/benchmarks/results.json, one entry per section with
the time, machine load and command that produced it, so ``--only`` re-runs
some sections and keeps the others. The scaling projection is recomputed
from the saved measurements at every render (it is pure arithmetic).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import inspect
import json
import os
import subprocess
import time
import traceback

from tests.bench import render, scaling_model
from tests.bench._common import DOCS_DIR, FIGURES_DIR, REPO_ROOT, machine_info, md_table

SECTIONS = ("funnel", "balancer", "double_buffer", "e2e", "memory", "loading", "logprob", "async", "resize")
RESULTS = FIGURES_DIR / "results.json"
COMMAND = "PYTHONPATH=worker_image:operator:. python -m tests.bench.report"
PLANNERS = {
    "runtime": "per-edge plan on every rank: balanced_assignment + plan_for_rank + the exchange's "
               "per-rank wire sizes (balancer section)",
}
"""Per-edge planning the projection is computed for (keys of the balancer's ``plan_scaling``
rows). Results recorded before the runtime took over the bench prototype hold prototype
variants as well; they are not projected."""
MIN_FREE_GIB = {"e2e": 7.0, "memory": 7.0, "loading": 7.0, "async": 7.0, "resize": 7.0}
"""Free memory the model-training sections wait for: the machine is shared."""


def _run_section(name: str) -> dict:
    if name == "funnel":
        from tests.bench import funnel
        return funnel.run()
    if name == "balancer":
        from tests.bench import balancer
        return balancer.run()
    if name == "double_buffer":
        from tests.bench import double_buffer
        return double_buffer.run()
    if name == "e2e":
        from tests.bench import e2e_trl
        return e2e_trl.run()
    if name == "memory":
        from tests.bench import memory
        return memory.run()
    if name == "loading":
        from tests.bench import loading
        return loading.run([2, 4])
    if name == "logprob":
        from tests.bench import logprob_memory
        return logprob_memory.run(batch=4, response=512, prompt=64, temperature=0.7)
    if name == "async":
        from tests.bench import async_pools
        return async_pools.run()
    if name == "resize":
        from tests.bench import resize_cost
        return resize_cost.run()
    raise ValueError(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")


def _free_gib() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def _wait_for_memory(name: str, wait_s: float = 600.0) -> str | None:
    """None when enough memory is free (waiting up to ``wait_s``), else why not."""
    need = MIN_FREE_GIB.get(name, 0.0)
    deadline = time.monotonic() + wait_s
    while _free_gib() < need:
        if time.monotonic() > deadline:
            return f"only {_free_gib():.1f} GiB free after waiting {wait_s:.0f} s (needs {need} GiB)"
        time.sleep(10)
    return None


def _commit() -> str | None:
    """The checked-out commit (``+dirty`` with uncommitted changes under worker_image/), or None."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "worker_image"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def run_sections(names, results: dict) -> None:
    """Run each section and save its entry; a section that cannot start (not enough free
    memory on this shared machine) keeps its previous entry."""
    for name in names:
        why_not = _wait_for_memory(name)
        if why_not:
            print(f"[report] {name} skipped, previous results kept: {why_not}", flush=True)
            continue
        entry = {"command": f"{COMMAND} --only {name}",
                 "started": datetime.datetime.now().isoformat(timespec="seconds"), "commit": _commit(),
                 "load_before": round(os.getloadavg()[0], 2), "machine": machine_info()}
        start = time.perf_counter()
        print(f"[report] {name} ...", flush=True)
        try:
            entry["result"] = _run_section(name)
        except Exception as err:  # a broken section is reported, not fatal to the others
            entry["result"] = {"error": f"{type(err).__name__}: {err}"}
            traceback.print_exc()
        entry["seconds"] = round(time.perf_counter() - start, 1)
        entry["load_after"] = round(os.getloadavg()[0], 2)
        results[name] = entry
        print(f"[report] {name} done in {entry['seconds']} s", flush=True)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1, default=float))


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string after each field), from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def measured_inputs(results: dict, planner: str = "runtime") -> scaling_model.Measured | None:
    """The scaling model's measured inputs, from the funnel and balancer sections (the
    runtime's balancer, ``lpt``, for the imbalance)."""
    funnel = results.get("funnel", {}).get("result", {})
    balancer = results.get("balancer", {}).get("result", {})
    if "rows" not in funnel or "rows" not in balancer:
        return None
    messages = funnel["rows"][-1]["messages_rank0"]["distflow"]
    imbalance = [(r["dp"], r["vs_mean_mean"]) for r in balancer["rows"]
                 if (r["dataset"], r["per_rank"], r["method"]) == ("long_tail", 16, "lpt")]
    planning = [(r["num_samples"], r[planner]) for r in balancer["plan_scaling"] if planner in r]
    if not planning or not imbalance:
        return None
    return scaling_model.Measured(
        bytes_per_token=funnel["bytes_per_token"], host_copy_bytes_per_s=funnel["host_copy_bytes_per_s"],
        metadata_collectives_per_edge=messages.get("all_gather", 0) + messages.get("all_gather_object", 0),
        planning_points=tuple(planning), imbalance_points=tuple(sorted(imbalance)))


def render_scaling(results: dict) -> tuple[str, dict]:
    """The projection section and {planner: table rows}."""
    hw = scaling_model.Hardware()
    docs = field_docs(scaling_model.Hardware)
    assumptions = md_table(["assumption", "value", "why"],
                           [[f.name, f"{getattr(hw, f.name):g}", docs.get(f.name, "")]
                            for f in dataclasses.fields(hw)])
    tables = {}
    for planner in PLANNERS:
        m = measured_inputs(results, planner)
        if m is not None:
            tables[planner] = scaling_model.scaling_table(scaling_model.WORKLOADS, hw, m)
    if not tables:
        return "Needs the funnel and balancer sections.", {}
    m = measured_inputs(results, "runtime")
    if m is None:
        return "Needs the funnel and balancer sections.", {}
    mdocs = field_docs(scaling_model.Measured)
    measured = md_table(["measured input", "value", "what"], [
        ["bytes_per_token", f"{m.bytes_per_token:g}", mdocs["bytes_per_token"]],
        ["host_copy_bytes_per_s", f"{m.host_copy_bytes_per_s / 1e9:.2f} GB/s", mdocs["host_copy_bytes_per_s"]],
        ["metadata_collectives_per_edge", m.metadata_collectives_per_edge, mdocs["metadata_collectives_per_edge"]],
        *[[f"planning_points ({p})", ", ".join(f"{b}: {s:.3f} s" for b, s in
                                              measured_inputs(results, p).planning_points),
           f"{mdocs['planning_points']} Measured: {why}."]
          for p, why in PLANNERS.items() if p in tables],
        ["imbalance_points", ", ".join(f"dp {d}: {x:.4f}" for d, x in m.imbalance_points), mdocs["imbalance_points"]],
    ])
    workloads = md_table(["workload", "params", "layers", "samples/GPU", "prompt", "mean response",
                          "edges moved (distributed)", "edges routed (centralized)", "balanced edges"],
                         [[w.name, f"{w.params / 1e9:.1f}B", w.num_layers, w.samples_per_gpu, w.prompt_tokens,
                           w.response_tokens, *scaling_model.edge_counts(w)] for w in scaling_model.WORKLOADS])
    body = [f"Model: `tests/bench/scaling_model.py` (its docstring gives the formula).\n\n"
            f"Assumptions (target interconnect and accelerators):\n\n{assumptions}",
            f"Measured inputs (this machine, sections above):\n\n{measured}",
            f"Workloads (weak scaling: per-GPU work fixed):\n\n{workloads}"]
    for planner, rows in tables.items():
        body.append(f"Projected efficiency vs 32 GPUs ({planner} planning):\n\n" + _efficiency_table(rows))
    body.append(_scaling_plot(tables))
    return "\n\n".join(body), tables


def _efficiency_table(rows: list[dict]) -> str:
    counts = sorted({r["num_gpus"] for r in rows})
    out = []
    for name in dict.fromkeys(r["workload"] for r in rows):
        dist = {r["num_gpus"]: r for r in rows if r["workload"] == name and r["mode"] == "distributed"}
        cent = {r["num_gpus"]: r for r in rows if r["workload"] == name and r["mode"] == "centralized"}
        out.append([name, "distributed"] + [f"{dist[n]['efficiency']:.1%}" for n in counts]
                   + [f"{dist[512]['step_seconds']:.1f} s ({dist[512]['data_plane_seconds']:.2f} s data)"])
        out.append([name, "centralized"] + [f"{cent[n]['efficiency']:.1%}" for n in counts]
                   + [f"{cent[512]['step_seconds']:.1f} s ({cent[512]['data_plane_seconds']:.2f} s data)"])
        out.append([name, "speedup"] + [f"{cent[n]['step_seconds'] / dist[n]['step_seconds']:.2f}x" for n in counts]
                   + [""])
    return md_table(["workload", "data plane"] + [f"{n} GPUs" for n in counts] + ["step at 512"], out)


def _scaling_plot(tables: dict) -> str:
    plt = render.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {("runtime", "distributed"): "o-", ("runtime", "centralized"): "x:"}
    for ax, algorithm in zip(axes, ("GRPO", "PPO")):
        ax.axhspan(0.90, 0.94, color="0.9", label="paper: 90-94%")
        ax.axhline(0.95, color="k", ls="--", lw=1, label="target 95% at 512")
        for (planner, mode), style in styles.items():
            rows = [r for r in tables.get(planner, []) if r["mode"] == mode and algorithm in r["workload"]]
            for k, name in enumerate(dict.fromkeys(r["workload"] for r in rows)):
                sel = [r for r in rows if r["workload"] == name]
                ax.plot([r["num_gpus"] for r in sel], [r["efficiency"] for r in sel], style, color=f"C{k}",
                        label=f"{name}, {mode}")
        ax.set(xlabel="GPUs", ylabel="scaling efficiency vs 32 GPUs", title=algorithm, ylim=(0, 1.05))
        render.log_x_axis(ax, [32, 64, 128, 256, 512, 1024])
        ax.legend(fontsize=6)
    return render.save_figure(fig, "scaling_efficiency.png")


def _scaling_header(results: dict) -> str:
    stale = [name for name in ("funnel", "balancer")
             if render.stale_reason(name, results.get(name, {}).get("result", {}))]
    text = ("## 4. Scaling projection (cost model)\n\nCommand: recomputed by every run of "
            f"`{COMMAND}` from the funnel and balancer results.\n")
    if stale:
        text += (f"\n**Out of date:** its {' and '.join(stale)} inputs were recorded before the current runtime "
                 f"(see those sections); re-run `{COMMAND} --only {','.join(stale)}`.\n")
    return text


def _section_header(results: dict, name: str, title: str) -> str:
    entry = results.get(name)
    if not entry:
        return f"## {title}\n\nNot run yet: `{COMMAND} --only {name}`.\n"
    mach = entry["machine"]
    commit = f" at commit {entry['commit']}" if entry.get("commit") else ""
    text = (f"## {title}\n\nCommand: `{entry['command']}`. Run {entry['started']}{commit} on {mach['cores']} x "
            f"{mach['cpu']}, {mach['memory_gib']} GiB, torch {mach['torch']}; {entry['seconds']} s; load "
            f"average {entry['load_before']} before, {entry['load_after']} after.\n")
    why = render.stale_reason(name, entry.get("result", {}))
    if why:
        text += f"\n**Out of date:** {why}. Re-run `{COMMAND} --only {name}`.\n"
    return text


def _body(results: dict, name: str, fn) -> str:
    entry = results.get(name)
    if not entry:
        return ""
    if "error" in entry["result"]:
        return f"**Failed:** `{entry['result']['error']}`"
    return fn(entry["result"])


def latest_gpu_results() -> dict | None:
    """The newest ``docs/benchmarks/gpu-<date>.json`` from a GPU (CPU rehearsals excluded), or None."""
    runs = sorted(p for p in FIGURES_DIR.glob("gpu-*.json") if not p.stem.endswith("-cpu"))
    return json.loads(runs[-1].read_text()) if runs else None


def write_report(results: dict) -> str:
    from tests.bench import notes

    scaling_md, tables = render_scaling(results)
    gpu = latest_gpu_results()
    parts = [notes.intro(results, COMMAND),
             notes.targets_table(results, tables, gpu),
             _section_header(results, "funnel", "1. The funnel: distributed vs centralized redistribution"),
             notes.funnel_text(results), _body(results, "funnel", render.render_funnel),
             _section_header(results, "balancer", "2. The balancer"), notes.balancer_text(results),
             _body(results, "balancer", render.render_balancer),
             _section_header(results, "double_buffer", "3. The step buffer"), notes.double_buffer_text(results),
             _body(results, "double_buffer", render.render_double_buffer),
             _scaling_header(results), notes.scaling_text(results, tables), scaling_md,
             _section_header(results, "e2e", "5. End to end: distflow vs TRL GRPOTrainer"), notes.e2e_text(results),
             _body(results, "e2e", render.render_e2e),
             _section_header(results, "memory", "6. Memory per process"), notes.MEMORY,
             _body(results, "memory", render.render_memory),
             _section_header(results, "loading", "7. Loading the model: whole then sharded vs sharded"),
             notes.LOADING, _body(results, "loading", render.render_loading),
             _section_header(results, "logprob", "8. The log-prob pass: peak memory"), notes.LOGPROB,
             _body(results, "logprob", render.render_logprob),
             _section_header(results, "async", "9. Asynchronous training: sync vs two pools"),
             _body(results, "async", render.render_async),
             "## 10. GPU", notes.GPU, render.render_gpu(gpu),
             _section_header(results, "resize", "11. Resize cost: 2 -> 4 -> 2 nodes on the e2e kubelet"),
             _body(results, "resize", render.render_resize),
             notes.runtime_changes(results, tables)]
    text = "\n\n".join(p.strip("\n") for p in parts if p) + "\n"
    (DOCS_DIR / "benchmarks.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated sections: {','.join(SECTIONS)}")
    parser.add_argument("--render", action="store_true", help="only re-render from saved results")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if not args.render:
        names = args.only.split(",") if args.only else list(SECTIONS)
        unknown = sorted(set(names) - set(SECTIONS))
        if unknown:
            parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
        run_sections(names, results)
    write_report(results)
    print(f"[report] wrote {DOCS_DIR / 'benchmarks.md'}")


if __name__ == "__main__":
    os.chdir(REPO_ROOT)
    main()
