"""The job's process group: which backend serves which device, chosen in one place.

A CUDA run creates the world group with two backends, ``cpu:gloo,cuda:nccl``
(torchtitan does the same): CUDA tensors go over NCCL, CPU tensors over
gloo. An NCCL-only group fails on the first collective that is handed a CPU
tensor (metadata, counters, object collectives), and such tensors are easy to
add and invisible on the CPU runs the tests do. With both backends a
collective is served whichever device its tensors are on; the data plane
still moves its bulk on the device backend (``wire_device``).

Every process group of the runtime is created here (a unit test scans the
package for others), so no group exists that a CPU tensor cannot travel on.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.distributed_c10d import BackendConfig

CPU_BACKEND = "gloo"


def backend_for(device_type: str) -> str:
    """The process-group backend string for workers on ``device_type`` (``cpu`` or ``cuda``).

    CUDA: ``cpu:gloo,cuda:nccl``; CPU: ``gloo``.
    """
    if device_type == "cuda":
        return f"cpu:{CPU_BACKEND},cuda:nccl"
    return CPU_BACKEND


def device_backends(backend: str) -> dict[str, str]:
    """Device type -> backend name that serves it, for a backend string as ``backend_for`` gives.

    ``"nccl"`` -> ``{"cuda": "nccl"}``; ``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``.
    """
    return {device: str(name) for device, name in BackendConfig(backend).get_device_backend_map().items()}


def wire_device_type(backend: str) -> str:
    """Where the data plane keeps the tensors it moves over a group with ``backend``:
    ``cuda`` when NCCL serves CUDA tensors (it is the fast path), else ``cpu``.

    (gloo also takes CUDA tensors, but stages them through host memory.)
    """
    return "cuda" if device_backends(backend).get("cuda", "").startswith("nccl") else "cpu"


def wire_device(group=None) -> torch.device:
    """The device of the tensors the data plane moves over ``group`` (default: world)."""
    if wire_device_type(dist.get_backend(group)) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init(device: torch.device, init_method: str, rank: int, world_size: int) -> None:
    """Create the world group for workers on ``device`` (``backend_for(device.type)``)."""
    dist.init_process_group(backend_for(device.type), init_method=init_method, rank=rank,
                            world_size=world_size)


def world_store():
    """The key-value store the world group was created from: a TCPStore that rank 0 serves at
    ``MASTER_ADDR:MASTER_PORT``. A reference held by rank 0 keeps it served after the group is
    destroyed, so the ranks of the next world (``reform``) meet on it."""
    store = distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):  # init_process_group's prefixes (the rendezvous adds one)
        store = store.underlying_store
    return store


def join_store(master_addr: str, master_port: int, timeout_s: float = 300.0, attempt_s: float = 1.0):
    """A client of the job's store (``world_store``) for a process that is not in the world yet
    (a rollout worker joining the pool, ``distflow.pools.elastic``).

    It tries to connect for ``attempt_s`` seconds at a time, again and again, rather than once for
    ``timeout_s``: within one attempt torch's client backs off exponentially, so a joiner that
    loaded long before the store came up would connect seconds after it did (measured: 4.6 s
    after waiting 25 s), while the running ranks train steps of a fraction of a second. Each new
    attempt starts its back-off from the beginning, so it connects within about ``attempt_s``.

    Raises:
        RuntimeError (torch's DistStoreError): no store answered within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        attempt = min(attempt_s, max(deadline - time.monotonic(), 0.1))
        try:
            store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timedelta(seconds=attempt))
        except dist.DistError:
            if time.monotonic() >= deadline:
                raise
            continue
        store.set_timeout(timedelta(seconds=timeout_s))  # the longest a get() then waits for its key
        return store


