"""The C library's allocator, tuned for a worker's large, short-lived tensors (glibc only)."""

from __future__ import annotations

import ctypes
import os


def release_freed_memory() -> None:
    """Return the full-size load copies (freed after sharding) to the OS.

    glibc keeps freed arenas mapped; without this a worker's resident memory
    keeps the unsharded weights it loaded (about one model copy per model).
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_M_MMAP_THRESHOLD = -3  # mallopt(3) parameter, glibc <malloc.h>


def configure_malloc(environ=os.environ) -> int:
    """Fix glibc's mmap threshold when ``DISTFLOW_MMAP_THRESHOLD`` (bytes) asks for it.

    glibc raises its threshold every time it frees an mmapped block (up to
    32 MiB); after that, activations, FSDP all-gather buffers and gradients
    come from the heap, which fragments and keeps what they free resident. On
    the quickstart (SmolLM2-135M, 2 CPU workers) a worker peaked at 3.9 GiB
    resident with glibc's default and at 2.9 GiB with
    ``DISTFLOW_MMAP_THRESHOLD=524288`` (512 KiB, which also turns the dynamic
    adjustment off). The price: every large allocation is a fresh mapping
    whose pages fault in, and the actor update took 11 s instead of 6.5 s.
    So it is off by default: a memory-for-speed trade for memory-bound nodes.

    Left alone when glibc is configured already (``MALLOC_MMAP_THRESHOLD_``,
    or ``mmap_threshold`` in ``GLIBC_TUNABLES``) and on other C libraries.

    Returns:
        The threshold set, or 0 when none was.
    """
    raw = environ.get("DISTFLOW_MMAP_THRESHOLD", "").strip()
    if not raw or "MALLOC_MMAP_THRESHOLD_" in environ or "mmap_threshold" in environ.get("GLIBC_TUNABLES", ""):
        return 0
    threshold = int(raw)
    if threshold <= 0:
        return 0
    try:
        ok = ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):  # not glibc
        return 0
    return threshold if ok == 1 else 0
