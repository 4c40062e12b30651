"""Workflow DAG -> execution plan: the control plane every worker computes itself.

    workflow (DAG of nodes)            plan (same on every rank)
    ----------------------            -------------------------------------------
    rollout -> reward -> advantage    task chain: rollout, reward, advantage, ...
         \\-> reference ---\\           placements: where each node's data lives
                       actor_update   edges: local cache (0 bytes) or redistribute

A *placement* says how a step's samples are laid out over the ranks when a
node runs: ``rollout`` (each rollout dp rank keeps what it generated, so GRPO
groups stay whole) or ``train`` (the train layout, balanced by token cost when
``dataPlane.balance`` is on). An edge whose two ends share a placement moves
zero bytes (local cache); any other edge is a redistribution.

Planning is pure and deterministic: the same spec gives the same plan on every
rank, so no rank needs to tell another what to do. Only metadata (lengths)
crosses ranks at run time.

Simplified on purpose: one rollout layout and one train layout per job (actor,
reference and critic share the FSDP mesh), which is what colocated GRPO/PPO
use. Per-node options are passed through untouched to the node's handler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from distflow.errors import DistflowConfigError
from distflow.fields import producers
from distflow.spec import BUILTIN_WORKFLOWS, GROUP_ESTIMATORS, NODE_ROLES, JobSpec, WorkflowNodeSpec

ROLLOUT = "rollout"
TRAIN = "train"


@dataclass(frozen=True)
class Layout:
    """How ranks are arranged for one placement."""

    name: str
    dp_size: int
    tp_size: int
    balanced: bool
    first_rank: int = 0
    """Its ranks are ``first_rank .. first_rank + dp_size * tp_size - 1`` (a pool; 0: every rank)."""

    @property
    def num_ranks(self) -> int:
        return self.dp_size * self.tp_size

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` runs this layout's nodes."""
        return self.first_rank <= rank < self.first_rank + self.num_ranks

    def dp_rank(self, rank: int) -> int:
        """The dp rank of a global rank (tp ranks of one replica are contiguous)."""
        return (rank - self.first_rank) // self.tp_size


@dataclass(frozen=True)
class PlannedNode:
    id: str
    role: str
    kind: str
    deps: tuple[str, ...]
    placement: str
    function: str | None = None
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class PlannedEdge:
    src: str
    dst: str
    local_cache: bool
    """True: producer and consumer placements match, zero bytes move."""


@dataclass(frozen=True)
class Plan:
    chain: tuple[PlannedNode, ...]
    """Nodes in the order every worker runs them."""
    edges: tuple[PlannedEdge, ...]
    layouts: dict[str, Layout] = field(hash=False, compare=True)
    world_size: int = 1
    num_nodes: int = 1
    staleness: int | None = None
    """``async.maxStaleness`` when the job trains on two pools (``distflow.pools``), else None."""

    @property
    def pooled(self) -> bool:
        """Whether rollout and training run on separate pools of ranks (``async.enable``)."""
        return self.staleness is not None

    def node(self, node_id: str) -> PlannedNode:
        return next(n for n in self.chain if n.id == node_id)

    def node_of_rank(self, rank: int) -> int:
        """The node (pod) a global rank lives on."""
        return rank // (self.world_size // self.num_nodes)

    def describe(self) -> str:
        """A human-readable rendering (what `distflow plan` prints)."""
        per_node = self.world_size // self.num_nodes
        lines = [f"world size {self.world_size} = {self.num_nodes} nodes x {per_node} workers"]
        if self.pooled:
            lines.append(f"asynchronous: maxStaleness={self.staleness} (the rollout pool runs up to "
                         f"{self.staleness} step{'s' if self.staleness != 1 else ''} ahead of the trainer pool; "
                         "the samples cross once per step, at the first train node)")
        def span(noun: str, first: int, last: int) -> str:
            return f"{noun} {first}" if first == last else f"{noun}s {first}-{last}"

        for lay in self.layouts.values():
            where = ""
            if self.pooled:
                last = lay.first_rank + lay.num_ranks - 1
                where = (f" pool={'trainer' if lay.name == TRAIN else 'rollout':7s} {span('rank', lay.first_rank, last)} "
                         f"{span('node', lay.first_rank // per_node, last // per_node)}")
            lines.append(f"layout {lay.name:8s} dp={lay.dp_size} tp={lay.tp_size} "
                         f"balanced={'yes' if lay.balanced else 'no ':3s}{where}")
        lines.append("task chain:")
        widths = [max(len(getattr(n, key)) for n in self.chain) for key in ("id", "role", "kind", "placement")]
        number = len(str(len(self.chain) - 1))
        for i, n in enumerate(self.chain):
            deps = ", ".join(n.deps) or "-"
            lines.append(f"  {i:>{number}}. {n.id:{widths[0]}s} role={n.role:{widths[1]}s} "
                         f"kind={n.kind:{widths[2]}s} placement={n.placement:{widths[3]}s} deps={deps}")
        lines.append("edges:")
        placement = {n.id: n.placement for n in self.chain}
        for e in self.edges:
            how = "local-cache" if e.local_cache else "redistribute"
            if self.pooled and placement[e.src] != placement[e.dst]:
                balanced = ", token-balanced" if self.layouts[placement[e.dst]].balanced else ""
                how += f" (cross-pool: rollout ranks -> trainer ranks{balanced})"
            lines.append(f"  {e.src} -> {e.dst}: {how}")
        return "\n".join(lines)


