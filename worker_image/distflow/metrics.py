"""Step metrics: local sums reduced once per step, then JSONL and Prometheus.

Names follow verl (``timing_s/<stage>``, ``perf/throughput``,
``actor/pg_loss``, ``critic/score/mean``, ``response_length/mean``) plus the
data plane's (``data/bytes_sent/<edge>``, ``data/cache_hits``,
``data/balance_imbalance``).

Throughput keeps verl's definition: (prompt + response tokens of the step) /
(step time x number of accelerators, here workers).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist


class StepMetrics:
    """Accumulates one step's metrics on one rank; ``reduce`` makes them global.

    Every rank must add the same keys in any order (they run the same chain).
    """

    def __init__(self) -> None:
        self._means: dict[str, list[float]] = {}
        self._sums: dict[str, float] = {}
        self._maxes: dict[str, float] = {}
        self._timings: dict[str, float] = {}

    def add_mean(self, name: str, total, count) -> None:
        s = self._means.setdefault(name, [0.0, 0.0])
        s[0] += float(total)
        s[1] += float(count)

    def add_sum(self, name: str, value) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + float(value)

    def add_max(self, name: str, value) -> None:
        self._maxes[name] = max(self._maxes.get(name, -math.inf), float(value))

    def add_min(self, name: str, value) -> None:
        self.add_max(f"{name}\0neg", -float(value))

    @contextmanager
    def timer(self, stage: str):
        """Wall seconds of a stage on this rank; reduced as the max over ranks."""
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing_s/{stage}"
            self._timings[key] = self._timings.get(key, 0.0) + time.perf_counter() - start

    def reduce(self, device: torch.device, group=None) -> dict[str, float]:
        """Global metrics over ``group`` (default: the world): means weighted by counts, sums
        summed, max/min/timings extremal."""
        mean_keys, sum_keys = sorted(self._means), sorted(self._sums)
        max_keys = sorted(self._maxes) + sorted(self._timings)
        sums = torch.tensor([v for k in mean_keys for v in self._means[k]] +
                            [self._sums[k] for k in sum_keys], dtype=torch.float64)
        maxes = torch.tensor([self._maxes[k] for k in sorted(self._maxes)] +
                             [self._timings[k] for k in sorted(self._timings)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            sums, maxes = sums.to(device), maxes.to(device)
            dist.all_reduce(sums, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
            sums, maxes = sums.cpu(), maxes.cpu()
        out: dict[str, float] = {}
        for i, k in enumerate(mean_keys):
            total, count = float(sums[2 * i]), float(sums[2 * i + 1])
            out[k] = total / count if count else 0.0
        for j, k in enumerate(sum_keys):
            out[k] = float(sums[2 * len(mean_keys) + j])
        for j, k in enumerate(max_keys):
            if k.endswith("\0neg"):
                out[k.removesuffix("\0neg")] = -float(maxes[j])
            else:
                out[k] = float(maxes[j])
        return out


class DeviceMetrics:
    """Per-micro-batch metrics kept as tensors on their device until ``flush``.

    ``float(v)`` on a CUDA tensor waits for the GPU to drain; a micro-batch loop
    that converts each statistic stalls the GPU several times per micro-batch.
    Here sums, weighted means and maxima accumulate on the device, and ``flush``
    moves them all to the host in one transfer.
    """

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], torch.Tensor] = {}

    def _add(self, kind: str, name: str, value: torch.Tensor, combine) -> None:
        key = (kind, name)
        value = value.detach().double()
        self._values[key] = value if key not in self._values else combine(self._values[key], value)

    def add_sum(self, name: str, value: torch.Tensor) -> None:
        self._add("sum", name, value, torch.add)

    def add_mean(self, name: str, total: torch.Tensor, count: torch.Tensor) -> None:
        self._add("total", name, total, torch.add)
        self._add("count", name, count, torch.add)

    def add_max(self, name: str, value: torch.Tensor) -> None:
        self._add("max", name, value, torch.maximum)

    def flush(self, metrics: StepMetrics, scale: float = 1.0) -> None:
        """Add everything to ``metrics`` (sums times ``scale``) with one device->host copy; empties."""
        if not self._values:
            return
        host = dict(zip(self._values, torch.stack(list(self._values.values())).tolist()))
        self._values.clear()
        for (kind, name), value in host.items():
            if kind == "sum":
                metrics.add_sum(name, value * scale)
            elif kind == "max":
                metrics.add_max(name, value)
            elif kind == "total":
                metrics.add_mean(name, value, host[("count", name)])


class JsonlWriter:
    """Appends one JSON object per step to ``<log_dir>/metrics.jsonl`` (rank 0 only)."""

    def __init__(self, log_dir: str | Path):
        self.path = Path(log_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def drop_after(self, step: int) -> int:
        """Resuming at ``step``: remove what a killed run logged for later steps, which are
        about to run again (``training/step`` in metrics.jsonl, ``step`` in eval_samples.jsonl).
        Each file is rewritten atomically. Returns the records removed."""
        removed = 0
        for path, key in ((self.path, "training/step"), (self.path.parent / "eval_samples.jsonl", "step")):
            if not path.is_file():
                continue
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if json.loads(line).get(key, 0) <= step]
            if len(kept) < len(lines):
                removed += len(lines) - len(kept)
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text("".join(line + "\n" for line in kept))
                tmp.replace(path)
        return removed

    def write_samples(self, step: int, records, responses, scores, limit: int = 8) -> None:
        """A few eval generations per evaluation, to read what the policy says."""
        with (self.path.parent / "eval_samples.jsonl").open("a") as f:
            for rec, text, score in list(zip(records, responses, scores))[:limit]:
                prompt = rec.messages[-1]["content"]
                f.write(json.dumps({"step": step, "prompt": prompt, "response": text,
                                    "ground_truth": rec.ground_truth, "score": score}) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
