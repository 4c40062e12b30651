"""A resumed worker builds its actor and critic from the checkpoint alone, not the pretrained weights.

Asserted:
- at the world size that wrote the checkpoint (2) and at another (3: uneven
  shards), a worker that resumes holds, after the load, the same actor, critic,
  Adam state and rollout copy, bit for bit, as one that first read the
  pretrained weights and then loaded the checkpoint over them (the path before
  this change); it read no row of the pretrained weights but the reference
  model's (which is not in the checkpoint), and both chose the same checkpoint;
- a checkpoint that lacks a parameter of the models it must fill, or holds one
  at another shape, is refused before anything is loaded, with a message that
  names the checkpoint and the parameter;
- end to end: with the model's weight file deleted after the first run (its
  config and tokenizer kept), a killed PPO run resumes and ends bit-identical
  to an uninterrupted one, and the checkpoint resumes on another world size.
"""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from _ckpt_worker import fake_worker, params
from _jobs import bit_identical, run_job, tiny_job_spec
from _model_reads import models_only_worker, recording_reads
from _spawn import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1800)]

MODEL = "tiny:byte"


def _ppo(root: str, world: int) -> dict:
    """PPO with an in-reward KL (so a reference model) and a rollout copy of the actor."""
    return {"model": {"path": MODEL}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 6},
            "workflow": {"name": "ppo"}, "algorithm": {"useKlInReward": True},
            "rollout": {"shareActorWeights": False}, "cluster": {"procsPerNode": world},
            "checkpoint": {"dir": root}}


def _bookkeeping(worker) -> None:
    """The loader position and origin record ``checkpoint.save`` and ``load`` need besides the models."""
    worker.loader = SimpleNamespace(state_dict=lambda: {"epoch": 0, "offset": 8}, load_state_dict=lambda state: None)
    worker.made_from = {"model.path": MODEL}


def _write_trained_checkpoint(rank, world, root, model_dir):
    """Build the models from the pretrained weights, move them away from them (negated, then
    one AdamW step, which also gives Adam state) and save the step-2 checkpoint."""
    from distflow import checkpoint

    torch.set_num_threads(1)
    worker = models_only_worker(_ppo(root, world), world, model_dir)
    worker._build_models()
    _bookkeeping(worker)
    for trained in (worker.actor, worker.critic):
        with torch.no_grad():
            for p in trained.model.parameters():
                p.neg_()
                p.grad = torch.full_like(p, 0.01)
        trained.optimizer.step()
    checkpoint.save(root, 2, worker, keep_last=1)


