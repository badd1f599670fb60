"""How a node's process reuses the memory it frees.

Every round a node receives its payloads as multi-MB frames (a part of 1M elements is 2-4 MB) and makes fresh
payloads for what it sends; they live for a moment and are freed. With glibc's defaults, a block that large is
a fresh mapping, or comes from the top of the heap, which is handed back to the kernel once more than a few MB
of it is free; either way the next round's blocks fault their pages in again: about 7,300 page faults a round
for 15 frames of 2 MB alive at once (``tests/test_memory.py``; the 30 MB a member of a group of 4 receives with
10M fp16 elements), and about 10 ms more of a peer's CPU a round in ``benchmarks/bench_allreduce.py`` (four
peers on two cores). ``reuse_freed_memory`` asks glibc to serve blocks below ``REUSE_BELOW`` from the heap and
to keep up to ``KEEP_FREE`` of free heap for the next round instead. The averager's scratch pool does the same
for its own big buffers; this is for the bytes the transport and codecs allocate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

REUSE_BELOW = 32 << 20
"""Blocks below this many bytes come from the heap, not a mapping of their own."""
KEEP_FREE = 256 << 20
"""Free memory at the top of the heap up to this many bytes is kept for reuse, not returned to the kernel."""

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def reuse_freed_memory() -> bool:
    """Keep freed multi-MB blocks for reuse (see the module docstring). Call it once, early in a process that
    runs a node. Returns False where the C library is not glibc (musl, macOS): nothing changes there."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.debug("no mallopt in this C library: freed memory is handled by its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, REUSE_BELOW)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREE))
