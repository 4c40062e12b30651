"""Versioned, bucketed weight sync from the trainer pool to the rollout pool.

    trainer ranks (FSDP2 shards)            rollout ranks (a full replica each)
    for each bucket of parameters:
      full_tensor() of each (all-gather over the trainer pool, in the replica's dtype)
      trainer rank 0 packs the bucket  --broadcast (sync group: trainer 0 + rollout ranks)-->  unpack, copy_
    the version (optimizer steps taken) goes first, so a replica knows what it holds

One bucket is in flight at a time: beyond its own shards, a trainer rank holds
at most one bucket of full parameters (``rollout.weightSyncBucketMb``), and a
rollout rank its replica plus one bucket; no rank ever holds a second full
copy of the model. With ``rollout.engine: vllm`` the replica is the engine's
(in its own process): the rollout rank forwards each bucket into it
(``VllmRollout.load_weight_buckets``) and knows the parameters' names and
shapes from a model on the meta device. The broadcast runs over the job's device collective (NCCL
on GPU, gloo on CPU). The bucket layout is a pure function of the parameter
list, so sender and receivers agree on it without exchanging it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Bucket:
    """Parameters sent in one broadcast: indices into the parameter list, and the total elements."""

    params: tuple[int, ...]
    numel: int


def plan_buckets(numels: Sequence[int], element_size: int, bucket_bytes: int) -> list[Bucket]:
    """Consecutive parameters grouped into buckets of at most ``bucket_bytes`` (bytes).

    A parameter larger than a bucket gets a bucket of its own (it is sent whole).

    Args:
        numels: elements of each parameter, in ``named_parameters`` order.
        element_size: bytes per element of the dtype sent.
        bucket_bytes: the bound (> 0).

    Raises:
        ValueError: ``bucket_bytes`` or ``element_size`` not positive.
    """
    if bucket_bytes <= 0 or element_size <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} and element_size={element_size} must be > 0")
    buckets, current, size = [], [], 0
    for i, n in enumerate(numels):
        if current and (size + n) * element_size > bucket_bytes:
            buckets.append(Bucket(tuple(current), size))
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(Bucket(tuple(current), size))
    return buckets


class WeightSync:
    """The trainer pool's weights into every rollout replica, with their version.

    Collective: every rank of the trainer pool calls ``send`` (the all-gathers of
    FSDP2 shards need them all) and every rollout rank ``receive``, the same
    number of times, in the same order.

    Args:
        group: the sync group: the trainer pool's first rank (``src``) and every rollout rank.
        src: global rank that broadcasts (the trainer pool's first).
        dtype: the replicas' parameter dtype (the compute dtype): what is sent.
        bucket_bytes: bound of one broadcast, bytes.
        device: where buckets are built (the worker's device: NCCL moves CUDA tensors).
    """

    def __init__(self, group, src: int, dtype: torch.dtype, bucket_bytes: int, device: torch.device) -> None:
        self.group, self.src, self.dtype = group, src, dtype
        self.bucket_bytes, self.device = bucket_bytes, device
        self.bytes_sent = 0
        """Bytes broadcast so far (payload, by the source)."""

    def _buckets(self, model: torch.nn.Module) -> tuple[list, list[Bucket]]:
        params = list(model.parameters())
        return params, plan_buckets([p.numel() for p in params], self.dtype.itemsize, self.bucket_bytes)

    @torch.no_grad()
    def send(self, actor_model: torch.nn.Module, version: int) -> int:
        """Trainer ranks: broadcast ``actor_model``'s full weights as ``version``; bytes sent
        (0 on the trainer ranks other than ``src``, which only take part in the all-gathers)."""
        is_src = dist.get_rank() == self.src
        if is_src:
            dist.broadcast(torch.tensor([version], dtype=torch.int64, device=self.device), self.src,
                           group=self.group)
        params, buckets = self._buckets(actor_model)
        sent = 0
        for bucket in buckets:
            flat = torch.empty(bucket.numel, dtype=self.dtype, device=self.device) if is_src else None
            offset = 0
            for i in bucket.params:
                data = params[i].data.to(self.dtype)
                full = data.full_tensor() if isinstance(data, DTensor) else data
                if is_src:
                    flat[offset: offset + full.numel()].copy_(full.reshape(-1))
                offset += full.numel()
                del full
            if is_src:
                dist.broadcast(flat, self.src, group=self.group)
                sent += flat.numel() * flat.element_size()
        self.bytes_sent += sent
        return sent

    @torch.no_grad()
    def receive(self, replica: torch.nn.Module,
                load_buckets: Callable[[Iterable["ReceivedBucket"]], object] | None = None) -> int:
        """Rollout ranks: the next broadcast; its version.

        Args:
            replica: the model whose ``named_parameters`` order the buckets follow. Without
                ``load_buckets`` the weights are copied into its parameters; with it, it only
                gives names and shapes (it may be on the meta device).
            load_buckets: takes the received buckets, an iterator of ``ReceivedBucket`` to
                consume to its end (each draw is a broadcast; one that lets go of a bucket
                before drawing the next holds one at a time), e.g. a vLLM engine's
                ``load_weight_buckets``.
        """
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(version, self.src, group=self.group)
        buckets = self._received(replica)
        if load_buckets is not None:
            load_buckets(buckets)
        else:
            params = dict(replica.named_parameters())
            for bucket in buckets:
                for name, tensor in bucket.tensors():
                    params[name].data.copy_(tensor)
                del bucket, tensor  # released before the next broadcast allocates its bucket
        return int(version.item())

    def _received(self, replica: torch.nn.Module) -> Iterator["ReceivedBucket"]:
        """The buckets of one sync, each received (broadcast) when drawn."""
        named = list(replica.named_parameters())
        for bucket in plan_buckets([p.numel() for _, p in named], self.dtype.itemsize, self.bucket_bytes):
            flat = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            dist.broadcast(flat, self.src, group=self.group)
            yield ReceivedBucket(flat, tuple(named[i][0] for i in bucket.params),
                                 tuple(tuple(named[i][1].shape) for i in bucket.params))
            del flat  # one bucket held at a time: the next is allocated after the consumer let go of this one


@dataclass(frozen=True)
class ReceivedBucket:
    """One broadcast as a rollout rank receives it: consecutive parameters, packed."""

    flat: torch.Tensor
    """[numel] the parameters' elements, one after another, in the sync dtype."""
    names: tuple[str, ...]
    """Their names (``named_parameters`` of the trainer's model: checkpoint names)."""
    shapes: tuple[tuple[int, ...], ...]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view of ``flat`` in the parameter's shape), in order."""
        offset = 0
        for name, shape in zip(self.names, self.shapes):
            numel = math.prod(shape)
            yield name, self.flat[offset: offset + numel].view(shape)
            offset += numel
