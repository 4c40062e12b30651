"""Checks of a spec that span several fields: sizes that must divide, choices that must agree.

Each check yields problems as ``field.path: what is wrong; the fix``, relative
to the spec; ``JobSpec`` raises them all at once (``distflow.spec.loading``
prefixes the root). The operator's CRD mirrors the size checks as CEL rules
(distflow_operator.crdgen).
"""

from __future__ import annotations

import difflib
import re
from typing import TYPE_CHECKING

from distflow.names import ADVANTAGE_ESTIMATORS, ARITHMETIC_SPLITS, BUILTIN_REWARDS, GROUP_ESTIMATORS, TINY_TOKENIZERS
from distflow.spec.multiturn import tool_problems

if TYPE_CHECKING:
    from distflow.spec.models import JobSpec


def closest_choice(given: str, choices) -> str | None:
    """The choice a misspelt ``given`` most likely meant, ignoring case (``'GRPO'`` -> ``'grpo'``,
    ``'TIS'`` -> ``'tis'``), or None when none is close (difflib's ratio under 0.6: 'ppo2' is not 'grpo')."""
    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(given.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def did_you_mean(given: str, choices) -> str:
    """``"did you mean 'x'? "`` for the closest choice (``closest_choice``), or ``""``: a message's prefix."""
    close = closest_choice(given, choices)
    return f"did you mean {close!r}? " if close else ""


def check_choice(path: str, value: str, choices: tuple[str, ...]) -> None:
    """Raises:
        ValueError: ``value`` is not one of ``choices``; names the closest choice, and all of them.
    """
    if value not in choices:
        raise ValueError(f"{path}: unknown {value!r}; {did_you_mean(value, choices)}choose one of {', '.join(choices)}")


def rollout_world(spec: JobSpec) -> int:
    """Workers that generate: all of them, or the rollout pool's (``async.enable``)."""
    if spec.async_.enable:
        return spec.async_.rollout_pool.num_nodes * spec.cluster.procs_per_node
    return spec.world_size


def train_world(spec: JobSpec) -> int:
    """Workers that train (FSDP2 ranks): all of them, or the trainer pool's (``async.enable``)."""
    return spec.world_size - rollout_world(spec) if spec.async_.enable else spec.world_size


def node_bound_problems(spec: JobSpec):
    """cluster.numNodes within [cluster.minNodes, cluster.maxNodes] (a resize's bounds)."""
    cluster = spec.cluster
    low, high, nodes = cluster.min_nodes, cluster.max_nodes, cluster.num_nodes
    if low is not None and high is not None and low > high:
        yield f"cluster.minNodes: {low} is above cluster.maxNodes={high}; use at most {high}"
        return
    if low is not None and nodes < low:
        yield f"cluster.numNodes: {nodes} is below cluster.minNodes={low}; use at least {low} or lower minNodes"
    if high is not None and nodes > high:
        yield f"cluster.numNodes: {nodes} is above cluster.maxNodes={high}; use at most {high} or raise maxNodes"


def size_problems(spec: JobSpec):
    yield from node_bound_problems(spec)
    if spec.async_.enable and (problems := list(_pool_problems(spec))):
        yield from problems
        return
    world = rollout_world(spec)
    batch = spec.data.train_batch_size
    tp = spec.rollout.tensor_parallel_size
    if world % tp:
        yield (f"rollout.tensorParallelSize: {tp} does not divide the {world} workers "
               f"(cluster.numNodes x cluster.procsPerNode); pick a divisor of {world}")
    rollout_dp = max(1, world // tp)
    if batch % rollout_dp:
        source = ("the rollout pool's workers: async.rolloutPool.numNodes x cluster.procsPerNode"
                  if spec.async_.enable else "cluster.numNodes x cluster.procsPerNode / rollout.tensorParallelSize")
        yield (f"data.trainBatchSize: {batch} prompts cannot be split evenly over {rollout_dp} "
               f"rollout dp ranks ({source}); use a multiple of {rollout_dp}, or change those sizes")
    mini = spec.actor.ppo_mini_batch_size
    if mini is not None and batch % mini:
        yield (f"actor.ppoMiniBatchSize: {mini} does not divide data.trainBatchSize={batch}; "
               f"use a divisor of {batch}")
    if spec.rollout.engine == "hf" and tp != 1:
        yield "rollout.tensorParallelSize: the hf engine runs with 1; set it to 1"
    if spec.rollout.engine == "vllm" and spec.cluster.procs_per_node % tp:
        yield (f"rollout.tensorParallelSize: {tp} does not divide the {spec.cluster.procs_per_node} workers "
               f"of a node (cluster.procsPerNode); a vLLM replica stays within a node: pick a divisor")
    if spec.rollout.engine == "vllm" and world % tp == 0 and batch % rollout_dp == 0 and (batch // rollout_dp) % tp:
        yield (f"data.trainBatchSize: {batch} prompts give each of the {rollout_dp} vLLM replicas "
               f"{batch // rollout_dp}, which its {tp} tp ranks cannot share evenly; use a multiple of "
               f"{rollout_dp * tp}")
    if spec.rollout.tis_imp_ratio_cap is not None and spec.rollout.engine != "vllm":
        yield ("rollout.tisImpRatioCap: only the vllm engine records rollout log-probs to correct with; "
               "unset it or use rollout.engine: vllm")
    yield from _algorithm_problems(spec)
    yield from _multi_turn_problems(spec)
    yield from _source_problems(spec)
    yield from _device_problems(spec)
    yield from _pod_resource_problems(spec)
    estimator = spec.algorithm.advantage_estimator
    if estimator in GROUP_ESTIMATORS and spec.rollout.n < 2:
        yield (f"rollout.n: {estimator} compares each response with the others of its prompt, so with "
               f"{spec.rollout.n} response per prompt every advantage is 0; sample n >= 2 (4-16 is usual)")
    if estimator in GROUP_ESTIMATORS and spec.rollout.n > 1 and spec.rollout.temperature == 0:
        yield (f"rollout.temperature: 0 is greedy, so the {spec.rollout.n} responses of a prompt are identical "
               f"and every {estimator} advantage is 0 (nothing is learned); sample with a temperature > 0 "
               f"(1.0 is usual)")


GPU_RESOURCE = "nvidia.com/gpu"
"""The accelerator resource the operator adds to each node pod from cluster.acceleratorsPerNode."""


_QUANTITY = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?", re.ASCII)
"""A Kubernetes resource quantity (k8s.io/apimachinery resource.Quantity): a number with an optional
binary (Ki, Mi, Gi, ...), decimal (m, k, M, G, ...) or exponent suffix."""
CONTAINER_RESOURCES = ("cpu", "memory", "ephemeral-storage")
"""The resource names a container may request without a domain (besides ``hugepages-<size>``);
others are extended resources named ``domain/name`` (``example.com/fpga``), in whole units."""
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _pod_resource_problems(spec: JobSpec):
    """The node pods' container resources and tolerations (Kubernetes), checked as the API server
    would check the pods the operator creates (a bad one would end the job PodCreationRejected, or,
    for a resource outside ``requests``/``limits``, be dropped and leave the pod without requests):
    ``requests``/``limits`` mappings of resource -> quantity, without the accelerator count, which
    the operator sets from ``cluster.acceleratorsPerNode`` (a second count in the template would
    disagree with the workers' device plan); tolerations with a known operator and effect."""
    sources = [("template", spec.template.resources, spec.template.tolerations)]
    if spec.async_.enable:
        pool = spec.async_.rollout_pool
        sources.append(("async.rolloutPool", pool.resources, pool.tolerations))
    for owner, resources, tolerations in sources:
        field = f"{owner}.resources"
        for key in resources:
            if key not in ("requests", "limits", "claims"):
                close = closest_choice(str(key), ("requests", "limits"))
                yield (f"{field}.{key}: did you mean {close!r}?" if close else
                       f"{field}.{key}: a container's resources have requests and limits; put it under "
                       f"requests (resources: {{requests: {{{key}: ...}}}}) or limits")
        for kind in ("requests", "limits"):
            section = resources.get(kind)
            if section is not None and not isinstance(section, dict):
                yield f"{field}.{kind}: expected a mapping of resource -> quantity, got {type(section).__name__}"
                continue
            for name, quantity in (section or {}).items():
                yield from _quantity_problems(f"{field}.{kind}.{name}", str(name), quantity)
        for i, toleration in enumerate(tolerations):
            yield from _toleration_problems(f"{owner}.tolerations[{i}]", toleration)


def _quantity_problems(path: str, name: str, quantity):
    """One container resource: a resource name a container may request, and a quantity the API server
    takes for it (non-negative; whole units for an extended resource)."""
    if name == GPU_RESOURCE:
        yield (f"{path}: set cluster.acceleratorsPerNode instead (the operator adds {GPU_RESOURCE} to every "
               f"node pod from it); remove it here")
        return
    if "/" not in name and name not in CONTAINER_RESOURCES and not name.startswith("hugepages-"):
        yield (f"{path}: {did_you_mean(name, CONTAINER_RESOURCES)}a resource without a domain is one of "
               f"{', '.join(CONTAINER_RESOURCES)} or hugepages-<size>; name others domain/name")
        return
    text = str(quantity)
    if isinstance(quantity, bool) or not _QUANTITY.fullmatch(text):
        yield (f"{path}: {quantity!r} is not a Kubernetes quantity; write a number with an optional unit, "
               f"e.g. cpu: \"2\", cpu: 500m, memory: 4Gi")
    elif text.startswith("-"):
        yield f"{path}: {quantity!r} is negative; use 0 or more"
    elif "/" in name and not name.startswith(("kubernetes.io/", "requests.")) and not _whole(text):
        yield f"{path}: {quantity!r}; an extended resource is counted in whole units: use a whole number"


def _whole(text: str) -> bool:
    """Whether a quantity (matched by ``_QUANTITY``) is a whole number of units (``1.5Ki`` is 1536)."""
    from decimal import Decimal

    match = _QUANTITY.fullmatch(text)
    value, suffix = Decimal(match.group(1)), match.group(3) or ""
    binary, decimal = "KMGTPE", {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
    if suffix.endswith("i"):
        value *= 1024 ** (binary.index(suffix[0]) + 1)
    elif suffix in decimal:
        value *= Decimal(10) ** decimal[suffix]
    elif suffix:
        value *= Decimal(10) ** int(suffix[1:])
    return value == value.to_integral_value()


def _toleration_problems(path: str, toleration: dict):
    """A pod toleration as the API server validates it (an empty operator means Equal)."""
    operator = toleration.get("operator") or "Equal"
    effect = toleration.get("effect")
    if operator not in TOLERATION_OPERATORS:
        yield f"{path}.operator: {operator!r}; {did_you_mean(str(operator), TOLERATION_OPERATORS)}use Exists or Equal"
    elif operator == "Exists" and toleration.get("value"):
        yield f"{path}.value: an Exists toleration takes no value; remove it or use operator: Equal"
    elif operator == "Equal" and not toleration.get("key"):
        yield f"{path}.key: a toleration without a key matches every taint only with operator: Exists; add a key or use Exists"
    if effect not in (None, "", *TAINT_EFFECTS):
        yield (f"{path}.effect: {effect!r}; {did_you_mean(str(effect), TAINT_EFFECTS)}use one of "
               f"{', '.join(TAINT_EFFECTS)} (or leave it out: all)")
    elif toleration.get("tolerationSeconds") is not None and effect != "NoExecute":
        yield f"{path}.tolerationSeconds: only a NoExecute toleration has one; set effect: NoExecute or remove it"


def _pool_problems(spec: JobSpec):
    """The asynchronous mode's pools: both non-empty, and what it does not combine with yet."""
    pool, nodes = spec.async_.rollout_pool, spec.cluster.num_nodes
    if pool.num_nodes >= nodes:
        fix = (f"use at most {nodes - 1}, or raise cluster.numNodes" if nodes > 1 else
               "the asynchronous mode needs at least 2 nodes (one trains, one generates): set "
               "cluster.numNodes >= 2, or async.enable: false")
        yield (f"async.rolloutPool.numNodes: {pool.num_nodes} of the job's {nodes} nodes (cluster.numNodes) "
               f"leaves none to train; {fix}")
    if spec.rollout.engine == "vllm" and spec.rollout.tensor_parallel_size != 1:
        yield (f"rollout.tensorParallelSize: {spec.rollout.tensor_parallel_size}; in the asynchronous mode each "
               "rollout worker runs its own vLLM engine with tensor parallelism 1; set it to 1 (more rollout "
               "workers give more replicas) or async.enable: false")
    if spec.algorithm.filter_groups.enable:
        yield ("async.enable: dynamic sampling (algorithm.filterGroups) regenerates within the step, which the "
               "asynchronous mode does not support yet; disable algorithm.filterGroups or set async.enable: false")
    if spec.data_plane.mode == "centralized":
        yield ("dataPlane.mode: centralized routes every edge through rank 0, which trains in the "
               "asynchronous mode; use distributed or async.enable: false")
    if spec.async_.off_policy_correction != "tis" and "tis_cap" in spec.async_.model_fields_set:
        yield (f"async.tisCap: only async.offPolicyCorrection: tis uses it (it is {spec.async_.off_policy_correction}); "
               "remove async.tisCap or set async.offPolicyCorrection: tis")
    if spec.async_.off_policy_correction == "tis" and spec.rollout.tis_imp_ratio_cap is not None:
        yield ("rollout.tisImpRatioCap: the asynchronous mode's correction has its own cap (async.tisCap); "
               "unset rollout.tisImpRatioCap")


def _multi_turn_problems(spec: JobSpec):
    """What ``rollout.multiTurn`` does not combine with yet."""
    turns = spec.rollout.multi_turn
    yield from tool_problems(turns)
    tp = spec.rollout.tensor_parallel_size
    if turns.enable and spec.rollout.engine == "vllm" and tp != 1:
        # The ranks of a tp group must call vLLM together; each rank runs as many turns as its own
        # trajectories need.
        yield (f"rollout.tensorParallelSize: {tp}; multi-turn rollouts (rollout.multiTurn.enable) run each "
               "rollout worker's turns on its own vLLM engine, which a tensor-parallel group cannot share; set "
               "it to 1 (more workers give more replicas) or rollout.multiTurn.enable: false")
    per_turn = turns.max_tokens_per_turn
    if turns.enable and per_turn is not None and per_turn > spec.data.max_response_length:
        yield (f"rollout.multiTurn.maxTokensPerTurn: {per_turn} tokens exceed the budget of all turns, "
               f"data.maxResponseLength={spec.data.max_response_length}; use at most that, or raise it")


def _source_problems(spec: JobSpec):
    """Model and data sources that would otherwise fail only once the workers load them."""
    path = spec.model.path
    if path.startswith("tiny:") and path.removeprefix("tiny:") not in TINY_TOKENIZERS:
        yield (f"model.path: {path!r} names no tiny-model tokenizer; use tiny or "
               f"tiny:<{'|'.join(TINY_TOKENIZERS)}>")
    reward = spec.data.reward_fn
    if reward is not None and reward not in BUILTIN_REWARDS and ":" not in reward:
        yield (f"data.rewardFn: unknown {reward!r}; choose one of {', '.join(BUILTIN_REWARDS)} "
               f"or give a user function as module:function (or path/to/file.py:function)")
    for name in ("train", "eval"):
        ds = getattr(spec.data, name)
        split = ds.arithmetic_split if ds is not None else None
        if split is None:
            continue
        if split not in ARITHMETIC_SPLITS:
            yield f"data.{name}.path: unknown arithmetic split {split!r}; use arithmetic:train or arithmetic:eval"
        elif name == "eval" and split == "train":
            yield "data.eval.path: arithmetic:train is the training split; hold out with arithmetic:eval"
        if ds.min_operand > ds.max_operand:
            yield (f"data.{name}.minOperand: {ds.min_operand} is above maxOperand {ds.max_operand}; "
                   f"swap them or widen the range")


def _algorithm_problems(spec: JobSpec):
    alg, batch = spec.algorithm, spec.data.train_batch_size
    mini = spec.critic.ppo_mini_batch_size
    if mini is not None and batch % mini:
        yield (f"critic.ppoMiniBatchSize: {mini} does not divide data.trainBatchSize={batch}; "
               f"use a divisor of {batch}")
    buffer = alg.overlong_buffer.length
    if alg.overlong_buffer.enable and buffer is not None and buffer > spec.data.max_response_length:
        yield (f"algorithm.overlongBuffer.length: {buffer} tokens exceed data.maxResponseLength="
               f"{spec.data.max_response_length}; use at most that")
    if alg.filter_groups.enable and spec.rollout.n < 2:
        yield ("algorithm.filterGroups.enable: a group of rollout.n=1 response never has differing "
               "scores, so every group would be dropped; set rollout.n >= 2 or disable it")
    val = spec.rollout.val
    if val.n > 1 and val.temperature == 0:
        yield (f"rollout.val.n: {val.n} responses per held-out prompt need sampling, but greedy "
               f"(temperature 0) gives one; set rollout.val.temperature > 0 or rollout.val.n: 1")
    if spec.workflow.nodes is None and spec.workflow.name == "ppo" and alg.advantage_estimator != "gae":
        yield (f"algorithm.advantageEstimator: the ppo workflow trains its critic on GAE returns, "
               f"not {alg.advantage_estimator!r}; use gae (or workflow grpo/dapo)")
    if spec.workflow.nodes is None and spec.workflow.name != "ppo" and alg.advantage_estimator == "gae":
        yield (f"algorithm.advantageEstimator: gae computes advantages from a critic's values, and the "
               f"{spec.workflow.name or 'grpo'} workflow has no critic; use workflow.name: ppo (a critic), or an "
               f"estimator without one: {', '.join(e for e in ADVANTAGE_ESTIMATORS if e != 'gae')}")


def _device_problems(spec: JobSpec):
    """FSDP2 degrees that do not tile the workers, and cuda-only settings on cpu."""
    cluster, world = spec.cluster, train_world(spec)
    replicate, shard = cluster.data_parallel_replicate_degree, cluster.data_parallel_shard_degree
    for name, degree in (("dataParallelReplicateDegree", replicate), ("dataParallelShardDegree", shard)):
        if degree is not None and world % degree:
            yield (f"cluster.{name}: {degree} does not divide the {world} workers (cluster.numNodes x "
                   f"cluster.procsPerNode); pick a divisor of {world}")
    if replicate is not None and shard is not None and replicate * shard != world:
        yield (f"cluster.dataParallelShardDegree: {replicate} replicas x {shard} shards is not the {world} "
               f"workers; set it to {world // replicate if world % replicate == 0 else 'a divisor'} or leave it unset")
    if cluster.device == "cpu" and spec.model.tf32:
        yield "model.tf32: TF32 is a cuda matmul mode; leave it unset on cluster.device: cpu"
