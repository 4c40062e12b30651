"""The DAG worker: one process per accelerator (or CPU slot), running the plan.

    every rank, every step:
      for node in plan.chain:            # the same chain on every rank
          coordinator.ensure(node)       # local cache, or all_to_all by a plan all ranks computed
          out = STAGES[node.role](ctx, node, batch)   # rollout / reward / advantage / actor ...
          check out against distflow.fields; coordinator.produce(node, batch + out)
      metrics.reduce()                   # one all-reduce of scalars
      checkpoint (every k steps)

There is no driver: each worker reads its own prompts, generates, scores and
trains on its own samples, and exchanges only metadata (lengths, counts)
plus the samples a plan says must move.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from distflow import chaos, checkpoint, precision, process_group, sample_ids
from distflow import gang_resize
from distflow.gang_resize import GangResize
from distflow.malloc import release_freed_memory
from distflow.resize import ResizeWatch
from distflow.checkpoint_origin import made_from
from distflow.coordinator import DataCoordinator
from distflow.data.buffer import NodeBuffer
from distflow.data.counters import TransferCounters
from distflow.data.loader import ShardedPromptLoader
from distflow.data.prompt_fit import fit_prompts, scan_share
from distflow.data.sources import dataset_source
from distflow.device_guard import guard_from_environ
from distflow.engines import flex_masks, fsdp
from distflow.engines.actor import Actor
from distflow.engines.critic import build_critic
from distflow.engines.loading import load_sharded_causal_lm, rollout_copy
from distflow.engines.rollout import HfRollout, step_seed
from distflow.exporter import NodeExporter
from distflow.metrics import JsonlWriter, StepMetrics
from distflow.models import DTYPES, load_tokenizer, model_cache_dir, resolve_model
from distflow.planner import ROLLOUT, TRAIN, build_plan
from distflow.spec import JobSpec
from distflow.spec.defaults import kv_cache_bytes_per_token, kv_cache_micro_batch_size
from distflow.fields import check_stage_output
from distflow.stages import STAGES, StageContext, StageModels, StageOutput, build_kl_controller
from distflow.stages.rollout import generate_round, prompt_length, sampling_params
from distflow.stages.scoring import score_responses


@dataclass(frozen=True)
class WorkerEnv:
    """Where this process sits in the job (torchrun-style)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_name: str
    model_dir: str
    device_index: int
    """This worker's GPU: its process index on its machine. A pod runs one node, so it is the
    local rank; the local launcher runs every node's workers on one machine, so it is the rank."""
    resume: bool = True
    metrics_port: int = 0
    """Prometheus port this node serves (0: none)."""
    resize_file: str = ""
    """The operator's resize request, mounted from the job's ConfigMap (``distflow.resize``);
    empty: none (a local run), and no step polls for one."""
    join: bool = False
    """A worker started to join a running job's rollout pool (``distflow.pools.elastic``) or gang
    (``distflow.gang_resize``): ``rank`` and ``world_size`` are those of the world it joins."""
    formed: bool = False
    """Its world is formed already (``distflow.gang_resize`` re-formed it in place)."""
    generation: int = 0
    """Worlds of the job's store before this one (``process_group.GENERATION_KEY``)."""


log = logging.getLogger(__name__)


