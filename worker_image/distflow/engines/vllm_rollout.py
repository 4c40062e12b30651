"""Rollout with vLLM (``rollout.engine: vllm``): colocated in every worker, or isolated in a
rollout pool's workers (``async.enable``).

Colocated (sync mode): one engine in every worker process.

    worker rank r (every rank, no driver)
      ├── actor: FSDP2 shards ──(after each update: gather per parameter, in buckets)──┐
      └── vLLM engine (in-process, external launcher) <── load_weights(bucket) ─────────┘
            generate(this rank's prompts) -> token ids + the sampled tokens' log-probs

The engine runs inside the worker (vLLM's ``external_launcher`` executor, its
V1 engine core in-process): ranks of one tensor-parallel group form one
replica and hold the same prompts; every group of ``rollout.tensorParallelSize``
ranks is an independent replica (vLLM folds the extra ranks into an outer dp
dimension). Every tp rank of a replica gets all of its responses; each keeps a
disjoint share of whole prompt groups (prompt i on tp rank i mod tp), so the
step's batch holds every sample once.

Isolated (a rollout pool's worker, ``build_isolated``): the external launcher
builds its groups over the whole job's world, which the trainer pool's ranks
never join, so a rollout rank's engine keeps out of that world.

    rollout rank r (in the job's world: gloo/NCCL)       engine core: child process (spawned), world of 1
      WeightSync.receive: bucket k from trainer rank 0
        (one bucket held) ──── collective_rpc(bucket bytes) ────> distflow_load_bucket: load_weights,
                                                                    layer-wise, in place
      generate(prompts) ────── requests ────────────────────────> scheduler + model (executor: 1 rank)
                        <───── token ids + sampled tokens' log-probs

Its engine core runs in a child process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``,
spawned, the worker's RANK/WORLD_SIZE/MASTER_*/LOCAL_RANK withheld from it),
whose executor opens a torch.distributed world of its own, of one rank (on CPU
vLLM's multiprocessing executor: one more process under the core, on a free
port; on CUDA the uniproc one, in the core, on a file store). The
rank builds no hf replica: the engine's weights are the replica, and a sync
streams the trainer's buckets into them by ``collective_rpc`` on the methods of
``PoolEngineExtension`` (vLLM's ``worker_extension_cls``), vLLM's layer-wise
in-place reload. A thread in the engine's worker watches the rollout rank and
takes the engine down with it (``distflow_exit_with``): a kill -9 leaves no
orphan. Tensor parallelism 1 per rollout rank (``validate`` refuses more).

Sampling matches the hf engine's spec: ``n`` responses per prompt, each its
own request with its own seed (derived from the call's seed, the prompt's
global index and the sample's index), so a response does not depend on how
requests are batched. Log-probs are vLLM's ``processed_logprobs``: after the
temperature, before top-k/top-p, i.e. what the actor recomputes.

Multi-turn rounds (``session``, ``distflow.multiturn``): the engine is woken (and, after a
level-2 sleep, synced from the policy) once for the round, runs as many turns as this rank's
trajectories need, each turn one request per trajectory whose prompt is the trajectory's own
token ids (``TokensPrompt``: never decoded and re-encoded; the prefix cache holds the earlier
turns), and sleeps when the round ends. Tensor parallelism 1 (``validate`` refuses more).

Weight sync, colocated (``sync``): the actor's FSDP2 parameters are all-gathered in
buckets of at most ``rollout.weightSyncBucketMb`` and streamed into vLLM's
in-place ``reload_weights`` (layer-wise ``load_weights``): never a second full
copy of the model in memory. On CUDA the engine sleeps at level 2 between rollouts (KV cache and
weights discarded, nothing copied to host memory): the weights it needs next come from the actor,
by the sync after the update, or by one the engine runs itself before it generates again.

Device: the engine's GPU is the worker's own (vLLM's external launcher takes ``cuda:LOCAL_RANK``),
so ``LOCAL_RANK`` is set to the worker's device index, which differs from its local rank when a
machine runs several nodes' workers (local launcher) or shows each worker one GPU (Ray). An
isolated engine's child process is shown only the worker's GPU (``CUDA_VISIBLE_DEVICES``).

Simplified on purpose: no pipeline parallelism, no LoRA, no HTTP server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from distflow.data.batch import PackedBatch
from distflow.engines.fsdp import full_state_tensors
from distflow.engines.rollout import SamplingParams, eos_token_ids, pack_responses, sample_seed


@dataclass(frozen=True)
class VllmConfig:
    """What the engine is built with (from ``rollout`` and ``model``)."""

    model_dir: str
    dtype: str
    """torch dtype name: float32, bfloat16, float16."""
    tensor_parallel_size: int
    max_model_len: int
    """Prompt + response tokens per sequence."""
    seed: int
    device_type: str
    """cpu or cuda."""
    gpu_memory_utilization: float = 0.5
    """cuda: share of the GPU the engine (weights + KV cache) may take; the actor needs the rest."""
    weight_sync_bucket_bytes: int = 64 << 20
    cpu_kv_cache_bytes: int = 1 << 30
    """cpu: the KV cache's size (an explicit size also skips vLLM's warm-up pass at start)."""
    device_index: int = 0
    """cuda: the worker's GPU, what the launcher assigned it (0 under Ray, whose actors each see one)."""


