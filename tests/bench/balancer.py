"""The balancer: imbalance and planning time of the sequence-length partitioners.

Costs are sequence lengths in tokens (cost = tokens, alpha = 0). Two length
distributions:

- ``gsm8k``: prompt + gold answer of GSM8K train records, tokenized with the
  SmolLM2 tokenizer and its chat template (the prompt the runtime renders);
  a batch is a seeded draw from the 7,473 records.
- ``long_tail``: synthetic RL responses: response ~ LogNormal(ln 2000, 1.0)
  clipped to [32, 32768] tokens, plus a prompt uniform in [64, 1024].

For dp in 2..64 and 4 / 16 / 64 samples per rank (equal counts, as the
runtime balances), each partitioner's max rank load is divided by the mean
load and by the bound max(mean load, longest item); the runtime's stronger
``lower_bound`` (pigeonhole and equal-count terms) is reported too.
``lpt`` is the runtime's ``balance_partition`` (what the coordinator runs),
``lpt_plain`` the same without its swap refinement. Planning time is
measured for 4,096 samples over 64 ranks (every partitioner, and the
coordinator's per-edge plan) and, for the scaling model, the coordinator's
per-edge plan at 16 samples per rank from 32 to 1,024 ranks.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import time
from pathlib import Path

from tests.bench._common import REPO_ROOT, median

DP_SIZES = (2, 4, 8, 16, 32, 64)
PER_RANK = (4, 16, 64)


def gsm8k_dir() -> Path:
    return Path(os.environ.get("DISTFLOW_GSM8K_DIR", REPO_ROOT.parent / "shared" / "data" / "gsm8k"))


@functools.lru_cache(maxsize=None)
def gsm8k_lengths(limit: int | None = None) -> tuple[int, ...]:
    """Tokens of chat-templated prompt + gold answer per GSM8K train record."""
    from distflow.data.sources import open_source
    from distflow.engines.rollout import render_prompts
    from distflow.models import load_tokenizer, resolve_model
    from distflow.models import model_cache_dir

    tokenizer = load_tokenizer(resolve_model("smollm2", model_cache_dir()))
    rows = [json.loads(line) for line in (gsm8k_dir() / "train.jsonl").read_text().splitlines() if line]
    rows = rows[:limit] if limit else rows
    source = open_source(str(gsm8k_dir() / "train.jsonl"), size=len(rows))
    prompts = render_prompts(tokenizer, source.read(range(len(rows))), 1 << 20)
    answers = tokenizer([r["answer"] for r in rows], add_special_tokens=False)["input_ids"]
    return tuple(len(p) + len(a) + 1 for p, a in zip(prompts, answers))  # +1: EOS


def long_tail_lengths(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        response = min(32768, max(32, int(rng.lognormvariate(math.log(2000), 1.0))))
        out.append(response + rng.randint(64, 1024))
    return out


def draw(dataset: str, pool: list[int], count: int, seed: int) -> list[float]:
    if dataset == "gsm8k":
        rng = random.Random(seed)
        return [float(rng.choice(pool)) for _ in range(count)]
    return [float(x) for x in long_tail_lengths(count, seed)]


def partitioners() -> dict:
    from distflow.data.balance import balance_partition, karmarkar_karp_partition

    from tests.bench.partitioners import contiguous_partition

    return {
        "lpt": balance_partition,
        "lpt_plain": lambda c, k, e=True: balance_partition(c, k, e, refine=False),
        "karmarkar_karp": karmarkar_karp_partition,
        "contiguous": contiguous_partition,
    }


def _quality(costs, bins, num_ranks) -> dict:
    from distflow.data.balance import lower_bound, rank_loads

    loads = rank_loads(costs, bins)
    mean = sum(loads) / num_ranks
    simple = max(mean, max(costs))
    return {"vs_mean": max(loads) / mean, "vs_bound": max(loads) / simple,
            "vs_strong_bound": max(loads) / lower_bound(costs, num_ranks)}


def imbalance_table(seeds: int = 5, dp_sizes=DP_SIZES, per_rank=PER_RANK) -> list[dict]:
    """One row per (dataset, dp, samples per rank, method): mean and worst over seeds."""
    pool = gsm8k_lengths()
    rows = []
    for dataset in ("gsm8k", "long_tail"):
        for dp in dp_sizes:
            for per in per_rank:
                draws = [draw(dataset, pool, dp * per, 1000 * dp + 10 * per + s) for s in range(seeds)]
                for name, fn in partitioners().items():
                    q = [_quality(c, fn(c, dp), dp) for c in draws]
                    rows.append({"dataset": dataset, "dp": dp, "per_rank": per, "method": name,
                                 **{f"{k}_mean": sum(x[k] for x in q) / len(q) for k in q[0]},
                                 **{f"{k}_worst": max(x[k] for x in q) for k in q[0]}})
    return rows


def planning_times(num_samples: int = 4096, num_ranks: int = 64, repeats: int = 7) -> dict:
    """Median seconds to partition (each method) and to build the coordinator's whole plan."""
    out = {}
    for dataset in ("gsm8k", "long_tail"):
        costs = draw(dataset, gsm8k_lengths(), num_samples, 7)
        fns = dict(partitioners())
        fns.pop("contiguous")
        timings = {name: _median_time(functools.partial(fn, costs, num_ranks), repeats)
                   for name, fn in fns.items()}
        for name, plan in _coordinator_plans().items():
            timings[f"coordinator_plan_{name}"] = _median_time(
                functools.partial(plan, costs, num_ranks, num_samples // num_ranks), repeats)
        out[dataset] = timings
    return {"num_samples": num_samples, "num_ranks": num_ranks, "seconds": out}


def _coordinator_plans() -> dict:
    """name -> f(costs, k, per_rank): what every rank computes for one balanced edge before
    moving data: the target layout, its part of the plan, and the byte sizes of its all_to_all.

    ``runtime`` is what the coordinator and ``exchange`` run on rank 0:
    ``balanced_assignment`` (balancer + bin-to-rank matching), ``plan_for_rank``
    (this rank's send row and receive column) and ``wire.rank_wire_sizes``.
    The metadata all-gathers before it are measured by the funnel.
    """
    import torch

    from distflow.data import wire
    from distflow.data.redistribute import balanced_assignment, plan_for_rank

    from tests.bench.funnel import make_batch

    schema = make_batch([1], 0).field_schema()

    def runtime(costs, k, per):
        held = _holdings(k, per)
        plan = plan_for_rank(held, balanced_assignment(held, costs), 0)
        lengths = [[int(costs[g]) for g in ids] for ids in held]
        wire.rank_wire_sizes(plan, schema, lengths, None, torch.device("cpu"))

    return {"runtime": runtime}


def _holdings(k: int, per: int) -> list[list[int]]:
    return [list(range(r * per, (r + 1) * per)) for r in range(k)]


def plan_scaling(per_rank: int = 16, rank_counts=(32, 64, 128, 256, 512, 1024)) -> list[dict]:
    """Per-edge planning seconds vs ranks on long-tailed lengths (weak scaling: 16 per rank);
    one run each from 256 ranks up, the median of 3 below."""
    rows = []
    for k in rank_counts:
        costs = draw("long_tail", (), k * per_rank, 11)
        row = {"num_ranks": k, "num_samples": k * per_rank}
        for name, plan in _coordinator_plans().items():
            row[name] = _median_time(functools.partial(plan, costs, k, per_rank), 3 if k < 256 else 1)
        rows.append(row)
    return rows


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def run(seeds: int = 5) -> dict:
    pool = gsm8k_lengths()
    return {
        "gsm8k_length_stats": {"count": len(pool), "mean": sum(pool) / len(pool), "max": max(pool),
                               "min": min(pool)},
        "rows": imbalance_table(seeds),
        "planning": planning_times(),
        "plan_scaling": plan_scaling(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    out = run(args.seeds)
    for row in out["rows"]:
        print(f"{row['dataset']:9} dp={row['dp']:2} per={row['per_rank']:2} {row['method']:15} "
              f"max/mean {row['vs_mean_mean']:.4f} max/bound {row['vs_bound_mean']:.4f} "
              f"(worst {row['vs_bound_worst']:.4f}) strong {row['vs_strong_bound_mean']:.4f}")
    print(json.dumps(out["planning"], indent=1))
    print(json.dumps(out["plan_scaling"], indent=1))


if __name__ == "__main__":
    main()
