"""What ``distflow run`` says and does on this machine before any worker starts.

A run whose newest checkpoint (its checksums verified) already reached ``trainer.totalSteps``
starts no worker: it says so and how to train on. Any other run announces its workers first, so a
newcomer is not left in silence while they import torch and load the model.
"""

from __future__ import annotations

import pytest

from distflow import launcher
from distflow.spec import parse_spec
from tests.unit.test_checkpoint_manifest import _write_checkpoint

pytestmark = pytest.mark.unit


class Spawned(Exception):
    pass


def _spec(tmp_path, total_steps=3):
    return parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}},
                       "cluster": {"numNodes": 2},
                       "trainer": {"totalSteps": total_steps, "logDir": str(tmp_path / "run")},
                       "checkpoint": {"dir": str(tmp_path / "run" / "checkpoints")}})


@pytest.fixture
def no_workers(monkeypatch, tmp_path):
    """launch_local up to the spawn, which raises Spawned: no model, no processes."""
    monkeypatch.setattr(launcher, "resolve_model_dir", lambda spec: str(tmp_path / "model"))
    monkeypatch.setattr(launcher, "check_against_model", lambda spec, model_dir: None)
    monkeypatch.setattr(launcher, "check_resume", lambda spec, model_dir: None)

    def spawn(main, args, num_workers):
        raise Spawned(num_workers)

    monkeypatch.setattr(launcher, "spawn_workers", spawn)


def test_a_finished_run_starts_no_worker_and_says_how_to_train_on(no_workers, tmp_path, capsys):
    spec = _spec(tmp_path, total_steps=3)
    _write_checkpoint(tmp_path / "run" / "checkpoints", 2)
    _write_checkpoint(tmp_path / "run" / "checkpoints", 3)
    launcher.launch_local(spec, "job", progress=False)
    out = capsys.readouterr().out
    assert out == (f"distflow: nothing to train: the step-3 checkpoint in {tmp_path}/run/checkpoints is at "
                   "trainer.totalSteps (3); raise trainer.totalSteps above 3 to train on, or --no-resume to start "
                   "over\n")


def test_a_finished_run_on_ray_reserves_nothing_and_says_how_to_train_on(tmp_path, capsys):
    """The Ray launcher makes the same check before it reaches for the cluster: no actor starts
    (here no cluster at all is reached)."""
    pytest.importorskip("ray")
    from distflow import ray_launcher

    _write_checkpoint(tmp_path / "run" / "checkpoints", 3)
    ray_launcher.launch_ray(_spec(tmp_path, total_steps=3), "job", "127.0.0.1:9", progress=False)
    assert capsys.readouterr().out == (
        f"distflow: nothing to train: the step-3 checkpoint in {tmp_path}/run/checkpoints is at trainer.totalSteps "
        "(3); raise trainer.totalSteps above 3 to train on, or --no-resume to start over\n")


def test_a_checkpoint_past_total_steps_says_past_and_how_far_to_raise_it(no_workers, tmp_path, capsys):
    _write_checkpoint(tmp_path / "run" / "checkpoints", 5)
    launcher.launch_local(_spec(tmp_path, total_steps=3), "job", progress=False)
    assert "the step-5 checkpoint in" in (out := capsys.readouterr().out)
    assert "is past trainer.totalSteps (3); raise trainer.totalSteps above 5 to train on" in out


def test_a_run_without_a_checkpoint_dir_starts_over_and_sets_the_previous_logs_aside(no_workers, tmp_path, capsys):
    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}},
                       "trainer": {"logDir": str(tmp_path / "run")}, "checkpoint": {"dir": None}})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"training/step": 0, "eval/score": 0.5}\n')
    with pytest.raises(Spawned):
        launcher.launch_local(spec, "job", progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # this run's summary cannot mix in the old one
    assert (tmp_path / "run" / "metrics.jsonl.previous").is_file()
    assert "starting over (no checkpoint.dir to resume from)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, resume", [([], True), (["--no-resume"], False), (["--resume"], True)])
def test_resume_continues_even_where_the_config_says_never(monkeypatch, tmp_path, flags, resume):
    """``--resume`` continues even where the config says ``checkpoint.resume: never``."""
    from distflow import cli

    seen = []
    monkeypatch.setattr(launcher, "launch_local", lambda spec, name, resume: seen.append((resume, spec)))
    config = tmp_path / "job.yaml"
    config.write_text("model: {path: tiny}\ndata: {train: {path: arithmetic}}\ncheckpoint: {resume: never}\n"
                      f"trainer: {{logDir: {tmp_path}/run}}\n")
    assert cli.main(["run", str(config), *flags]) == 0
    (got_resume, spec), = seen
    assert got_resume is resume
    assert spec.checkpoint.resume == ("auto" if "--resume" in flags else "never")


def test_resume_and_no_resume_together_are_refused(tmp_path, capsys):
    from distflow import cli

    with pytest.raises(SystemExit) as err:
        cli.main(["run", str(tmp_path / "job.yaml"), "--resume", "--no-resume"])
    assert err.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("newest, corrupt, total_steps", [
    (2, False, 3),  # steps left
    (3, True, 3),  # the last checkpoint is corrupt: the workers fall back to step 2 and train step 3 again
    (3, False, 5),  # totalSteps raised after the run ended
])
def test_a_run_with_steps_left_announces_its_workers_and_starts_them(no_workers, tmp_path, capsys,
                                                                    newest, corrupt, total_steps):
    root = tmp_path / "run" / "checkpoints"
    for step in range(1, newest + 1):
        d = _write_checkpoint(root, step)
    if corrupt:
        data = bytearray((d / "__0_0.distcp").read_bytes())
        data[7] ^= 1
        (d / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(Spawned, match="2"):
        launcher.launch_local(_spec(tmp_path, total_steps), "job", progress=False)
    assert capsys.readouterr().out == (
        "distflow: starting 2 workers on this machine (2 nodes x 1, cpu); each imports torch and loads the "
        "model before the first step\n")


def test_no_resume_starts_over_even_from_a_finished_run(no_workers, tmp_path, capsys):
    _write_checkpoint(tmp_path / "run" / "checkpoints", 3)
    with pytest.raises(Spawned):
        launcher.launch_local(_spec(tmp_path, 3), "job", resume=False, progress=False)
    assert "starting 2 workers" in capsys.readouterr().out
    assert (tmp_path / "run" / "checkpoints.previous" / "step_00000003").is_dir()


def test_a_model_prepared_once_is_announced_the_first_time_only(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DISTFLOW_CACHE", str(tmp_path / "cache"))
    spec = _spec(tmp_path)  # model.path: tiny (built into the cache)
    first = launcher.resolve_model_dir(spec)
    assert capsys.readouterr().out == (f"distflow: preparing model.path 'tiny' once (converted or built into "
                                       f"{tmp_path}/cache; later runs reuse it)\n")
    assert launcher.resolve_model_dir(spec) == first
    assert capsys.readouterr().out == ""


def test_progress_bars_are_off_where_stderr_is_not_a_terminal(tmp_path):
    """The model conversion's tqdm bars, redrawn with carriage returns, are noise in a log file or
    `kubectl logs`; the CLI turns tqdm off before anything imports it."""
    import subprocess
    import sys

    code = ("import sys; from distflow import cli; cli.main(['plan', sys.argv[1]]); "
            "from tqdm import tqdm; print('disabled' if tqdm(range(2)).disable else 'enabled')")
    config = tmp_path / "job.yaml"
    config.write_text("model: {path: tiny}\ndata: {train: {path: arithmetic}}\n")
    out = subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "disabled", out.stdout + out.stderr