def same_samples(a: Layout, b: Layout) -> bool:
    """Whether two layouts put every sample on the same dp rank (then an edge moves nothing)."""
    if a == b:
        return True
    return (not a.balanced and not b.balanced and a.dp_size == b.dp_size and a.tp_size == b.tp_size
            and a.first_rank == b.first_rank)


def _node(id_, role, kind, deps=(), **options) -> WorkflowNodeSpec:
    return WorkflowNodeSpec(id=id_, role=role, kind=kind, deps=list(deps), options=options)


def builtin_workflow(name: str, spec: JobSpec) -> list[WorkflowNodeSpec]:
    """The node list of a built-in workflow.

    grpo/dapo: rollout -> reward -> advantage; rollout -> reference; both -> actor.
    ppo adds a critic: values before GAE, the critic update after it.

        rollout -> reward -> [dynamic_sampling] -> [reward_shaping] -> advantage -> [critic_update]
                                   +-> reference, [old_log_prob], [values] -----+-> actor_update

    Optional nodes come from the algorithm: ``dynamic_sampling`` with
    ``filterGroups`` (dapo's default; every model pass then depends on it,
    since it replaces samples); ``reward_shaping`` with ``overlongBuffer`` or
    ``useKlInReward``; the reference with either KL use; the old-log-prob
    pass when the actor takes several optimizer steps per batch (otherwise
    the ratio is exactly 1 and it would be wasted) or KL is in the reward.

    Raises:
        DistflowConfigError: unknown name.
    """
    if name not in BUILTIN_WORKFLOWS:
        raise DistflowConfigError(
            f"spec.workflow.name: unknown workflow {name!r}; choose one of {', '.join(BUILTIN_WORKFLOWS)} "
            "or give spec.workflow.nodes")
    alg = spec.algorithm
    nodes = [_node("rollout", "rollout", "inference"),
             _node("reward", "reward", "compute", ["rollout"])]
    samples, scored = "rollout", "reward"
    if alg.filter_groups.enable:
        nodes.append(_node("dynamic_sampling", "filter_groups", "compute", ["reward"]))
        samples = scored = "dynamic_sampling"
    actor_deps = ["advantage"]
    if alg.use_kl_loss or alg.use_kl_in_reward:
        nodes.append(_node("reference", "reference", "inference", [samples]))
        actor_deps += ["reference"] if alg.use_kl_loss else []
    if _needs_old_log_probs(spec) or alg.use_kl_in_reward:
        nodes.append(_node("old_log_prob", "old_log_prob", "inference", [samples]))
        actor_deps.append("old_log_prob")
    adv_deps = []
    if name == "ppo":
        nodes.append(_node("values", "values", "inference", [samples]))
        adv_deps.append("values")
    if alg.overlong_buffer.enable or alg.use_kl_in_reward:
        kl_deps = ["reference", "old_log_prob"] if alg.use_kl_in_reward else []
        nodes.append(_node("reward_shaping", "reward_shaping", "compute", [scored, *kl_deps]))
        scored = "reward_shaping"
    nodes.append(_node("advantage", "advantage", "compute", [scored, *adv_deps]))
    if name == "ppo":
        nodes.append(_node("critic_update", "critic", "train", ["advantage"]))
    nodes.append(_node("actor_update", "actor", "train", actor_deps))
    return nodes