_WAKE_TAGS = ("weights", "kv_cache", "scheduling")
"""vLLM's sleep-mode memory tags; the engine generates only with all of them back."""


def vllm_config(spec, model_dir: str, device: torch.device | str) -> VllmConfig:
    """The engine's settings from a JobSpec, for a worker on ``device``. The engine generates in the
    compute dtype (``model.mixedPrecision``, else ``model.dtype``), as the hf rollout does."""
    device = torch.device(device)
    return VllmConfig(model_dir=model_dir, dtype=spec.model.compute_dtype,
                      tensor_parallel_size=spec.rollout.tensor_parallel_size,
                      max_model_len=spec.data.max_prompt_length + spec.data.max_response_length,
                      seed=spec.trainer.seed, device_type=device.type, device_index=device.index or 0,
                      gpu_memory_utilization=spec.rollout.gpu_memory_utilization,
                      weight_sync_bucket_bytes=spec.rollout.weight_sync_bucket_mb << 20)


def _set_launcher_env(rank: int, device_index: int, world_size: int, master_addr: str, master_port: int) -> None:
    """The torchrun variables vLLM's external launcher reads, set for this worker whatever the process
    inherited (a parent's RANK/LOCAL_RANK, or the Ray launcher's LOCAL_RANK, would be another rank's):
    vLLM takes ``cuda:LOCAL_RANK`` as its GPU, so LOCAL_RANK is the worker's device index."""
    for key, value in (("RANK", rank), ("LOCAL_RANK", device_index), ("WORLD_SIZE", world_size),
                       ("MASTER_ADDR", master_addr), ("MASTER_PORT", master_port)):
        os.environ[key] = str(value)
    # The engine core must live in this process: the external launcher runs one engine per rank.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


_WORKER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
"""The job's torchrun variables: an isolated engine's child process must not see them (its
world is its own)."""


