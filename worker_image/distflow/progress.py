"""Rank 0's report of training progress: a bar on a terminal, one line per step elsewhere.

Both printers are called as ``printer(step, metrics)``: once with the step
training starts from (a resumed run's checkpoint step, else 0) and the
held-out score of the policy before training if there is one (``{}``
otherwise), then after every step with that step's metrics (reduced over all
ranks). Where stdout is not a terminal (``distflow run > run.log``, nohup,
CI, a pod's log) a bar renders nothing until the run ends, so lines are
printed instead, in verl's console format (``step:3 - critic/score/mean:0.500 - ...``).
"""

from __future__ import annotations

import sys
from typing import TextIO

STEP_TIME = "timing_s/step"
"""In every trained step's metrics; the start call's (at most a held-out score) lack it."""
HEADLINE_METRICS = (("critic/score/mean", "{:.3f}"), ("perf/throughput", "{:.1f}"),
                    (STEP_TIME, "{:.2f}"), ("eval/score", "{:.3f}"))
"""What each step's line shows, in order: mean reward, tokens/s, step time (seconds), held-out score."""


def progress_printer(total_steps: int, stream: TextIO | None = None):
    """A :class:`ProgressPrinter` when ``stream`` (default stdout) is a terminal, else a :class:`StepLinePrinter`."""
    stream = stream if stream is not None else sys.stdout
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return ProgressPrinter(total_steps)
    return StepLinePrinter(total_steps, stream)


class StepLinePrinter:
    """One flushed line per step: ``step:3/30 - critic/score/mean:0.500 - perf/throughput:114.0 - ...``.

    The start call prints where training starts from; metrics a step lacks (no
    eval this step) are left out of its line.
    """

    def __init__(self, total_steps: int, stream: TextIO | None = None):
        self.total_steps = total_steps
        self.stream = stream

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        head = [f"step:{step}/{self.total_steps}"] + ([] if STEP_TIME in metrics else ["training starts"])
        line = " - ".join(head + [f"{name}:{fmt.format(metrics[name])}"
                                  for name, fmt in HEADLINE_METRICS if name in metrics])
        print(line, file=self.stream if self.stream is not None else sys.stdout, flush=True)

    def close(self) -> None:
        """Nothing to stop: every line is already flushed."""


class ProgressPrinter:
    """Rank 0's rich progress bar: "step 12/30", the bar, elapsed time and the headline metrics.

    The bar appears on the start call, so a resumed run starts at its
    checkpoint step rather than at 0.
    """

    def __init__(self, total_steps: int, console=None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.total_steps = total_steps
        self.bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[info]}"), console=console)
        self.task = None

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if self.task is None:  # the start call: at most the held-out score before training
            info = f"eval {metrics['eval/score']:.3f}" if "eval/score" in metrics else ""
            self.task = self.bar.add_task("train", total=self.total_steps, completed=step, info=info)
            self.bar.start()
        else:
            info = _progress_info(metrics) if metrics else ""
            self.bar.update(self.task, completed=step, info=info)
        if step >= self.total_steps:
            self.bar.stop()

    def close(self) -> None:
        """Stop the bar (a run that ends early: a failure, or Ray's last update not yet shown)."""
        if self.task is not None:
            self.bar.stop()


def _progress_info(metrics: dict[str, float]) -> str:
    """The bar's headline: mean reward, tokens/s, step time (seconds) and the eval score if any."""
    info = (f"reward {metrics.get('critic/score/mean', float('nan')):.3f}  "
            f"tok/s {metrics.get('perf/throughput', 0):.0f}  "
            f"step {metrics.get('timing_s/step', 0):.1f}s")
    if "eval/score" in metrics:
        info += f"  eval {metrics['eval/score']:.3f}"
    return info