def _needs_old_log_probs(spec: JobSpec) -> bool:
    """Several optimizer steps per batch, or stale samples to correct (``async.offPolicyCorrection:
    tis`` weighs by the trainer's policy before the update over the rollout's)."""
    mini = spec.actor.ppo_mini_batch_size or spec.data.train_batch_size
    stale = spec.async_.enable and spec.async_.max_staleness > 0 and spec.async_.off_policy_correction == "tis"
    return spec.actor.ppo_epochs > 1 or mini < spec.data.train_batch_size or stale


RESERVED_NODE_IDS = {
    "step": "the step's own time (timing_s/step: the step duration and throughput)",
    "weight_sync": "the weight sync's time (timing_s/weight_sync)",
}
"""Stage names the runtime times itself: a node of that id would overwrite them (a node's time is
``timing_s/<id>``, exported as ``distflow_stage_duration_seconds{stage="<id>"}``)."""
POOL_STAGE_IDS = {
    "generate": "the rollout pool's time per step in async mode (timing_s/generate, read by autoscalers)",
    "train": "the trainer pool's time per step in async mode (timing_s/train, read by autoscalers)",
}
"""Stage names reserved with ``async.enable`` (``distflow.pools``)."""


def _validate_nodes(nodes: list[WorkflowNodeSpec], pooled: bool = False) -> list[str]:
    problems = []
    ids = [n.id for n in nodes]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"spec.workflow.nodes: id {dup!r} is used twice; give each node a unique id")
    known = set(ids)
    reserved = {**RESERVED_NODE_IDS, **(POOL_STAGE_IDS if pooled else {})}
    for i, n in enumerate(nodes):
        path = f"spec.workflow.nodes[{i}]"
        if n.id in reserved:
            problems.append(f"{path}.id: {n.id!r} names {reserved[n.id]}; rename the node "
                            f"(e.g. {n.role}_{n.id}) and the deps that name it")
        if n.role not in NODE_ROLES:
            problems.append(f"{path}.role: unknown role {n.role!r}; choose one of {', '.join(NODE_ROLES)}")
        for d in n.deps:
            if d not in known:
                problems.append(f"{path}.deps: {d!r} is not a node id; known ids: {', '.join(ids)}")
        if n.role == "custom" and not n.function:
            problems.append(f"{path}.function: a custom node needs `module:function`")
        if n.role == "rollout" and n.kind != "inference":
            problems.append(f"{path}.kind: a rollout node is kind inference")
    if sum(n.role == "rollout" for n in nodes) != 1:
        problems.append("spec.workflow.nodes: exactly one node must have role rollout")
    if not any(n.role == "actor" and n.kind == "train" for n in nodes):
        problems.append("spec.workflow.nodes: no node trains the actor (role actor, kind train)")
    if any(n.role == "critic" for n in nodes) and not any(n.role == "values" for n in nodes):
        problems.append("spec.workflow.nodes: a critic node needs a values node (the rollout-time "
                        "values it clips around); add one with role values")
    return problems + _filter_problems(nodes)


def _reads(role: str, spec: JobSpec) -> list[tuple[str, ...]]:
    """The fields a node of ``role`` reads: for each read, the fields any of which will do
    (the first names it); their producers are declared in ``distflow.fields``."""
    alg = spec.algorithm
    kl_in_reward = [("ref_log_probs",), ("old_log_probs",)] if alg.use_kl_in_reward else []
    reads = {
        "filter_groups": [("scores",)],
        "reward_shaping": [("scores",)] + kl_in_reward,
        # shaped rewards when a reward_shaping node ran, else the scores
        "advantage": [("token_level_scores", "token_level_rewards")]
        + ([("values",)] if alg.advantage_estimator == "gae" else []),
        "critic": [("values",), ("returns",)],
        "actor": [("advantages",)]
        + ([("ref_log_probs",)] if alg.use_kl_loss else [])
        + ([("old_log_probs",)] if _needs_old_log_probs(spec) else []),
    }
    return reads.get(role, [])


def _upstream(deps: dict[str, list[str]], node_id: str) -> set[str]:
    """Ids of every node ``node_id`` depends on, directly or not (cycle-safe)."""
    seen: set[str] = set()
    todo = list(deps.get(node_id, ()))
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo.extend(deps.get(d, ()))
    return seen


