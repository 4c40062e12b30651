"""Counting what FSDP2 puts on the wire, by wrapping torch.distributed's collectives."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def counted_all_gathers() -> Iterator[list[int]]:
    """Inside the block, the bytes each all-gather call sends from this rank (its input's
    bytes), appended to the yielded list. FSDP2 calls ``all_gather_into_tensor`` (or
    ``all_gather_single``) by module attribute, so wrapping the attribute sees every call."""
    import torch.distributed as dist

    calls: list[int] = []
    originals = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "all_gather_single")
                 if hasattr(dist, name)}
    for name, original in originals.items():
        def counted(output, input, *args, _original=original, **kwargs):
            calls.append(input.numel() * input.element_size())
            return _original(output, input, *args, **kwargs)

        setattr(dist, name, counted)
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
