"""The DAG worker of asynchronous training: a rollout pool and a trainer pool, overlapped.

    iteration i (every rank runs the same schedule; s = async.maxStaleness)
      rollout pool:  rollout part of the chain for step i      trainer pool:  trainer part for step i - s
                     (weights of version max(0, i - s))                       (its samples arrived at iteration i - s)
      ---------------------------- cross-pool edge: step i's samples, rollout rank -> trainer rank (all_to_all) ---
      (s = 0: the trainer pool trains step i here, on samples of its own current version)
      ---------------------------- weight sync: version (steps trained) -> every rollout replica --------------
      ---------------------------- the step's metrics to every rank (each pod prints its line) ---------------

The rollout pool generates steps k+1 .. k+s while the trainer pool trains step
k; every sample carries ``policy_version``, and the trainer checks that none
lags its own version by more than ``maxStaleness`` (the lockstep schedule
above guarantees it: the rollout waits at the cross-pool edge instead). There
is no driver: each rank derives the schedule from the step counter, as it
derives the plan from the spec. Collectives inside a pool's part of the chain
run over that pool's group (``process_group.set_pool_group``); the cross-pool
edge, the weight sync and the metrics broadcast are the only ones both pools join.

Checkpoints are taken at trainer step boundaries and hold what the trainer
pool trained; the s steps in flight (generated, not yet trained) are dropped
and counted (``async/dropped_in_flight_samples``), and a resumed run
regenerates them from the checkpoint's weights: no sample is trained twice,
none is lost. With ``maxStaleness: 0`` the schedule is the sync one, step for
step, and training is bit-identical to sync mode on as many trainer ranks.

The rollout pool can change size without a checkpoint: at a step boundary
(after the checkpoint) ``distflow.pools.elastic`` lets rollout workers leave or
join and re-forms the world around the running processes; the schedule goes on
at the next iteration, the steps in flight kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from distflow import chaos, checkpoint, process_group, sample_ids
from distflow.data.batch import PackedBatch
from distflow.engines import flex_masks, fsdp
from distflow.engines.actor import Actor
from distflow.engines.loading import empty_causal_lm, load_sharded_causal_lm, rollout_replica
from distflow.engines.rollout import HfRollout
from distflow.metrics import StepMetrics
from distflow.models import DTYPES, load_tokenizer
from distflow.planner import ROLLOUT, TRAIN
from distflow.pools.elastic import RolloutPoolResize
from distflow.pools.weight_sync import WeightSync
from distflow.stages import STAGES, StageModels
from distflow.spec import JobSpec
from distflow.worker import DagWorker, WorkerEnv, _seed_everything

log = logging.getLogger(__name__)


def split_chain(chain):
    """(rollout part, trainer part) of a pooled plan's chain (``planner`` checked the order)."""
    first = next(i for i, n in enumerate(chain) if n.placement == TRAIN)
    return tuple(chain[:first]), tuple(chain[first:])


def _empty_batch(schema, device: torch.device) -> PackedBatch:
    """A batch of no samples with ``schema`` (``PackedBatch.field_schema``): a trainer rank's side
    of the cross-pool edge, whose all-gathered schema digests must agree with the senders'."""
    token = {f.name: torch.empty((0, *f.trailing_shape), dtype=f.dtype, device=device)
             for f in schema if f.kind == "token"}
    sample = {f.name: torch.empty((0, *f.trailing_shape), dtype=f.dtype, device=device)
              for f in schema if f.kind == "sample"}
    return PackedBatch(torch.zeros(0, dtype=torch.long), token, sample)


