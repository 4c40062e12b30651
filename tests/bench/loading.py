"""Peak host RSS per rank while loading the actor: whole model then ``fully_shard`` vs sharded load.

Before (the runtime until issue 11): every rank runs ``from_pretrained`` on
the whole model, then shards it with ``apply_fsdp``. After:
``load_sharded_causal_lm`` builds the model on the meta device, shards it
and reads only this rank's rows from the safetensors file. Each (way, W)
runs in W fresh gloo processes on SmolLM2-135M (float32); each rank reports
its VmHWM after loading, less its RSS before (the imports). Printed side by
side: the "after" figure must fall with W, the "before" one cannot.

    PYTHONPATH=worker_image:operator:. python -m tests.bench.loading --world 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tests.bench._common import REPO_ROOT, peak_rss_bytes, reset_peak_rss
from tests.bench.render import render_loading

MIB = 1 << 20


def _load_on_rank(rank: int, world: int, way: str) -> dict:
    import gc

    import torch

    from distflow.engines import fsdp
    from distflow.engines.loading import load_sharded_causal_lm
    from distflow.models import load_causal_lm, resolve_model
    from distflow.models import model_cache_dir

    model_dir = resolve_model("smollm2", model_cache_dir())
    mesh = fsdp.dp_mesh(torch.device("cpu"), world)
    gc.collect()
    reset_peak_rss()
    base = peak_rss_bytes()
    if way == "before":
        model = fsdp.apply_fsdp(load_causal_lm(model_dir, "float32"), mesh)
    else:
        model = load_sharded_causal_lm(model_dir, mesh, torch.device("cpu"), torch.float32)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"peak_mib": (peak_rss_bytes() - base) / MIB, "local_shard_mib": local / MIB}


def run(worlds: list[int]) -> dict:
    sys.path.insert(0, str(REPO_ROOT / "tests" / "dist"))
    from _spawn import run_on_ranks

    from tests.bench.loading import _load_on_rank  # by module name, not __main__, for the spawned ranks

    out = {}
    for world in worlds:
        for way in ("before", "after"):
            out[f"{way}/W={world}"] = run_on_ranks(_load_on_rank, world, way, timeout_s=1200)
            print(f"{way}/W={world}", json.dumps(out[f"{way}/W={world}"]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    results = run(parser.parse_args().world)
    print(json.dumps(results, indent=1))
    print(render_loading(results))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