def _max_over_ranks(flag: int) -> int:
    """The largest of every rank's ``flag`` (one int all-reduced over the world, on the CPU backend)."""
    value = torch.tensor([flag], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class DagWorker:
    trains = True
    """Whether this worker trains (every worker in sync mode; the trainer pool's, ``distflow.pools``)."""
    train_group = None
    """The process group of the training ranks (None: the world)."""
    replica = None
    """A rollout pool worker's own policy copy (``distflow.pools``); None here."""
    resize_watch: ResizeWatch | None = None
    """Polled at every step boundary when the operator can ask for a resize (a pod); None locally."""
    stopped_for_resize = False
    """``train`` stopped at a step boundary because the operator asked for another size."""
    left_pool = False
    """This rank left the rollout pool in an in-place shrink (``distflow.pools.elastic``): it exits."""
    reform_to: int | None = None
    """``train`` stopped for an in-place resize of the gang to this many nodes (``distflow.gang_resize``)."""
    gang: GangResize | None = None
    """Polled at every step boundary of a job without pools on pods: resize the gang in place."""
    resume_from: str | None = None
    """The checkpoint (``step_N``) this run resumes from, chosen once before the models are
    built, the same on every rank; None: the run starts from the pretrained weights."""

    def __init__(self, spec: JobSpec, env: WorkerEnv):
        self.spec, self.env, self.given = spec, env, spec  # given: before its device defaults are settled
        self.plan = build_plan(spec)
        self.made_from = made_from(spec, env.model_dir)  # recorded in each checkpoint, compared on resume
        # Served first: a pod is Ready (readiness probe on /metrics) once its runtime is up.
        self.exporter = NodeExporter.serving(env.job_name, env.node_rank, env.metrics_port) \
            if env.local_rank == 0 else None
        info = fsdp.select_device(spec.cluster.device, env.device_index)
        self.device = info.device
        self.device_guard = guard_from_environ(self.device)
        threads = spec.trainer.num_threads or max(1, (os.cpu_count() or 1) // env.local_world_size)
        torch.set_num_threads(threads)
        self._init_world()
        self.spec = spec = precision.settle(spec, self.device, env.rank, joining=env.join)  # one compute dtype
        if self.device.type == "cuda":
            fsdp.set_tf32(spec.model.tf32)
        self.rank = env.rank
        self.rollout_dp_rank = self.plan.layouts[ROLLOUT].dp_rank(env.rank)
        self.step = 0
        self.resume_from = self._choose_resume()
        self._build_models()
        release_freed_memory()
        self._build_data()
        self.metrics = StepMetrics()
        self.counters = TransferCounters.for_plan(self.plan, env.world_size)
        node_buffer = None
        if spec.data_plane.node_buffer and spec.cluster.procs_per_node > 1:
            node_buffer = NodeBuffer(f"{env.job_name}-{env.master_port}", env.node_rank)
        self.coordinator = DataCoordinator(spec, self.plan, self.rank, self.counters, node_buffer,
                                           device=self.device)
        self._received_before = 0
        self.is_logger = env.rank == 0
        self.writer = JsonlWriter(spec.trainer.log_dir) if self.is_logger else None
        pools = spec.async_.rollout_pool.num_nodes if spec.async_.enable else None
        in_place = GangResize.takes(spec)
        self.resize_watch = ResizeWatch(env.resize_file, env.num_nodes, _max_over_ranks, pools, in_place) \
            if env.resize_file else None
        self.gang = GangResize.for_worker(self) if env.resize_file and in_place else None

    def _init_world(self) -> None:
        env = self.env
        if not env.formed:  # else a gang resized in place formed it (distflow.gang_resize)
            process_group.init(self.device, f"tcp://{env.master_addr}:{env.master_port}", env.rank, env.world_size)

    def _resume(self, in_flight: str = "") -> None:
        """Load the checkpoint ``_choose_resume`` chose, if any (``self.step``: its step, else 0), and
        drop what a killed run logged past it (metrics lines, trained ids; at step 0 all, as the step-0
        eval runs again). ``in_flight``: what the log line adds about the samples in flight then."""
        spec = self.spec
        if not self._resuming():
            return
        self.step = checkpoint.load(spec.checkpoint.dir, self.resume_from, self)
        if self.step and self.is_logger:
            left = spec.trainer.total_steps - self.step
            print(f"distflow: resumed from the step-{self.step} checkpoint in {spec.checkpoint.dir} ({left} "
                  f"step{'s' * (left != 1)} to go; --no-resume starts over{in_flight})", flush=True)
        if self.writer is not None:
            self.writer.drop_after(kept := self.step if self.step else -1)
            sample_ids.drop_after(spec.trainer.log_dir, kept)
        if self.step and self.exporter is not None:
            self.exporter.observe_checkpoint(self.step)

    def _report_start(self, progress, evaluate: bool) -> None:
        """Before the first step: with ``evaluate`` and ``data.eval``, score the policy on the
        held-out prompts and log it as step 0; then ``progress``'s start call, with that score."""
        metrics = {}
        if evaluate and self.spec.data.eval is not None:
            metrics = self._eval_metrics()
            self._log({"training/step": 0, **metrics})
        if progress:
            progress(self.step, metrics)

    def _resuming(self) -> bool:
        spec = self.spec
        return bool(spec.checkpoint.dir) and self.env.resume and spec.checkpoint.resume == "auto"

    def _choose_resume(self) -> str | None:
        """Collective: the checkpoint ``train`` will load (``checkpoint.choose``), or None. A worker
        joining a running rollout pool has no world yet and loads none: the running ranks hand it
        the step and the policy (``distflow.pools.elastic``)."""
        if self.env.join or not self._resuming():
            return None
        return checkpoint.choose(self.spec.checkpoint.dir)

    def _build_models(self) -> None:
        spec, env = self.spec, self.env
        _seed_everything(spec.trainer.seed)
        self.tokenizer = load_tokenizer(env.model_dir)
        mesh = fsdp.dp_mesh(self.device, env.world_size, spec.cluster.data_parallel_replicate_degree)
        compute = DTYPES[spec.model.compute_dtype]
        # float32 master weights whatever model.dtype says: AdamW steps them (FSDP2 mixed precision).
        # Resuming, the checkpoint fills them: the pretrained weights are not read (the reference's are).
        self.actor_model = load_sharded_causal_lm(env.model_dir, mesh, self.device, torch.float32, compute,
                                                  spec.model.gradient_checkpointing,
                                                  spec.actor.reshard_after_forward, fill=self.resume_from is None)
        copy = None
        if not spec.rollout.share_actor_weights and spec.rollout.engine == "hf":
            copy = rollout_copy(env.model_dir, self.actor_model, self.device, compute)
        self.rollout = self._build_rollout(copy)
        self.actor = Actor.build(spec, self.actor_model, self.tokenizer.pad_token_id,
                                 env.world_size, self.device)
        self.ref_model = None
        if any(n.role == "reference" for n in self.plan.chain):
            self.ref_model = load_sharded_causal_lm(env.model_dir, mesh, self.device,
                                                    DTYPES[spec.model.dtype], compute).eval()
            self.ref_model.requires_grad_(False)
        self._build_critic(mesh)
        self._size_rollout_micro_batches()
        self.models = StageModels(rollout=self.rollout, actor=self.actor, policy=self.actor_model,
                                  reference=self.ref_model, critic=self.critic)

    def _build_rollout(self, copy):
        """The rollout engine: hf on the actor's weights (or ``copy``), or a colocated vLLM engine."""
        spec, env = self.spec, self.env
        if spec.rollout.engine == "hf":
            weights = fsdp.RolloutWeights(self.actor_model, copy,
                                          keep_gathered=not spec.actor.reshard_after_forward)
            return HfRollout(weights, self.tokenizer, self.device)
        from distflow.engines.vllm_rollout import VllmRollout, vllm_config

        return VllmRollout.build(vllm_config(spec, env.model_dir, self.device), self.tokenizer,
                                 policy=self.actor_model, rank=env.rank, world_size=env.world_size,
                                 master_addr=env.master_addr, master_port=env.master_port)

    def _size_rollout_micro_batches(self) -> None:
        """``rollout.microBatchSize`` left open (cuda, hf): as many sequences as the KV cache of
        full-length ones fits in ``rollout.gpuMemoryUtilization`` of the GPU memory free now,
        less the full weights a shared-weights rollout all-gathers."""
        spec = self.spec
        if spec.rollout.micro_batch_size is not None:
            return
        compute = DTYPES[spec.model.compute_dtype]
        model = self.actor_model if self.actor_model is not None else self.replica  # a rollout pool's replica
        gathered = fsdp.unsharded_nbytes(model, compute) if self.rollout.shared else 0
        free = max(0, torch.cuda.mem_get_info(self.device)[0] - gathered)
        config = model.config.get_text_config(decoder=True)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        per_token = kv_cache_bytes_per_token(config.num_hidden_layers, getattr(config, "num_key_value_heads", None)
                                             or heads, head_dim, compute.itemsize)
        micro = kv_cache_micro_batch_size(free, spec.rollout.gpu_memory_utilization, per_token,
                                          spec.data.max_prompt_length + spec.data.max_response_length,
                                          spec.rollout.n)
        log.info("rollout.microBatchSize: %d sequences (KV cache %d bytes per token)", micro, per_token)
        self.spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"micro_batch_size": micro})})

    def _build_critic(self, mesh) -> None:
        """The in-reward KL coefficient (every rank: reward shaping may run on either pool) and, on
        the ranks that train, the value model (when the workflow has critic or values nodes),
        sharded over the train layout's ranks (every rank in sync mode, the trainer pool's with pools)."""
        self.kl_ctrl = build_kl_controller(self.spec.algorithm.kl_ctrl)
        self.critic = None
        if self.trains and any(n.role in ("critic", "values") for n in self.plan.chain):
            path = self.spec.critic.path
            model_dir = self.env.model_dir if path is None else str(resolve_model(path, model_cache_dir()))
            self.critic = build_critic(self.spec, model_dir, self.tokenizer.pad_token_id, mesh,
                                       self.plan.layouts[TRAIN].num_ranks, self.device,
                                       fill=self.resume_from is None)

    def _build_data(self) -> None:
        dp = self.plan.layouts[ROLLOUT].dp_size
        self._load_train(dp, self.rollout_dp_rank)
        self._load_eval(dp, self.rollout_dp_rank)

    def _load_train(self, dp_size: int, dp_rank: int) -> None:
        """The train prompts (over-long ones handled as data.truncation says) and the loader of
        share ``dp_rank`` of ``dp_size``."""
        spec = self.spec
        train = dataset_source(spec.data.train)
        fitted = self._fit_prompts(train, "data.train")
        self.num_filtered_prompts = train.num_records - fitted.num_records
        self.loader = ShardedPromptLoader(fitted, spec.data.train_batch_size, dp_rank, dp_size,
                                          seed=spec.data.seed, shuffle=spec.data.shuffle)

    def _load_eval(self, num_shares: int, share: int | None) -> None:
        """This rank's share of the eval set (records i with i mod ``num_shares`` == ``share``) and each
        record's index in the whole set; ``share`` None: none, but the scan for over-long prompts,
        a collective, is joined all the same."""
        self.eval_records, self.eval_indices = [], []
        if self.spec.data.eval is None:
            return
        source = self._fit_prompts(dataset_source(self.spec.data.eval), "data.eval")
        if share is not None:
            self.eval_indices = [i for i in range(source.num_records) if i % num_shares == share]
            self.eval_records = source.read(self.eval_indices)

    def _fit_prompts(self, source, field: str):
        """``source`` as ``data.truncation`` says (collective: each rank scans a share of it).

        Raises:
            DistflowConfigError: on every rank, ``error`` and an over-long prompt.
        """
        data = self.spec.data
        if data.truncation == "left":
            return source
        # A worker joining a running job has no world yet: it scans the whole set itself.
        world = self.env.world_size if dist.is_initialized() else 1
        mine = scan_share(source, self.rank % world, world, data.max_prompt_length,
                          prompt_length(self.tokenizer, self.spec))
        everyone: list = [mine] * world
        if world > 1:
            dist.all_gather_object(everyone, mine)  # small Python lists: the CPU backend carries them
        overlong = sorted((o for part in everyone for o in part), key=lambda o: o.index)
        return fit_prompts(source, overlong, data.truncation, data.max_prompt_length, field)

    def global_sum(self, values: torch.Tensor) -> torch.Tensor:
        """All-reduce a small vector of sums (the reducer handed to the algorithms)."""
        return fsdp.all_reduce_sum(values, self.device).to(values.dtype)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean reward on the eval set (every rank scores its share), sampled as `rollout.val` says.

        Greedy by default; with `rollout.val.temperature > 0`, the mean over
        `rollout.val.n` responses per prompt (verl's mean@n) from a seed that
        is the same at every evaluation, so evaluations differ only by the policy.
        Response ``j`` of eval prompt ``k`` (its index in the whole set) samples from
        ``sample_seed(seed, k, j)`` with one seed for all ranks: the score does not depend
        on the world size or on which rank scored the prompt.
        """
        if self.spec.data.eval is None:
            return float("nan")
        # "Step" -1: apart from every training step's rollout seed.
        batch = generate_round(self.rollout, self.tokenizer, self.spec, self.eval_records, self.eval_indices,
                               sampling_params(self.spec, held_out=True), step_seed(self.spec.trainer.seed, -1))
        texts, records, scores = score_responses(self.tokenizer, batch,
                                                 dict(zip(self.eval_indices, self.eval_records)),
                                                 self.spec.data.reward_fn, f"in the evaluation at step {self.step}")
        if self.writer is not None:
            self.writer.write_samples(self.step, records, texts, scores)
        sums = self.global_sum(torch.tensor([sum(scores), len(scores)], dtype=torch.float64))
        return float(sums[0] / max(sums[1], 1.0))

    def _eval_metrics(self) -> dict[str, float]:
        """``eval/score`` and verl's name for it, ``val-core/<data source>/reward/mean@<n>``."""
        score = self.evaluate()
        source = self.eval_records[0].data_source if self.eval_records else "eval"
        return {"eval/score": score, f"val-core/{source}/reward/mean@{self.spec.rollout.val.n}": score}

    def run_step(self) -> dict[str, float]:
        self.coordinator.next_step(self.step)
        flex_masks.forget_block_masks()  # the last step's micro-batches are gone
        self.metrics = StepMetrics()
        sent_before = dict(self.counters.bytes_sent)
        hits_before = sum(self.counters.cache_hits.values())
        exchanges_before = sum(self.counters.exchanges.values())
        paths_before = self._path_bytes()
        collectives = process_group.collective_bytes()
        gathered, reduced = collectives.all_gather, collectives.reduce_scatter
        start = time.perf_counter()
        ctx = self._stage_context()
        for node in self.plan.chain:
            with self.metrics.timer(node.id):
                self.coordinator.ensure(node)
                batch = self.coordinator.batch if self.coordinator.producer else None
                self._hand_on(node, batch, STAGES[node.role](ctx, node, batch))
        batch = self.coordinator.batch
        self.metrics.add_sum("perf/total_num_tokens", float(batch.num_tokens))
        self.metrics.add_max("data/balance_imbalance", self.coordinator.last_imbalance)
        self.metrics.add_max("data/filtered_prompts", self.num_filtered_prompts)  # data.truncation: filter
        # Keyed by exchanges, which every rank records, not by sends: a rank that sent nothing on an
        # edge must still add its metric, or the ranks' metric vectors differ in the all-reduce.
        step_sent = {e: self.counters.bytes_sent.get(e, 0) - sent_before.get(e, 0) for e in self.counters.exchanges}
        for edge, value in step_sent.items():
            self.metrics.add_sum(f"data/bytes_sent/{edge}", value)
        self.metrics.add_sum("data/cache_hits", sum(self.counters.cache_hits.values()) - hits_before)
        self.metrics.add_sum("data/exchanges", sum(self.counters.exchanges.values()) - exchanges_before)
        for name, value in self._path_bytes().items():
            self.metrics.add_sum(name, value - paths_before[name])
        self.metrics.add_max("timing_s/step", time.perf_counter() - start)
        # FSDP2's weight all-gathers and gradient reduce-scatters this step, counted (busiest rank)
        self.metrics.add_max("perf/allgather_bytes", collectives.all_gather - gathered)
        self.metrics.add_max("perf/reduce_scatter_bytes", collectives.reduce_scatter - reduced)
        out = self.metrics.reduce(self.device)
        busiest, node_bytes = self._transfer_stats(step_sent)
        out.update(busiest)
        out["perf/throughput"] = out["perf/total_num_tokens"] / (out["timing_s/step"] * self.env.world_size)
        out["training/step"] = self.step + 1
        self._export(out, node_bytes)
        return out

    def _stage_context(self) -> StageContext:
        """What this step's stages may use (a fresh metrics sink and prompt table per step)."""
        return StageContext(spec=self.spec, step=self.step, rank=self.rank, rollout_dp_rank=self.rollout_dp_rank,
                            tokenizer=self.tokenizer, models=self.models, loader=self.loader,
                            metrics=self.metrics, reduce=self.global_sum, kl_ctrl=self.kl_ctrl,
                            regroup=self._regroup, device=self.device)

    def _regroup(self, node_id: str, batch, target: list[list[int]], edge: str):
        """``batch`` moved so rank r holds the sample ids ``target[r]`` (collective)."""
        self.coordinator.produce(node_id, batch)
        self.coordinator.regroup(target, edge)
        return self.coordinator.batch

    def _hand_on(self, node, batch, out: StageOutput) -> None:
        """A stage's output, checked against ``distflow.fields``, becomes the step's batch.

        An empty output (train stages) hands nothing on: the next node reads the
        batch of the node before.

        Raises:
            TypeError: the stage added a field ``distflow.fields`` does not declare for its role.
        """
        if out.empty:
            return
        new = out.batch if out.batch is not None else batch
        token_before = batch.token_fields if batch is not None else {}
        sample_before = batch.sample_fields if batch is not None else {}
        check_stage_output(node.role, node.id,
                           {**{k: v for k, v in new.token_fields.items() if k not in token_before}, **out.token},
                           {**{k: v for k, v in new.sample_fields.items() if k not in sample_before}, **out.sample})
        if out.token or out.sample:
            new = new.with_fields(token=out.token, sample=out.sample)
        self.coordinator.produce(node.id, new)

    def _path_bytes(self) -> dict[str, int]:
        """Bytes this rank has sent so far by path: to its own node (of which handed over through
        the node buffer, without a copy over the network) and to other nodes."""
        return {"data/intra_node_bytes": self.counters.intra_node_bytes,
                "data/bytes_handed_over": sum(self.counters.bytes_handed_over.values()),
                "data/cross_node_bytes": self.counters.cross_node_bytes}

    def _transfer_stats(self, step_sent: dict[str, int]) -> tuple[dict[str, float], dict]:
        """Gather every rank's bytes of this step (metadata-sized: one row per rank).

        Returns:
            ({"data/busiest_rank_bytes", "data/mean_rank_bytes"} over sent + received,
             {(rank, edge): bytes sent} for the ranks of this node, for its exporter).
        """
        edges = sorted(step_sent)
        received = sum(self.counters.bytes_received.values())
        row = [float(step_sent[e]) for e in edges] + [float(received - self._received_before)]
        self._received_before = received
        local = torch.tensor([row], dtype=torch.float64)  # on CPU: the group's gloo backend carries it
        gathered = [torch.zeros_like(local) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, local)
        table = torch.cat(gathered)
        per_rank = table.sum(dim=1)
        node_bytes = {(r, e): float(table[r, j]) for r in range(self.env.world_size)
                      if self.plan.node_of_rank(r) == self.env.node_rank for j, e in enumerate(edges)}
        return ({"data/busiest_rank_bytes": float(per_rank.max()),
                 "data/mean_rank_bytes": float(per_rank.mean())}, node_bytes)

    def _export(self, out: dict[str, float], node_bytes: dict) -> None:
        if self.exporter is None:
            return
        # Each node counts its share of the tokens, so summing over nodes gives the job's total.
        self.exporter.observe_step(self.step + 1, out, node_bytes,
                                   out["perf/total_num_tokens"] / max(1, self.env.num_nodes),
                                   out["data/cache_hits"], out["data/exchanges"])

    def train(self, progress=None) -> list[dict[str, float]]:
        """Run the remaining steps; the per-step metrics of this run.

        ``progress(step, metrics)``, if given, is called once with the step
        training starts from (the resumed checkpoint's, else 0) and the held-out
        metrics of the policy before training (``{}`` without ``data.eval`` or on a
        resume), then after every step with that step's metrics.
        """
        spec = self.spec
        history = []
        chaos.install(self)
        self._resume()
        if self.gang is not None:
            gang_resize.resumed(self)
        self._report_start(progress, evaluate=self.step == 0)
        fail_at = int(os.environ.get("DISTFLOW_INJECT_FAILURE_AT_STEP", "0"))
        while self.step < spec.trainer.total_steps:
            if fail_at and self.step + 1 == fail_at:
                # Chaos hook for the resume tests: die like a lost node would, mid-run.
                raise RuntimeError(f"injected failure at step {fail_at} (DISTFLOW_INJECT_FAILURE_AT_STEP)")
            with self.device_guard:
                out = self.run_step()
            self._log_trained_ids()
            self.step += 1
            every = spec.trainer.eval_every_steps
            if spec.data.eval is not None and (self.step == spec.trainer.total_steps or
                                               (every and self.step % every == 0)):
                out.update(self._eval_metrics())
            self._log(out)
            history.append(out)
            if progress:
                progress(self.step, out)
            if self._step_boundary():
                break
        chaos.write_tally()
        return history

    def _step_boundary(self) -> bool:
        """Collective, after step ``self.step``: the checkpoint every ``checkpoint.saveEverySteps`` (and
        at the last step), and the resize poll. True when the gang stops here for a resize, or to
        re-form in place at another size (``self.reform_to``, ``distflow.gang_resize``): then the
        checkpoint of this step is complete on every rank (``checkpoint.save`` agrees before returning)."""
        spec = self.spec
        last = self.step == spec.trainer.total_steps
        save_every = spec.checkpoint.save_every_steps
        saved = bool(spec.checkpoint.dir) and (last or bool(save_every and self.step % save_every == 0))
        if saved:
            self._save_checkpoint()
        if last or self.resize_watch is None:
            return False
        if self.gang is not None and self.gang.at_step_boundary(self, saved):
            return True
        if not self.resize_watch.should_stop():
            return False
        if spec.checkpoint.dir and not saved:
            self._save_checkpoint()
        if self.is_logger:
            size = self.resize_watch.requested or "another number of"
            saved_note = " (checkpoint saved)" if spec.checkpoint.dir else "; no checkpoint.dir: the new size starts over"
            print(f"distflow: stopping after step {self.step} for a resize to {size} nodes{saved_note}", flush=True)
        self.stopped_for_resize = True
        return True

    def _save_checkpoint(self) -> None:
        checkpoint.save(self.spec.checkpoint.dir, self.step, self, self.spec.checkpoint.keep_last)
        if self.exporter is not None:
            self.exporter.observe_checkpoint(self.step)

    def _log_trained_ids(self) -> None:
        """Append this step's trained record ids to ``trained_ids.jsonl`` (see ``distflow.sample_ids``)."""
        groups = self.coordinator.batch.sample_fields["group_index"].tolist()
        ids = sample_ids.gather(sample_ids.record_ids(groups, self.step, self.spec.data.train_batch_size,
                                                      self.spec.trainer.total_steps,
                                                      self.loader.take_read_batches()))
        if self.is_logger:
            sample_ids.append(self.spec.trainer.log_dir, self.step + 1, ids)

    def _log(self, record: dict) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def close(self, clean: bool = True) -> None:
        """Free buffers and leave the process group.

        ``clean``: every rank finished: wait for the others, then tear down.
        After an error on this rank (``clean=False``) no collective is run: the
        other ranks may be blocked in one that this rank will never join, and a
        barrier here would hang the job instead of failing it; the launcher
        (or the operator, for pods) stops them.
        """
        self.coordinator.buffer.close()
        if self.coordinator.node_buffer is not None:
            self.coordinator.node_buffer.cleanup()
        if dist.is_initialized() and clean:
            dist.barrier()
            dist.destroy_process_group()