def _data_problems(nodes: list[WorkflowNodeSpec], spec: JobSpec) -> list[str]:
    """Every field a node reads must come from a node it depends on (directly or not).

    The rollout's samples must reach every node. Below a custom node anything
    may have been produced, so only the rollout is checked there.
    """
    deps = {n.id: n.deps for n in nodes}
    role_of = {n.id: n.role for n in nodes}
    problems = []
    for i, n in enumerate(nodes):
        if n.role == "rollout":
            continue
        path = f"spec.workflow.nodes[{i}] ({n.id})"
        roles = {role_of[u] for u in _upstream(deps, n.id) if u in role_of}
        if "rollout" not in roles:
            problems.append(f"{path}.deps: nothing it depends on leads to the rollout node, so it has no "
                            "samples; add the rollout node (or a node after it) to its deps")
            continue
        if "custom" in roles:
            continue
        for read in _reads(n.role, spec):
            roles_producing = producers(*read)
            if not roles & set(roles_producing):
                problems.append(f"{path}.deps: role {n.role} reads {read[0]}, which no node it depends on "
                                f"produces; add a node with role {' or '.join(roles_producing)} to its deps "
                                "(directly or through another node)")
    return problems


def _filter_problems(nodes: list[WorkflowNodeSpec]) -> list[str]:
    """A filter_groups node replaces the step's samples: every node not upstream of it must run after it."""
    deps = {n.id: n.deps for n in nodes}
    problems = []
    for f in (n for n in nodes if n.role == "filter_groups"):
        before = _upstream(deps, f.id)
        for n in nodes:
            if n.id != f.id and n.id not in before and f.id not in _upstream(deps, n.id):
                problems.append(f"spec.workflow.nodes: {n.id!r} must depend (directly or not) on the "
                                f"filter_groups node {f.id!r}, which replaces the step's samples")
    return problems


def find_cycle(deps: Mapping[str, Sequence[str]]) -> list[str] | None:
    """A dependency cycle ``[a, b, ..., a]`` of the graph ``deps`` (node -> what it depends on), or None.

    Depth-first, in the order of ``deps`` and of each node's dependencies, so the
    same graph always names the same cycle.
    """
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for d in deps.get(v, []):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (cyc := visit(d)):
                return cyc
        state[v] = 2
        stack.pop()
        return None

    for v in deps:
        if v not in state and (cyc := visit(v)):
            return cyc
    return None


def _placement(node: WorkflowNodeSpec, spec: JobSpec, placed: dict[str, str]) -> str:
    if node.role == "rollout":
        return ROLLOUT
    if node.kind == "train" or node.role in ("reference", "old_log_prob", "values"):
        return TRAIN
    if node.role in ("reward", "filter_groups"):
        return ROLLOUT  # ground truths stay where the prompts were read; groups stay whole
    if node.role == "advantage" and spec.algorithm.advantage_estimator in GROUP_ESTIMATORS:
        return ROLLOUT
    if "placement" in node.options:
        return str(node.options["placement"])
    if node.role in ("advantage", "reward_shaping"):
        # No group statistics: run where the data already is, rather than move it back.
        return TRAIN if any(placed.get(d) == TRAIN for d in node.deps) else ROLLOUT
    first = node.deps[0] if node.deps else None
    return placed.get(first, ROLLOUT)


def _linearise(nodes: list[WorkflowNodeSpec], placement: dict[str, str]) -> list[WorkflowNodeSpec]:
    """Kahn's algorithm; among ready nodes prefer the current placement, then declaration order.

    Preferring the current placement batches nodes that share a layout, so
    data changes layout as few times as possible.
    """
    order = {n.id: i for i, n in enumerate(nodes)}
    by_id = {n.id: n for n in nodes}
    indeg = {n.id: len(set(n.deps)) for n in nodes}
    users: dict[str, list[str]] = {n.id: [] for n in nodes}
    for n in nodes:
        for d in set(n.deps):
            users[d].append(n.id)
    current = ROLLOUT
    ready = [n.id for n in nodes if indeg[n.id] == 0]
    chain = []
    while ready:
        ready.sort(key=lambda i: (placement[i] != current, order[i]))
        nid = ready.pop(0)
        chain.append(by_id[nid])
        current = placement[nid]
        for u in users[nid]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    return chain