class PoolWorker(DagWorker):
    """One worker of a pooled (``async.enable``) job: of the trainer pool (ranks ``0 .. T-1``) or
    of the rollout pool (ranks ``T .. W-1``), as the plan's layouts say."""

    def __init__(self, spec: JobSpec, env: WorkerEnv) -> None:
        super().__init__(spec, env)
        self.elastic = RolloutPoolResize.for_worker(self) if env.resize_file else None
        """The in-place resize of the rollout pool, polled at each step boundary (pods only)."""

    # ---- construction ----------------------------------------------------------------------

    def _take_layouts(self) -> None:
        self.train_layout, self.rollout_layout = self.plan.layouts[TRAIN], self.plan.layouts[ROLLOUT]
        self.trains = self.train_layout.holds(self.env.rank)

    def _init_world(self) -> None:
        if not self.env.join:
            super()._init_world()

    def _build_groups(self) -> None:
        """The layouts of the plan, and every process group of a pooled job: the trainer pool's FSDP
        mesh (``self.mesh``), each pool's group, the weight sync's. Collective over the world, and run
        again in each new world of an in-place resize of the rollout pool (``distflow.pools.elastic``)."""
        spec, env = self.spec, self.env
        self._take_layouts()
        trainers = list(range(self.train_layout.num_ranks))
        rollouts = list(range(self.rollout_layout.first_rank, env.world_size))
        # Every rank creates every group, in the same order (new_group is collective over the world).
        self.mesh = fsdp.pool_mesh(self.device, len(trainers), spec.cluster.data_parallel_replicate_degree or 1)
        train_group = process_group.new_group(trainers)  # the whole pool (HSDP's mesh: one group per dimension)
        rollout_group = process_group.new_group(rollouts)
        self.train_group = train_group if self.trains else None
        sync_group = process_group.new_group([0] + rollouts)
        self.pool_group = self.train_group if self.trains else rollout_group
        process_group.set_pool_group(self.pool_group)
        self.weight_sync = WeightSync(sync_group, 0, DTYPES[spec.model.compute_dtype],
                                      spec.rollout.weight_sync_bucket_mb << 20, self.device)

    def _build_models(self) -> None:
        spec, env, plan = self.spec, self.env, self.plan
        if env.join:  # its world does not exist yet: the groups (and the mesh) are built when it joins
            self._take_layouts()
            self.mesh = None
        else:
            self._build_groups()
        trainers, mesh = list(range(self.train_layout.num_ranks)), self.mesh
        compute = DTYPES[spec.model.compute_dtype]
        self.rollout_chain, self.train_chain = split_chain(plan.chain)
        _seed_everything(spec.trainer.seed)
        self.tokenizer = load_tokenizer(env.model_dir)
        self.actor_model = self.actor = self.ref_model = self.critic = self.replica = None
        self.kl_ctrl = None
        if self.trains:
            self.actor_model = load_sharded_causal_lm(env.model_dir, mesh, self.device, torch.float32, compute,
                                                      spec.model.gradient_checkpointing,
                                                      spec.actor.reshard_after_forward,
                                                      fill=self.resume_from is None)
            self.actor = Actor.build(spec, self.actor_model, self.tokenizer.pad_token_id, len(trainers), self.device)
            if any(n.role == "reference" for n in plan.chain):
                self.ref_model = load_sharded_causal_lm(env.model_dir, mesh, self.device,
                                                        DTYPES[spec.model.dtype], compute).eval()
                self.ref_model.requires_grad_(False)
            # The trainer pool evaluates with its own weights (version = steps trained, no lag).
            self.rollout = HfRollout(fsdp.RolloutWeights(self.actor_model), self.tokenizer, self.device)
        elif spec.rollout.engine == "vllm":
            # The engine's weights are the replica (in its own process); the sync needs only the
            # parameters' names and shapes, from a model on the meta device.
            from distflow.engines.vllm_rollout import VllmRollout, vllm_config

            self.replica = empty_causal_lm(env.model_dir, compute)
            self.rollout = VllmRollout.build_isolated(vllm_config(spec, env.model_dir, self.device), self.tokenizer)
        else:
            # Filled by the first weight sync: the trainer's version, not a second read of the files.
            self.replica = rollout_replica(env.model_dir, self.device, compute)
            self.rollout = HfRollout(fsdp.RolloutWeights(None, self.replica), self.tokenizer, self.device)
        self._build_critic(mesh)
        self._size_rollout_micro_batches()
        self.models = StageModels(rollout=self.rollout, actor=self.actor, policy=self.actor_model,
                                  reference=self.ref_model, critic=self.critic)
        self.version = 0
        """Optimizer steps of the weights this rank generates with (rollout) or trains (trainer)."""

    def _build_data(self) -> None:
        # Trainer ranks read the stream too (a rollout rank's share, in step with what they train):
        # the checkpoint's loader state and the trained record ids come from them.
        self.rollout_dp_rank = self.rollout_layout.dp_rank(self.rank) if not self.trains else 0
        self._load_train(self.rollout_layout.dp_size, self.rollout_dp_rank)
        self._load_eval(self.train_layout.num_ranks, self.rank if self.trains else None)

    # ---- one iteration ---------------------------------------------------------------------

    def _context(self, step: int):
        """The stages' context for ``step`` (``self.metrics`` is its sink); rollout ranks stamp
        their weights' version on the samples."""
        return replace(self._stage_context(), step=step, policy_version=None if self.trains else self.version)

    def _generate(self, step: int) -> tuple[PackedBatch, dict]:
        """Rollout ranks: the rollout part of the chain for ``step``; (batch, its reduced metrics)."""
        self.coordinator.next_step(step)
        metrics = StepMetrics()
        self.metrics = metrics
        ctx = self._context(step)
        start = time.perf_counter()
        for node in self.rollout_chain:
            with metrics.timer(node.id):
                self.coordinator.ensure(node)
                batch = self.coordinator.batch if self.coordinator.producer else None
                self._hand_on(node, batch, STAGES[node.role](ctx, node, batch))
        metrics.add_max("timing_s/generate", time.perf_counter() - start)
        versions = self.coordinator.batch.sample_fields["policy_version"].double()
        metrics.add_min("async/policy_version_min", versions.min() if versions.numel() else float(self.version))
        return self.coordinator.batch, metrics.reduce(self.device, self.pool_group)

    def _cross_pool(self, step: int, batch: PackedBatch | None, schema) -> PackedBatch:
        """Both pools: ``step``'s samples from the rollout ranks to the trainer ranks (collective)."""
        coordinator = self.coordinator
        if self.trains:
            coordinator.next_step(step)
            coordinator.produce(self.rollout_chain[-1].id, _empty_batch(schema, self.device))
        coordinator.ensure(self.train_chain[0])
        return coordinator.batch

    def _train(self, step: int, batch: PackedBatch) -> dict[str, float]:
        """Trainer ranks: the trainer part of the chain on ``step``'s samples; reduced metrics."""
        flex_masks.forget_block_masks()
        coordinator = self.coordinator
        coordinator.next_step(step)
        coordinator.buffer.put("batch", batch)
        coordinator.placement, coordinator.producer = TRAIN, self.rollout_chain[-1].id
        metrics = StepMetrics()
        self.metrics = metrics
        ctx = self._context(step)
        self.loader.next_batch()  # in step with the rollout pool's stream (checkpoint state, trained ids)
        versions = batch.sample_fields["policy_version"]
        lag = self.version - versions if versions.numel() else versions
        if lag.numel() and int(lag.max()) > self.plan.staleness:
            raise RuntimeError(f"step {step + 1}: a sample of policy version {int(versions.min())} reached the "
                               f"trainer at version {self.version}, beyond async.maxStaleness="
                               f"{self.plan.staleness}; the pools' schedules disagree")
        start = time.perf_counter()
        for node in self.train_chain:
            with metrics.timer(node.id):
                self.coordinator.ensure(node)
                self._hand_on(node, self.coordinator.batch, STAGES[node.role](ctx, node, self.coordinator.batch))
        metrics.add_max("timing_s/train", time.perf_counter() - start)
        lag = lag.double()
        metrics.add_max("async/staleness_max", lag.max() if lag.numel() else 0.0)
        metrics.add_mean("async/staleness_mean", lag.sum(), lag.numel())
        metrics.add_sum("perf/total_num_tokens", float(coordinator.batch.num_tokens))
        self._log_pooled_ids(step, versions)
        return metrics.reduce(self.device, self.pool_group)

    def _log_pooled_ids(self, step: int, versions: torch.Tensor) -> None:
        """``trained_ids.jsonl``: the step's record ids and each sample's policy version."""
        groups = self.coordinator.batch.sample_fields["group_index"].tolist()
        ids = sample_ids.record_ids(groups, step, self.spec.data.train_batch_size, self.spec.trainer.total_steps,
                                    self.loader.take_read_batches())
        pairs: list = [None] * dist.get_world_size(self.pool_group)
        dist.all_gather_object(pairs, list(zip(ids, versions.tolist())), group=self.pool_group)
        merged = sorted(p for part in pairs for p in part)
        if self.is_logger:
            sample_ids.append(self.spec.trainer.log_dir, step + 1, [i for i, _ in merged],
                              extra={"policy_versions": [v for _, v in merged], "trainer_version": self.version})

    def _sync_weights(self) -> int:
        """Both pools: the trainer's weights (``self.version``) into every rollout replica."""
        if self.trains:
            return self.weight_sync.send(self.actor_model, self.version)
        # vllm: each bucket on into the engine's own process (the replica only names the parameters)
        load = self.rollout.load_weight_buckets if self.spec.rollout.engine == "vllm" else None
        self.version = self.weight_sync.receive(self.replica, load)
        return 0

    # ---- the run ---------------------------------------------------------------------------

    def train(self, progress=None) -> list[dict[str, float]]:
        chaos.install(self)
        if self.elastic is not None and self.elastic.joining:
            # A rollout worker joining the pool: the world, the step and the policy come from the running ranks.
            start = self.elastic.join(self)  # the steps trained so far; the next iteration is start + s
            return self._iterations(start + self.plan.staleness, start, 0, progress)
        self._resume()
        start = self.step  # every rank's loader continues at the checkpoint's step (its state)
        dropped = self._dropped_in_flight(start)
        self.version = start
        self._sync_weights()
        self._report_start(progress, evaluate=self.trains and start == 0)
        return self._iterations(start, start, dropped, progress)

    def _iterations(self, first: int, start: int, dropped: int, progress) -> list[dict[str, float]]:
        """Iterations ``first ..`` of the schedule (see the module's diagram) in a run that started
        at step ``start``; ``dropped``: the samples in flight a resume dropped, reported once."""
        spec, history = self.spec, []
        total = spec.trainer.total_steps
        pending: dict[int, PackedBatch] = {}
        rollout_metrics: dict[int, dict] = {}
        s = self.plan.staleness
        for i in range(first, total + s):
            iteration_start = time.perf_counter()
            gen_step = i if i < total else None
            train_step = i - s if i - s >= start else None
            out = None
            with self.device_guard:
                generated, gen_metrics = (None, None)
                if not self.trains and gen_step is not None:
                    generated, gen_metrics = self._generate(gen_step)
                if self.trains and s > 0 and train_step is not None:
                    out = self._train(train_step, pending.pop(train_step))
                wait_start = time.perf_counter()
                if gen_step is not None:
                    header = [(generated.field_schema(), gen_metrics) if generated is not None else None]
                    dist.broadcast_object_list(header, src=self.rollout_layout.first_rank)
                    received = self._cross_pool(gen_step, generated, header[0][0])
                    if self.trains:
                        pending[gen_step] = received
                        rollout_metrics[gen_step] = header[0][1]
                if self.trains and s == 0 and train_step is not None:
                    out = self._train(train_step, pending.pop(train_step))
                trained = train_step is not None
                if trained:
                    self.version += 1 if self.trains else 0
                    sent = self._sync_weights()
                waited = time.perf_counter() - wait_start
            if not trained:
                continue
            out = self._step_record(out, rollout_metrics.pop(train_step, {}) if self.trains else {},
                                    time.perf_counter() - iteration_start, waited, sent)
            if dropped and out:
                out["async/dropped_in_flight_samples"], dropped = float(dropped), 0
            self.step = train_step + 1
            if self.trains and spec.data.eval is not None and (
                    self.step == total or (spec.trainer.eval_every_steps and
                                           self.step % spec.trainer.eval_every_steps == 0)):
                out.update(self._eval_metrics())
            record = [out]
            dist.broadcast_object_list(record, src=0)  # every pod's first worker prints the step
            out = record[0]
            self._log(out)
            self._export(out, {})
            history.append(out)
            if progress:
                progress(self.step, out)
            if self._step_boundary():  # the steps in flight are dropped, as on any resume
                break
            if self.elastic is not None and self.elastic.at_step_boundary(self):
                break  # this rank left the rollout pool
        chaos.write_tally()
        return history

    def in_flight_steps(self, step: int) -> int:
        """Steps the rollout pool has generated (or is generating) past trained step ``step``:
        ``maxStaleness`` of them, none past ``trainer.totalSteps``. Recorded in each checkpoint."""
        return max(0, min(self.plan.staleness, self.spec.trainer.total_steps - step))

    def _dropped_in_flight(self, start: int) -> int:
        """Samples a resumed run drops: those of the steps the rollout pool had generated past the
        checkpoint when it was written (its trainer.json's ``in_flight_steps``; a checkpoint without
        it: this run's :meth:`in_flight_steps`), generated again from its weights. None at the end of
        the run that wrote it: a resume that raised ``trainer.totalSteps`` drops nothing."""
        if not start:
            return 0
        spec = self.spec
        written = checkpoint.trainer_state(spec.checkpoint.dir, self.resume_from).get("in_flight_steps")
        steps = self.in_flight_steps(start) if written is None else min(written, self.in_flight_steps(start))
        dropped = steps * spec.data.train_batch_size * spec.rollout.n
        if dropped and self.is_logger:
            which = f"step {start + 1}" if steps == 1 else f"steps {start + 1}-{start + steps}"
            print(f"distflow: {dropped} samples of {which} were in flight (generated, not trained) when the "
                  "checkpoint was written; they are generated again", flush=True)
        return dropped

    def _step_record(self, trained: dict | None, generated: dict, seconds: float, waited: float,
                     sent: int) -> dict[str, float]:
        """Trainer rank 0's record of a step: the trainer's metrics, the rollout's of the same
        step (generated ``maxStaleness`` iterations earlier), the iteration's wall time."""
        if not self.trains:
            return {}
        out = {**generated, **(trained or {})}
        busiest = torch.tensor([seconds, waited], dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=self.pool_group)
        out["timing_s/step"] = float(busiest[0])
        out["async/trainer_wait_s"] = float(busiest[1])
        out["async/weight_sync_bytes"] = float(sent)
        out["async/max_staleness"] = float(self.plan.staleness)
        ahead = min(self.plan.staleness, self.spec.trainer.total_steps - 1 - self.step)  # steps generated, untrained
        out["async/in_flight_samples"] = float(ahead * self.spec.data.train_batch_size * self.spec.rollout.n)
        out["perf/throughput"] = out["perf/total_num_tokens"] / (out["timing_s/step"] * self.env.world_size)
        out["training/step"] = self.step + 1
        out["training/policy_version"] = float(self.version)
        return out

    def _export(self, out: dict[str, float], node_bytes: dict) -> None:
        if self.exporter is None or not out:
            return
        self.exporter.observe_step(out["training/step"], out, node_bytes,
                                   out["perf/total_num_tokens"] / max(1, self.env.num_nodes),
                                   out.get("data/cache_hits", 0.0), out.get("data/exchanges", 0.0))

    def close(self, clean: bool = True) -> None:
        process_group.set_pool_group(None)
        if not self.trains and self.spec.rollout.engine == "vllm" and getattr(self, "rollout", None) is not None:
            self.rollout.close()  # the vLLM engine's core process
        super().close(clean)

