"""Rank 0's progress bar starts at the step training starts from: a resumed run's checkpoint step, not 0."""

import contextlib
import io

import pytest
from rich.console import Console

from distflow import entry, worker as worker_module
from distflow.progress import ProgressPrinter
from distflow.spec import parse_spec
from distflow.worker import DagWorker, WorkerEnv

pytestmark = pytest.mark.unit


def _rendered(printer: ProgressPrinter) -> str:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(printer.bar.get_renderable())
    return console.file.getvalue()


def test_printer_of_a_resumed_run_starts_at_the_checkpoint_step():
    printer = ProgressPrinter(30, console=Console(file=io.StringIO(), color_system=None))
    printer(12, {})
    assert printer.bar.tasks[0].completed == 12
    assert "step 12/30" in _rendered(printer)
    printer(13, {"critic/score/mean": 0.5, "perf/throughput": 812.4, "timing_s/step": 2.25})
    assert printer.bar.tasks[0].completed == 13
    assert "step 13/30" in _rendered(printer)
    assert "reward 0.500  tok/s 812  step 2.2s" in _rendered(printer)
    assert printer.bar.live.is_started
    printer(30, {"critic/score/mean": 0.75, "eval/score": 0.625})
    assert "step 30/30" in _rendered(printer) and "eval 0.625" in _rendered(printer)
    assert not printer.bar.live.is_started


def test_the_start_shows_the_held_out_score_before_training():
    """What the policy scored before any step (the quickstart: 0.044, then 0.259 after 30 steps)."""
    from distflow.progress import progress_printer

    log = io.StringIO()
    printer = progress_printer(30, log)
    printer(0, {"eval/score": 0.04375, "eval/response_length": 41.0})
    printer(1, {"critic/score/mean": 0.5, "perf/throughput": 812.44, "timing_s/step": 2.251})
    assert log.getvalue().splitlines() == [
        "step:0/30 - training starts - eval/score:0.044",
        "step:1/30 - critic/score/mean:0.500 - perf/throughput:812.4 - timing_s/step:2.25",
    ]
    bar = ProgressPrinter(30, console=Console(file=io.StringIO(), color_system=None))
    bar(0, {"eval/score": 0.04375})
    assert "0/30" in _rendered(bar) and "eval 0.044" in _rendered(bar) and "reward" not in _rendered(bar)
    bar.close()


def _stand_in_worker(tmp_path, total_steps: int, data: dict | None = None) -> DagWorker:
    """A DagWorker without models or a process group: train() with run_step() stubbed."""
    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, **(data or {})},
                       "trainer": {"totalSteps": total_steps, "logDir": str(tmp_path / "run")},
                       "checkpoint": {"dir": str(tmp_path / "run" / "checkpoints")}})
    worker = DagWorker.__new__(DagWorker)
    worker.spec = spec
    worker.env = WorkerEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1,
                           master_addr="127.0.0.1", master_port=0, job_name="job", model_dir="", device_index=0,
                           resume=True)
    worker.step, worker.exporter, worker.writer, worker.is_logger = 0, None, None, False
    worker.run_step = lambda: {"training/step": worker.step + 1}
    worker.device_guard = contextlib.nullcontext()
    worker._log_trained_ids = lambda: None
    return worker


def test_train_reports_the_held_out_score_before_training_with_the_start_step(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_module.checkpoint, "load", lambda root, name, worker: 0)
    monkeypatch.setattr(worker_module.checkpoint, "save", lambda *args: None)
    worker = _stand_in_worker(tmp_path, total_steps=2, data={"eval": {"path": "arithmetic:eval", "size": 8}})
    scores = iter([0.125, 0.5])
    worker._eval_metrics = lambda: {"eval/score": next(scores)}
    logged, calls = [], []
    worker._log = logged.append
    worker.train(lambda step, metrics: calls.append((step, metrics)))
    assert calls == [(0, {"eval/score": 0.125}), (1, {"training/step": 1}),
                     (2, {"training/step": 2, "eval/score": 0.5})]
    assert logged[0] == {"training/step": 0, "eval/score": 0.125}