def reform(device: torch.device, store, generation: int, rank: int, world_size: int) -> None:
    """Replace the world group by one of ``world_size`` ranks met on ``store`` (``world_store``) under
    the key prefix of ``generation`` (each world has its own, so no key of an earlier one is read).

    Collective over the new world: every rank of it calls it with the same ``generation``. Every
    group of the old world is destroyed; the caller creates its groups again (``new_group``).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(backend_for(device.type), store=dist.PrefixStore(f"distflow/world{generation}/", store),
                            rank=rank, world_size=world_size)


GENERATION_KEY = "distflow/generation"
"""Key of the job's store (``world_store``) holding the generation of the world that runs now (0:
the first): every world a resize re-forms in place meets under a prefix of its own (``reform``)."""


def world_key(generation: int, name: str) -> str:
    """A key of world ``generation``'s rendezvous: ``ready`` (joiners registered for it, a counter)
    or ``go`` (its size once the running ranks form it; 0: it formed without joiners)."""
    return f"distflow/world{generation}/{name}"


def announce_world(store, generation: int, joiners_world_size: int) -> None:
    """Rank 0 of the running world, forming world ``generation``: publish it, and wake the
    registered joiners with the size it takes them at (0: it formed without them; they register
    for the next)."""
    store.set(GENERATION_KEY, str(generation))
    store.set(world_key(generation, "go"), str(joiners_world_size))


def wait_to_join(store, world_size: int, rank: int, what: str, timeout_s: float = 3600.0,
                 wanted=lambda: True) -> int | None:
    """A process outside the world (a joiner): register as ready for the next world, and wait until
    the running ranks form one that takes it. Returns that world's generation (then ``reform``), or
    None once ``wanted()`` is False (checked every 0.2 s while it waits: the resize it was started for
    was withdrawn); it then takes its registration back, so no world counts it.

    Args:
        store: the job's store (``join_store``).
        world_size: the size of the world this process was started for (PET_NNODES x procsPerNode).
        what: what it joins, for the log line (``the rollout pool``, ``the gang``).

    Raises:
        RuntimeError: no world took it within ``timeout_s`` seconds, or one of another size did (the
            request and this pod's PET_NNODES disagree).
    """
    deadline = time.monotonic() + timeout_s
    current = int(store.get(GENERATION_KEY))
    if current and store.check([world_key(current, "go")]) and int(store.get(world_key(current, "go"))) == world_size:
        # The running ranks formed the world of this size already, counting a registration that is not
        # this worker's (a joiner deleted before it joined, when a resize was withdrawn): they wait for
        # this rank in that world's rendezvous, so it joins it.
        return current
    while True:
        generation = int(store.get(GENERATION_KEY)) + 1
        store.add(world_key(generation, "ready"), 1)
        print(f"distflow: rank {rank} is ready to join {what} (world {generation})", flush=True)
        key = world_key(generation, "go")
        while not store.check([key]):  # polled: a store's own wait has one fixed timeout
            if not wanted():
                store.add(world_key(generation, "ready"), -1)
                if not store.check([key]):  # else the world formed meanwhile, counting it: join it
                    return None
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: no running world took this worker in {timeout_s:.0f} s "
                                   f"(store key {key} never set)")
            time.sleep(0.2)
        go = int(store.get(key))
        if go == world_size:
            return generation
        if go != 0:
            raise RuntimeError(f"rank {rank}: world {generation} formed with {go} workers, not the "
                               f"{world_size} this worker was started for (PET_NNODES)")


def leave() -> None:
    """Destroy this process's groups without a collective (a rank leaving the world)."""
    if dist.is_initialized():
        dist.destroy_process_group()


_POOL_GROUP = None


def new_group(ranks: list[int]):
    """A process group of ``ranks`` (collective over the world: every rank creates every group,
    in the same order), on the world's backend."""
    return dist.new_group(ranks)


def set_pool_group(group) -> None:
    """The group of this worker's pool (``distflow.pools``): the ranks that run the same part of
    the plan at the same time. The chain's own collectives (metric reductions, loss
    normalizers, micro-batch counts) run over it; None (sync mode): the world group."""
    global _POOL_GROUP
    _POOL_GROUP = group


def pool_group():
    """The group set by ``set_pool_group`` (None: the world group)."""
    return _POOL_GROUP


def pool_size() -> int:
    """Ranks of this worker's pool (1 without a process group)."""
    return dist.get_world_size(_POOL_GROUP) if dist.is_initialized() else 1


class CollectiveBytes:
    """Bytes of the all-gathers and reduce-scatters this process has run (FSDP2's weight
    gathers and gradient reductions, and any other caller's), counted at the call.

    ``all_gather``: bytes of the gathered outputs (the full tensors, in the dtype they were
    gathered in); ``reduce_scatter``: bytes of the reduced inputs (the full gradients).
    Monotonic; take differences around the work to measure.
    """

    def __init__(self) -> None:
        self.all_gather = 0
        self.reduce_scatter = 0


def max_over_ranks(value: int) -> int:
    """The largest ``value`` of any rank of this worker's pool (``pool_group``; an all-reduce
    MAX of a CPU tensor, which gloo serves on CPU and CUDA runs alike: no device sync);
    ``value`` itself without a group of two or more."""
    if pool_size() < 2:
        return value
    buf = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=_POOL_GROUP)
    return int(buf)


_COUNTER: CollectiveBytes | None = None
# torch.distributed's names for the two collectives across versions (FSDP2 calls them through
# the module attribute, so the wrapper sees every call; each alias calls distributed_c10d's
# function directly, so no call is counted twice).
_ALL_GATHERS = ("all_gather_into_tensor", "all_gather_single")
_REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")


def collective_bytes() -> CollectiveBytes:
    """The process's counter, installing the counting wrappers on first use (idempotent)."""
    global _COUNTER
    if _COUNTER is None:
        counter = CollectiveBytes()
        for name in _ALL_GATHERS + _REDUCE_SCATTERS:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, _counting(original, counter, name in _ALL_GATHERS))
        _COUNTER = counter
    return _COUNTER


def _counting(original, counter: CollectiveBytes, gather: bool):
    @functools.wraps(original)
    def counted(*args, **kwargs):
        # (output, input, ...) positionally, or by keyword: output(_tensor)=, input(_tensor)=
        if gather:
            out = args[0] if args else kwargs.get("output_tensor", kwargs.get("output"))
            counter.all_gather += out.numel() * out.element_size()
        else:
            inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
            counter.reduce_scatter += inp.numel() * inp.element_size()
        return original(*args, **kwargs)

    return counted
