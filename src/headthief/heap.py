"""glibc's heap thresholds, set for numpy's temporaries of a few megabytes (:func:`keep_freed_memory`).

glibc serves an allocation above its mmap threshold (128 KiB in a fresh process) by a fresh ``mmap`` and unmaps
it when it is freed, so every such array costs page faults again on first touch. It raises that threshold by
itself (to at most 32 MiB, the trim threshold to twice it) only once a block that large has been freed. The
block method's refits allocate temporaries of 1 - 10 MB in every evaluation of their loss, thousands of times.
Measured on this project's 2-core machine (the block refit R of ``bert-block:d=16,heads=4,ffn=32,seed=27300,
dtype=float32`` alone, from the same start, one thread): 25.6 s in a fresh process, 13.5 s after one 32 MB array
had been allocated and freed, 14.6 s with the thresholds below set, 13.7 s with 4 / 8 MiB; peak memory 91 - 95 MB
in all four. Inside ``--method block`` the span step's stored bases (10 MB at d = 16) had been freed before R,
so R ran at the fast speed by accident; once the step stopped storing them (``ffn._full``) R took 30 s instead of
15 s in the pipeline.

:func:`keep_freed_memory` sets the state glibc's own rule reaches after such a free, explicitly: an mmap
threshold of 32 MiB and a trim threshold of 64 MiB. It is process-wide and one-way (glibc has no call that reads
the thresholds back), so it is done by :func:`headthief.pipeline.extract` (every ``headthief`` command that
extracts), not on import. ``HEADTHIEF_MALLOC=system`` leaves the allocator as it is; on other C libraries
(macOS, musl) nothing is set.
"""

from __future__ import annotations

import os

M_TRIM_THRESHOLD = -1       # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # glibc's own largest dynamic mmap threshold on 64-bit machines
TRIM_THRESHOLD = 64 << 20   # ... and the trim threshold it sets with it (twice)

_done: list[bool] = []


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring), once per process; True where they were set.
    False under ``HEADTHIEF_MALLOC=system``, on a C library other than glibc, or where ``mallopt`` refuses."""
    if _done:
        return _done[0]
    ok = False
    if os.environ.get("HEADTHIEF_MALLOC", "").strip().lower() != "system" and _glibc():
        import ctypes
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            mallopt.restype = ctypes.c_int
            ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _done.append(ok)
    return ok


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False
