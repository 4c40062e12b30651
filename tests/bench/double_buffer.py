"""The step buffer: swap cost against step size, and freeing off the critical path.

For each size S (1 MiB .. 1 GiB) a step's data is S bytes in 16 tensors
(pages touched, as real step data is). Measured, alternating inline and
buffered frees, median over repeats:

- ``swap``: ``StepBuffer.swap()`` when the step it retires holds S
  bytes: what the step boundary costs the training loop;
- ``inline_free``: dropping the same S bytes on the caller's thread (what a
  plain ``dict.clear()`` at the step boundary would cost);
- ``background_free``: how long the background thread then takes to give
  the memory back (swap returns to ``drain()`` returns), off the critical path;
- ``rss_returned``: resident memory before the swap minus after ``drain()``,
  i.e. the memory really went back to the OS.

Runs in a fresh process with a fixed mmap threshold so freed tensors are
unmapped at once, as large CUDA/pinned or multi-MB host buffers are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from tests.bench._common import median

SIZES = tuple(2**k for k in range(20, 31, 2))  # 1 MiB .. 1 GiB, x4
NUM_TENSORS = 16


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _generation(nbytes: int) -> dict:
    import torch

    per = max(1, nbytes // NUM_TENSORS)
    # ones, not empty: untouched pages would make every free look free
    return {f"field{i}": torch.ones(per, dtype=torch.uint8) for i in range(NUM_TENSORS)}


def _swap_once(nbytes: int) -> dict:
    """One buffered step boundary retiring ``nbytes``."""
    from distflow.data.buffer import StepBuffer

    buf = StepBuffer()
    for key, value in _generation(nbytes).items():
        buf.put(key, value)
    before = _rss()
    start = time.perf_counter()
    buf.swap()
    swapped = time.perf_counter()
    buf.drain()
    drained = time.perf_counter()
    returned = before - _rss()
    buf.close()
    return {"swap": swapped - start, "background_free": drained - swapped, "rss_returned": returned}


def _inline_once(nbytes: int) -> float:
    gen = _generation(nbytes)
    start = time.perf_counter()
    gen.clear()
    return time.perf_counter() - start


def measure(sizes=SIZES, repeats: int = 5) -> list[dict]:
    """In this process: per size, medians over alternated buffered / inline repeats."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for size in sizes:
        reps = max(2, repeats if size <= 2**28 else repeats // 2)
        buffered, inline = [], []
        for rep in range(reps):
            if rep % 2:
                inline.append(_inline_once(size))
                buffered.append(_swap_once(size))
            else:
                buffered.append(_swap_once(size))
                inline.append(_inline_once(size))
        rows.append({
            "bytes": size,
            "swap_seconds": median([b["swap"] for b in buffered]),
            "swap_seconds_max": max(b["swap"] for b in buffered),
            "inline_free_seconds": median(inline),
            "background_free_seconds": median([b["background_free"] for b in buffered]),
            "rss_returned_bytes": median([b["rss_returned"] for b in buffered]),
            "repeats": reps,
        })
    return rows


def run(repeats: int = 5, sizes=SIZES) -> dict:
    """Runs ``measure`` in a fresh interpreter (clean heap, fixed mmap threshold)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    cmd = [sys.executable, "-m", "tests.bench.double_buffer", "--json", "--repeats", str(repeats),
           "--sizes", ",".join(str(s) for s in sizes)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return {"num_tensors": NUM_TENSORS, "rows": json.loads(out.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--json", action="store_true", help="print rows as JSON (used by run())")
    args = parser.parse_args()
    rows = measure(tuple(int(s) for s in args.sizes.split(",")), args.repeats)
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"{r['bytes'] / 2**20:7.0f} MiB: swap {r['swap_seconds'] * 1e6:7.1f} us, "
              f"inline free {r['inline_free_seconds'] * 1e3:8.2f} ms, "
              f"background free {r['background_free_seconds'] * 1e3:8.2f} ms, "
              f"RSS returned {r['rss_returned_bytes'] / 2**20:7.1f} MiB")


if __name__ == "__main__":
    main()
