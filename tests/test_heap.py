"""glibc's heap thresholds (``headthief.heap``): set once per process by the pipeline, left alone on request."""

import json
import os
import subprocess
import sys

import pytest

from headthief.heap import _glibc

CHILD = r"""
import ctypes, json, sys
import numpy as np
import headthief as ht
from headthief.heap import keep_freed_memory, MMAP_THRESHOLD
# glibc's mallinfo2: hblkhd, the bytes held in mmapped blocks, while an array lives
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
def mapped_while_alive(n):
    a = np.ones(n)
    held = libc.mallinfo2().hblkhd
    del a
    return held
before = mapped_while_alive(500_000)            # 4 MB (its free raises glibc's own threshold to 4 MB)
set_now = keep_freed_memory()
after = mapped_while_alive(1_000_000)            # 8 MB
r = ht.extract("random:d=8,seed=1", "exact", verify=16)
print(json.dumps({"set": set_now, "row": r.row["heap_thresholds_set"], "before": before, "after": after}))
"""


def _run(env_value):
    env = {**os.environ, "HEADTHIEF_MALLOC": env_value}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mallinfo2() -> bool:
    """glibc 2.33 or later (mallinfo2, which the test reads)."""
    if not sys.platform.startswith("linux") or not _glibc():
        return False
    major, minor = (int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])
    return (major, minor) >= (2, 33)


@pytest.mark.skipif(not _mallinfo2(), reason="glibc's mallopt and mallinfo2 only")
def test_the_heap_thresholds_are_set_once_and_system_leaves_them():
    """In a fresh process a 4 MB array is an mmapped block of glibc's (its free raises glibc's own threshold to
    4 MB); once the thresholds are set (32 MiB) an 8 MB array comes from the heap, and an extraction's row says
    they were set. With ``HEADTHIEF_MALLOC=system`` nothing is set: the 8 MB array is mmapped, the row says so."""
    tuned = _run("")
    assert tuned["set"] is True and tuned["row"] is True
    assert tuned["before"] >= 4_000_000 and tuned["after"] < 4_000_000
    left = _run("system")
    assert left["set"] is False and left["row"] is False
    assert left["before"] >= 4_000_000 and left["after"] >= 8_000_000