def build_plan(spec: JobSpec) -> Plan:
    """Validate the workflow and compute the plan every rank runs.

    Raises:
        DistflowConfigError: cycles, unknown roles, missing dependencies,
            sizes that do not divide.
    """
    wf = spec.workflow
    nodes = list(wf.nodes) if wf.nodes is not None else builtin_workflow(wf.name or "grpo", spec)
    problems = _validate_nodes(nodes, pooled=spec.async_.enable)
    if problems:
        raise DistflowConfigError(problems)
    if cycle := find_cycle({n.id: list(n.deps) for n in nodes}):
        raise DistflowConfigError(
            f"spec.workflow.nodes: cycle {' -> '.join(cycle)}; a workflow must be acyclic")
    if problems := _data_problems(nodes, spec):
        raise DistflowConfigError(problems)
    world = spec.world_size
    tp = spec.rollout.tensor_parallel_size
    layouts = {
        ROLLOUT: Layout(ROLLOUT, world // tp, tp, balanced=False),
        TRAIN: Layout(TRAIN, world, 1, balanced=spec.data_plane.balance and world > 1),
    }
    if spec.async_.enable:
        rollout_ranks = spec.async_.rollout_pool.num_nodes * spec.cluster.procs_per_node
        trainers = world - rollout_ranks
        layouts = {  # the trainer pool first: rank 0 (logging, checkpoints) trains
            ROLLOUT: Layout(ROLLOUT, rollout_ranks // tp, tp, balanced=False, first_rank=trainers),
            TRAIN: Layout(TRAIN, trainers, 1, balanced=spec.data_plane.balance, first_rank=0),
        }
    placement: dict[str, str] = {}
    for n in _topological(nodes):
        placement[n.id] = _placement(n, spec, placement)
        if placement[n.id] not in layouts:
            raise DistflowConfigError(
                f"spec.workflow.nodes[{n.id}].options.placement: unknown {placement[n.id]!r}; "
                f"choose {ROLLOUT} or {TRAIN}")
    chain = _linearise(nodes, placement)
    planned = tuple(PlannedNode(n.id, n.role, n.kind, tuple(n.deps), placement[n.id],
                                n.function, dict(n.options)) for n in chain)
    edges = tuple(PlannedEdge(d, n.id, same_samples(layouts[placement[d]], layouts[n.placement]))
                  for n in planned for d in n.deps)
    if spec.async_.enable and (problems := _pool_problems(planned)):
        raise DistflowConfigError(problems)
    return Plan(planned, edges, layouts, world_size=world, num_nodes=spec.cluster.num_nodes,
                staleness=spec.async_.max_staleness if spec.async_.enable else None)


def _pool_problems(chain: Sequence[PlannedNode]) -> list[str]:
    """With two pools the chain must be a rollout part, then a trainer part: the samples cross
    from the rollout pool to the trainer pool once per step, and never back."""
    problems = []
    first_train = next((i for i, n in enumerate(chain) if n.placement == TRAIN), None)
    if first_train is None:
        return ["spec.async.enable: no node of the workflow trains (placement train); "
                "the trainer pool would have nothing to do"]
    for n in chain[first_train:]:
        if n.placement != TRAIN:
            problems.append(f"spec.async.enable: node {n.id!r} (role {n.role}) needs the rollout placement after "
                            f"{chain[first_train].id!r} has moved the samples to the trainer pool; "
                            "with two pools the samples cross once per step (run it before, or set "
                            "async.enable: false)")
    for n in chain[:first_train]:
        if n.role == "filter_groups":
            problems.append(f"spec.async.enable: node {n.id!r} (dynamic sampling, algorithm.filterGroups) regenerates "
                            "within the step, which the asynchronous mode does not support yet; disable "
                            "algorithm.filterGroups or set async.enable: false")
    return problems


def _topological(nodes: list[WorkflowNodeSpec]) -> list[WorkflowNodeSpec]:
    by_id = {n.id: n for n in nodes}
    done: dict[str, WorkflowNodeSpec] = {}

    def visit(n: WorkflowNodeSpec) -> None:
        for d in n.deps:
            if d not in done:
                visit(by_id[d])
        done.setdefault(n.id, n)

    for n in nodes:
        visit(n)
    return list(done.values())