@pytest.mark.parametrize("checkpoint_step", [0, 12])
def test_train_reports_the_start_step_before_the_first_step(tmp_path, monkeypatch, checkpoint_step):
    monkeypatch.setattr(worker_module.checkpoint, "load", lambda root, name, worker: checkpoint_step)
    monkeypatch.setattr(worker_module.checkpoint, "save", lambda *args: None)
    calls = []
    _stand_in_worker(tmp_path, total_steps=14).train(lambda step, metrics: calls.append((step, metrics)))
    assert calls[0] == (checkpoint_step, {})
    assert [step for step, _ in calls[1:]] == list(range(checkpoint_step + 1, 15))
    assert calls[-1] == (14, {"training/step": 14})


def test_printer_of_a_run_resumed_at_its_last_step_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_module.checkpoint, "load", lambda root, name, worker: 14)
    printer = ProgressPrinter(14, console=Console(file=io.StringIO(), color_system=None))
    assert _stand_in_worker(tmp_path, total_steps=14).train(printer) == []
    assert printer.bar.tasks[0].completed == 14 and not printer.bar.live.is_started


def test_without_a_terminal_each_step_prints_one_line_in_verls_format():
    from distflow.progress import StepLinePrinter, progress_printer

    log = io.StringIO()  # what `distflow run ... > run.log` gives rank 0: no terminal
    printer = progress_printer(30, log)
    assert isinstance(printer, StepLinePrinter)
    printer(12, {})
    printer(13, {"critic/score/mean": 0.5, "perf/throughput": 812.44, "timing_s/step": 2.251, "actor/lr": 1e-6})
    printer(14, {"critic/score/mean": 0.75, "perf/throughput": 790.0, "timing_s/step": 2.0, "eval/score": 0.625})
    assert log.getvalue().splitlines() == [
        "step:12/30 - training starts",
        "step:13/30 - critic/score/mean:0.500 - perf/throughput:812.4 - timing_s/step:2.25",
        "step:14/30 - critic/score/mean:0.750 - perf/throughput:790.0 - timing_s/step:2.00 - eval/score:0.625",
    ]


def test_each_pods_first_worker_prints_step_lines(monkeypatch, capsys):
    """`distflow node` (the env launcher): `kubectl logs` of any node pod shows the run's progress."""
    from distflow import launcher

    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}},
                       "trainer": {"totalSteps": 5}, "cluster": {"numNodes": 2, "procsPerNode": 2}})
    given = {}
    monkeypatch.setattr(entry, "run_worker", lambda spec, env, progress: given.update({env.rank: progress}))
    base = WorkerEnv(rank=2, world_size=4, local_rank=0, local_world_size=2, node_rank=1, num_nodes=2,
                     master_addr="node-0", master_port=29500, job_name="job", model_dir="", device_index=0)
    for local_rank in (0, 1):
        launcher._node_worker_main(local_rank, spec, base, 2, 0)
    assert given[3] is None  # one printer per pod
    given[2](1, {"critic/score/mean": 0.25, "perf/throughput": 100.0, "timing_s/step": 3.0})
    assert capsys.readouterr().out == "step:1/5 - critic/score/mean:0.250 - perf/throughput:100.0 - timing_s/step:3.00\n"


@pytest.mark.parametrize("terminal", [True, False])
def test_a_run_that_ends_early_closes_either_printer(terminal):
    """The Ray driver closes its printer when the workers stop, whatever it is."""
    from distflow.progress import StepLinePrinter, progress_printer

    class Stream(io.StringIO):
        def isatty(self):
            return terminal

    printer = progress_printer(30, Stream())
    assert isinstance(printer, ProgressPrinter if terminal else StepLinePrinter)
    printer(3, {})
    printer.close()
    if terminal:
        assert not printer.bar.live.is_started