@contextlib.contextmanager
def _isolated_engine_env(config: VllmConfig):
    """The environment an isolated engine's core process is spawned with, for the duration of the
    block (the child copies it at spawn); the variables it changes are the worker's again after."""
    touched = (*_WORKER_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD", "CUDA_VISIBLE_DEVICES")
    saved = {key: os.environ.get(key) for key in touched}
    for key in _WORKER_ENV:
        os.environ.pop(key, None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    # fork would copy the worker's initialised job world into the child
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if config.device_type == "cuda":
        visible = saved["CUDA_VISIBLE_DEVICES"]
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[config.device_index]
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class PoolEngineExtension:
    """Methods vLLM mixes into an isolated engine's worker (``worker_extension_cls``), called by
    name with ``LLM.collective_rpc`` from the rollout rank: a sync as vLLM's layer-wise in-place
    reload, fed one bucket per call."""

    def distflow_exit_with(self, worker_pid: int, period_s: float = 1.0) -> None:
        """Watch the rollout worker (pid ``worker_pid``) from a thread, every ``period_s``
        seconds: once it is gone (a kill -9 leaves it no time for ``close``), kill this engine
        (its core process, when this worker of its executor runs in a process of its own) and exit."""
        core = os.getppid()  # the engine core, or the rollout worker itself (executor in the core)

        def watch() -> None:
            while True:
                time.sleep(period_s)
                try:
                    os.kill(worker_pid, 0)
                except ProcessLookupError:
                    if core != worker_pid:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(core, signal.SIGKILL)
                    os._exit(1)

        threading.Thread(target=watch, name="distflow-exit-with-worker", daemon=True).start()

    def distflow_begin_reload(self) -> None:
        """Put every layer in layer-wise reload (a layer is processed once all its weights came)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.get_model())

    def distflow_load_bucket(self, names: list[str], shapes: list[list[int]], dtype: str, payload: bytes) -> int:
        """Load one bucket: ``payload`` holds the tensors ``names`` of ``shapes`` in ``dtype``
        (a torch dtype name), packed one after another; its bytes."""
        with warnings.catch_warnings():  # read-only message buffer: load_weights only reads it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(payload, dtype=getattr(torch, dtype))
        weights, offset = [], 0
        for name, shape in zip(names, shapes):
            numel = int(torch.Size(shape).numel())
            weights.append((name, flat[offset: offset + numel].view(shape)))
            offset += numel
        self.get_model().load_weights(weights)
        return flat.numel() * flat.element_size()

    def distflow_finish_reload(self) -> int:
        """Process the layers left (attention), then repack the CPU GEMM weights kept beside
        their packed copies (``_repack_kept_cpu_weights``); the layers repacked."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.get_model()
        finalize_layerwise_reload(model, self.vllm_config.model_config)
        return _repack_kept_cpu_weights(model) if self.vllm_config.device_config.device_type == "cpu" else 0


class VllmRollout:
    """A vLLM engine colocated with this rank's actor shards (``build``), or a rollout pool
    worker's isolated engine (``build_isolated``).

    Same interface as ``HfRollout``: ``generate``, ``session`` (multi-turn rounds) and ``sync``;
    ``shared`` is False (the engine holds its own copy of the weights).
    """

    shared = False
    records_log_probs = True
    """``generate`` (and a session's calls) always add ``rollout_log_probs``, whatever
    ``SamplingParams.record_log_probs`` says."""

    def __init__(self, config: VllmConfig, tokenizer, llm, tp_rank: int = 0,
                 policy: torch.nn.Module | None = None, isolated: bool = False) -> None:
        self.config = config
        self.isolated = isolated
        """A rollout pool's engine (``build_isolated``): never sleeps, loads weights by ``load_weight_buckets``."""
        self.tokenizer = tokenizer
        self.llm = llm
        self.tp_rank = tp_rank
        self.policy = policy
        """The actor's model: where the engine reloads the weights a level-2 sleep discarded."""
        self.resident = set(_WAKE_TAGS)
        """What the engine holds in device memory now (sleep mode, CUDA only)."""
        self.weights_loaded = True
        """Whether the engine's weights are a model's (False from a level-2 sleep until a sync)."""
        self.device = torch.device("cuda", config.device_index) if config.device_type == "cuda" else torch.device("cpu")
        """Where its batches go: the worker's device."""
        self.end_ids = eos_token_ids(tokenizer, _generation_config(config.model_dir))
        """The ids a response (a model turn) ends at: the tokenizer's EOS and the model's generation config's."""

    @classmethod
    def build(cls, config: VllmConfig, tokenizer, *, policy: torch.nn.Module | None = None, rank: int = 0,
              world_size: int = 1, master_addr: str = "127.0.0.1", master_port: int = 29500) -> "VllmRollout":
        """Start the engine (loads the weights from ``config.model_dir``; every rank of the job calls this).

        Args:
            policy: the actor's (FSDP) model; needed on CUDA, where sleeping discards the weights.

        Raises:
            ValueError: CUDA without ``policy``.
        """
        if config.device_type == "cuda" and policy is None:
            raise ValueError("VllmRollout.build: a CUDA engine needs the actor's model (policy=) to reload "
                             "the weights its sleep discards")
        _set_launcher_env(rank, config.device_index, world_size, master_addr, master_port)
        from vllm import LLM

        cuda = config.device_type == "cuda"
        kwargs = (dict(gpu_memory_utilization=config.gpu_memory_utilization, enable_sleep_mode=True) if cuda
                  else dict(kv_cache_memory_bytes=config.cpu_kv_cache_bytes))
        llm = LLM(model=config.model_dir, tokenizer=config.model_dir, dtype=config.dtype,
                  tensor_parallel_size=config.tensor_parallel_size,
                  distributed_executor_backend="external_launcher" if world_size > 1 else None,
                  max_model_len=config.max_model_len, seed=config.seed,
                  # CUDA graphs would be captured at every wake; eager keeps start-up and wake cheap.
                  enforce_eager=True, enable_prefix_caching=True,
                  logprobs_mode="processed_logprobs", **kwargs)
        engine = cls(config, tokenizer, llm, tp_rank=rank % config.tensor_parallel_size, policy=policy)
        engine.sleep()
        return engine

    @classmethod
    def build_isolated(cls, config: VllmConfig, tokenizer) -> "VllmRollout":
        """Start a rollout pool's engine: its core in a child process with a torch.distributed
        world of its own, outside the job's (only this rank calls it). Loads the weights from
        ``config.model_dir``; the first ``load_weight_buckets`` replaces them with the trainer's.

        Raises:
            ValueError: ``config.tensor_parallel_size`` is not 1.
        """
        if config.tensor_parallel_size != 1:
            raise ValueError(f"VllmRollout.build_isolated: tensor parallelism {config.tensor_parallel_size}; "
                             "a rollout pool's engine runs with 1 (rollout.tensorParallelSize: 1)")
        from vllm import LLM

        kwargs = (dict(gpu_memory_utilization=config.gpu_memory_utilization) if config.device_type == "cuda"
                  else dict(kv_cache_memory_bytes=config.cpu_kv_cache_bytes))
        with _isolated_engine_env(config):
            llm = LLM(model=config.model_dir, tokenizer=config.model_dir, dtype=config.dtype,
                      tensor_parallel_size=1, max_model_len=config.max_model_len, seed=config.seed,
                      enforce_eager=True, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                      worker_extension_cls=f"{__name__}.{PoolEngineExtension.__qualname__}", **kwargs)
        llm.collective_rpc("distflow_exit_with", args=(os.getpid(),))
        return cls(config, tokenizer, llm, isolated=True)

    def close(self) -> None:
        """Stop the engine's core process (an isolated engine's; a colocated one has none)."""
        if self.isolated:
            self.llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        """CUDA: discard the KV cache and the weights (level 2) while the actor trains.

        Level 1 would copy the weights to pinned host memory and back, only for the
        sync after the update to overwrite them.
        """
        if self.config.device_type == "cuda" and self.resident and not self.isolated:
            self.llm.sleep(level=2)
            self.resident = set()
            self.weights_loaded = False

    def wake_up(self, tags: tuple[str, ...] = _WAKE_TAGS) -> None:
        """Bring ``tags`` back (all before generating; only the weights to overwrite them)."""
        missing = [t for t in tags if t not in self.resident]
        if missing:
            self.llm.wake_up(tags=missing)
            self.resident.update(missing)

    @contextlib.contextmanager
    def _awake(self, metrics=None):
        """The engine ready to generate within the block (the policy's weights, the KV cache), asleep after."""
        if not self.weights_loaded:
            # No update since the last sleep (a DAPO refill round, an evaluation, the first rollout):
            # the policy's weights again. Collective, and reached at the same call on every rank.
            moved = self.sync(self.policy)
            if metrics is not None:
                metrics.add_sum("perf/weight_sync_bytes", moved)
        self.wake_up()
        try:
            yield
        finally:
            self.sleep()

    def generate(self, prompts: list[list[int]], group_index: list[int], params: SamplingParams,
                 seed: int, metrics=None) -> PackedBatch:
        """Sample ``params.n`` responses per prompt.

        Returns:
            PackedBatch of len(prompts) * n samples (the n of a prompt adjacent; with tensor
            parallelism, of this tp rank's prompts i with i mod tp == tp_rank), with the hf
            engine's fields plus ``rollout_log_probs`` [T_total] float32: the log-prob of each
            generated token under the engine's weights at ``params.temperature``, 0 on prompt tokens.
        """
        with self._awake(metrics):
            return self._sample(prompts, group_index, params, seed)

    @contextlib.contextmanager
    def session(self, metrics=None):
        """The engine awake for several generate calls that no other rank joins (a multi-turn round:
        each rank runs as many turns as its own samples need), as ``HfRollout.session``. Entered on
        every rank together (it may sync the policy's weights, a collective); asleep again after.

        Yields:
            ``(generate_fn, end_ids)``: ``generate_fn(prompts, group_index, params, seed)`` is
            ``generate`` without the wake and sleep around it (token ids in, never re-encoded: one
            ``TokensPrompt`` per sample, seeded ``sample_seed(seed, group_index[i], j)``); ``end_ids``
            are the ids a turn ends at.

        Raises:
            ValueError: ``config.tensor_parallel_size`` is not 1 (a tp group's ranks would have to
                call generate together, which ranks running their own turns do not).
        """
        if self.config.tensor_parallel_size != 1:
            raise ValueError(f"VllmRollout.session: tensor parallelism {self.config.tensor_parallel_size}; "
                             "multi-turn rollouts run with 1 (rollout.tensorParallelSize: 1)")
        with self._awake(metrics):
            yield self._sample, self.end_ids

    def _sample(self, prompts: list[list[int]], group_index: list[int], params: SamplingParams,
                seed: int) -> PackedBatch:
        """``generate`` on an awake engine."""
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        requests, sampling = [], []
        for prompt, group in zip(prompts, group_index):
            for j in range(params.n):
                requests.append(TokensPrompt(prompt_token_ids=list(prompt)))
                sampling.append(VllmSampling(**_sampling_kwargs(params, self.end_ids),
                                             seed=sample_seed(seed, group, j)))
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        tp = self.config.tensor_parallel_size
        seqs, groups, log_probs = [], [], []
        for k, out in enumerate(outputs):
            if (k // params.n) % tp != self.tp_rank:
                continue
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            seqs.append((list(out.prompt_token_ids), tokens))
            groups.append(group_index[k // params.n])
            log_probs.append(_sampled_log_probs(completion.logprobs, tokens))
        batch = pack_responses(seqs, groups, self.device)
        per_token = torch.tensor([x for (p, _), lp in zip(seqs, log_probs) for x in [0.0] * len(p) + lp],
                                 dtype=torch.float32, device=self.device)
        return batch.with_fields(token={"rollout_log_probs": per_token})

    @torch.no_grad()
    def sync(self, actor_model: torch.nn.Module) -> int:
        """Load the actor's current weights into the engine, in place.

        Parameters are all-gathered (FSDP2 ``full_tensor``) a bucket of at most
        ``weight_sync_bucket_bytes`` at a time and streamed into vLLM's in-place
        reload (``reload_weights``: the model's ``load_weights`` on checkpoint-format
        tensors, then each layer's post-load processing, e.g. the CPU GEMM repacking
        that a bare ``load_weights`` would bypass).

        Returns:
            Bytes all-gathered by this rank (the full model's parameters, in the engine's dtype).
        """
        self.wake_up(("weights",))  # to be overwritten; the KV cache comes back for the next rollout
        moved = [0]

        def weights():
            # gathered in the engine's dtype: a bf16 engine costs half the bytes of the fp32 masters
            dtype = getattr(torch, self.config.dtype)
            for name, full in _gathered_in_buckets(actor_model, self.config.weight_sync_bucket_bytes, dtype):
                moved[0] += full.numel() * full.element_size()
                yield name, full

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
        if self.config.device_type == "cpu":
            self.llm.collective_rpc("apply_model", args=(_repack_kept_cpu_weights,))
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.weights_loaded = True
        return moved[0]

    @torch.no_grad()
    def load_weight_buckets(self, buckets) -> int:
        """Isolated engine: load a weight sync's buckets into the engine, in place, one at a time.

        Args:
            buckets: iterable of ``distflow.pools.weight_sync.ReceivedBucket`` (flat [numel]
                tensor in the engine's dtype, names, shapes), together every parameter of the
                model; consumed in order, one held at a time.

        Returns:
            Bytes loaded.
        """
        assert self.isolated, "load_weight_buckets feeds an isolated engine; a colocated one syncs from the actor"
        self.llm.collective_rpc("distflow_begin_reload")
        moved = 0
        for bucket in buckets:
            flat = bucket.flat.detach().to("cpu").contiguous()
            payload = memoryview(flat.view(torch.uint8).numpy())
            dtype = str(flat.dtype).removeprefix("torch.")
            moved += self.llm.collective_rpc("distflow_load_bucket",
                                             args=(list(bucket.names), [list(s) for s in bucket.shapes], dtype,
                                                   payload))[0]
            del bucket, flat, payload  # released before the next broadcast allocates its bucket
        self.llm.collective_rpc("distflow_finish_reload")
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        return moved


def _repack_kept_cpu_weights(model: torch.nn.Module) -> int:
    """Re-run the CPU GEMM packing of every layer that keeps its weight beside the packed copy.

    vLLM's CPU build packs each linear layer's weight for its GEMM after loading. Most layers
    drop the weight and ``reload_weights`` repacks them; a tied LM head keeps the weight (it is
    the input embedding's), and nothing loads into it on a reload (the checkpoint names no
    lm_head weight), so its packed copy would keep the initial weights: greedy tokens mostly
    survive that, the sampled tokens' log-probs do not. Returns the layers repacked.
    """
    repacked = 0
    for module in model.modules():
        method, weight = getattr(module, "quant_method", None), getattr(module, "weight", None)
        if method is None or not hasattr(module, "cpu_linear") or weight is None or weight.numel() == 0:
            continue
        method.process_weights_after_loading(module)
        repacked += 1
    return repacked


def _gathered_in_buckets(model: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None):
    """(name, full tensor) per parameter, all-gathered a bucket of about ``bucket_bytes`` ahead."""
    bucket, size = [], 0
    for name, full in full_state_tensors(model, dtype):
        bucket.append((name, full))
        size += full.numel() * full.element_size()
        if size >= bucket_bytes:
            yield from bucket
            bucket, size = [], 0
    yield from bucket


def _generation_config(model_dir: str):
    """The model's ``generation_config.json`` (where chat models list their end-of-turn ids), None without one."""
    if not (Path(model_dir) / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(model_dir)


def _sampling_kwargs(params: SamplingParams, stop_ids: list[int]) -> dict:
    greedy = params.temperature <= 0
    return dict(n=1, max_tokens=params.max_new_tokens, temperature=0.0 if greedy else params.temperature,
                top_p=1.0 if greedy else params.top_p, top_k=0 if greedy else params.top_k,
                stop_token_ids=list(stop_ids), logprobs=0, detokenize=False, skip_special_tokens=False)


def _sampled_log_probs(logprobs, tokens: list[int]) -> list[float]:
    """The log-prob of each sampled token, from vLLM's per-position {token id: Logprob} dicts."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (SamplingParams.logprobs=0 was set)")
    return [float(pos[tok].logprob) for pos, tok in zip(logprobs, tokens)]


def engine_problems(spec, model_dir: str, device_type: str) -> list[str]:
    """What would make ``rollout.engine: vllm`` fail in the workers, checked before they start.

    Returns:
        Messages naming the field and the fix (empty: fine, or the hf engine).
    """
    if spec.rollout.engine != "vllm":
        return []
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ["rollout.engine: vllm is not installed in this environment; install distflow[vllm] "
                "(GPU), or run in the venv .ci/setup-vllm builds (CPU), or use rollout.engine: hf"]
    config = json.loads((Path(model_dir) / "config.json").read_text())
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    archs = config.get("architectures") or []
    if not any(a in supported for a in archs):
        return [f"model.path: vLLM cannot load architecture {archs} (not in its model registry); "
                "use rollout.engine: hf for this model"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if device_type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            return [f"model.path: vLLM's CPU attention takes head sizes {sizes}, this model has "
                    f"{head_dim}; use rollout.engine: hf on CPU (or a GPU)"]
    return []