def _same_local(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(getattr(p, "to_local", lambda: p)(), getattr(q, "to_local", lambda: q)())
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _same_adam(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    pairs = zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True)
    return all(a.state[p].keys() == b.state[q].keys() and all(
        torch.equal(getattr(v, "to_local", lambda: v)(), getattr(b.state[q][k], "to_local", lambda: b.state[q][k])())
        for k, v in a.state[p].items()) for p, q in pairs)


def _resume_both_ways(rank, world, root, model_dir):
    """(before-change path: pretrained weights, then the checkpoint) vs (this worker's own decision)."""
    from distflow import checkpoint

    torch.set_num_threads(1)
    spec = _ppo(root, world)
    today = models_only_worker(spec, world, model_dir)
    today._build_models()  # resume_from None: filled from the pretrained weights
    _bookkeeping(today)
    today_step = checkpoint.load(root, checkpoint.choose(root), today)

    resumed = models_only_worker(spec, world, model_dir)
    resumed.resume_from = resumed._choose_resume()
    with recording_reads() as reads:
        resumed._build_models()
    _bookkeeping(resumed)
    step = checkpoint.load(root, resumed.resume_from, resumed)
    return {"steps": (today_step, step), "resume_from": resumed.resume_from, "reads": reads,
            "actor": _same_local(today.actor_model, resumed.actor_model),
            "critic": _same_local(today.critic.model, resumed.critic.model),
            "adam": _same_adam(today.actor.optimizer, resumed.actor.optimizer)
            and _same_adam(today.critic.optimizer, resumed.critic.optimizer),
            "rollout_copy": _same_local(today.rollout.weights.copy, resumed.rollout.weights.copy),
            "reference": _same_local(today.ref_model, resumed.ref_model),
            "actor_is_pretrained": _same_local(resumed.actor_model, resumed.ref_model)}


def test_a_resumed_worker_fills_actor_and_critic_from_the_checkpoint_alone(tmp_path):
    from distflow.models import model_cache_dir, resolve_model

    model_dir = str(resolve_model(MODEL, model_cache_dir()))  # built once, before the ranks race for it
    root = str(tmp_path / "ckpt")
    run_on_ranks(_write_trained_checkpoint, 2, root, model_dir, timeout_s=600)
    for world in (2, 3):
        results = run_on_ranks(_resume_both_ways, world, root, model_dir, timeout_s=600)
        for result in results:
            assert result["steps"] == (2, 2) and result["resume_from"] == "step_00000002", world
            assert (result["actor"], result["critic"], result["adam"], result["rollout_copy"],
                    result["reference"]) == (True,) * 5, (world, result)
            assert result["actor_is_pretrained"] is False  # the checkpoint's weights, not the files'
            assert not [r for r in result["reads"] if r[0] == "from_pretrained"]
        rows: dict[str, list[int]] = {}
        for result in results:
            for name, start, stop, total in result["reads"]:
                rows.setdefault(name, [0, total])[0] += stop - start
        # the reference model alone read the files: each parameter's rows once over the ranks
        assert rows and all(read == total for read, total in rows.values()), (world, rows)


def _refusals(rank, world, root):
    """Save a [32, 32] Linear; load it into a [48, 48] one, and into a worker that also trains a critic."""
    from distflow import checkpoint

    checkpoint.save(root, 1, fake_worker(32, seed=1), keep_last=1)
    wider = fake_worker(48, seed=2)
    with_critic = fake_worker(32, seed=3)
    with_critic.critic = fake_worker(32, seed=4).actor
    messages, untouched = [], []
    for worker in (wider, with_critic):
        before = params(worker)
        with pytest.raises(checkpoint.UnusableCheckpointError) as err:
            checkpoint.load_latest(root, worker)
        messages.append(str(err.value))
        untouched.append(all(torch.equal(before[k], v) for k, v in params(worker).items()))
    return messages, untouched


def test_a_checkpoint_that_cannot_fill_every_parameter_is_refused_naming_it(tmp_path):
    root = tmp_path / "ckpt"
    for messages, untouched in run_on_ranks(_refusals, 2, str(root), timeout_s=600):
        wider, with_critic = messages
        where = f"checkpoint {root / 'step_00000001'} cannot resume this run"
        assert where in wider and where in with_critic
        assert "model.weight is (32, 32) in it, (48, 48) in this run" in wider
        assert "model.bias is (32,) in it, (48,) in this run" in wider
        assert "it lacks critic.weight" in with_critic and "it lacks critic.bias" in with_critic
        assert "--no-resume" in wider
        assert untouched == [True, True]


STEPS = {"totalSteps": 3}


def _job(tmp_path, name, model_dir, nodes, procs):
    """PPO without any KL (so no reference model: nothing of the run needs the weight file once resumed)."""
    return tiny_job_spec(tmp_path, name, model={"path": model_dir}, workflow={"name": "ppo"},
                         algorithm={"useKlLoss": False, "useKlInReward": False}, trainer=STEPS,
                         cluster={"numNodes": nodes, "procsPerNode": procs},
                         checkpoint={"saveEverySteps": 1, "keepLast": 4})


def test_a_resumed_run_needs_no_pretrained_weight_file(tmp_path, capfd):
    from distflow.models import model_cache_dir, resolve_model

    model_dir = tmp_path / "model"
    shutil.copytree(resolve_model("tiny", model_cache_dir()), model_dir)
    straight = _job(tmp_path, "straight", str(model_dir), 1, 2)
    straight_state, _ = run_job(straight)
    killed = _job(tmp_path, "killed", str(model_dir), 1, 2)
    os.environ["DISTFLOW_INJECT_FAILURE_AT_STEP"] = "3"  # dies in step 3, after the step-2 checkpoint
    try:
        with pytest.raises(Exception, match="injected failure"):
            run_job(killed)
    finally:
        del os.environ["DISTFLOW_INJECT_FAILURE_AT_STEP"]
    (model_dir / "model.safetensors").unlink()  # config, generation config and tokenizer stay

    capfd.readouterr()
    killed_state, killed_log = run_job(killed)
    assert "resumed from the step-2 checkpoint" in capfd.readouterr().out
    assert [r["training/step"] for r in killed_log] == [1, 2, 3]  # 1, 2 logged before it was killed
    assert bit_identical(straight_state, killed_state)

    resized = _job(tmp_path, "resized", str(model_dir), 1, 1)
    source = tmp_path / "straight" / "ckpt" / "step_00000002"
    shutil.copytree(source, os.path.join(resized.checkpoint.dir, source.name))
    resized_state, resized_log = run_job(resized)
    assert "written by 2 workers and is resharded onto 1" in capfd.readouterr().out
    assert [r["training/step"] for r in resized_log] == [3]
    # One step on 1 worker from the same weights and samples as the 2-worker run's step 3: the
    # two differ by float32 reduction order only (see test_elastic_resume's TOLERANCE).
    diff = max((resized_state["model"][k] - straight_state["model"][k]).abs().max().item()
               for k in straight_state["model"])
    assert diff <= 1e-5
