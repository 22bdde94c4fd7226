"""Keep freed activation memory in the process (glibc malloc), set once at a process's start.

Why: torch allocates every activation of a frame with malloc and frees it at the end. glibc
serves blocks above its mmap threshold (128 KB, raised on the fly up to 32 MB) with a fresh
mmap and returns them with munmap, and trims the heap's free top above 128 KB. Each frame then
page-faults its activations in again, and in a process with several inference threads (a
fleet's row threads, runtime/engine_setup.py) each munmap stops the other core for a TLB
flush while the faults queue on the process's one memory-map lock. Measured on pi05-cpu (2
cores, quiet, back to back with and without): two robots on two row threads 11.65 -> 12.40
action rows/s; two single-robot processes side by side 14.5 -> 15.7; the libero node's act()
125 -> 97 ms, the benchmark's action-only frame 93 -> 60 ms (docs/benchmark.md).

What: mallopt (man 3 mallopt) with a fixed mmap threshold of 32 MB (glibc's largest: every
activation of pi05-cpu comes from the heaps and is reused next frame), a trim threshold that
never trims, and 64 MB of top pad (a heap grows in few steps). The memory a process holds
stays at its peak (what the next frame needs anyway) instead of going back and forth.

Linux with glibc only; elsewhere (musl, macOS, Windows) nothing is done and the reason is
returned. Environment variables set by the user (MALLOC_MMAP_THRESHOLD_ and the others) win:
nothing is changed then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1      # malloc.h
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 2**20          # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD = 2**31 - 1           # an int: never trim the heap's free top
TOP_PAD = 64 * 2**20

USER_SETTINGS = ('MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_', 'MALLOC_TOP_PAD_',
                 'GLIBC_TUNABLES')

_done: str | None = None


def keep_freed_memory() -> str:
    """Apply the settings once per process; return what was done (for the log)."""
    global _done
    if _done is None:
        _done = _apply()
    return _done


def _apply() -> str:
    user = [name for name in USER_SETTINGS if name in os.environ]
    if user:
        return f'malloc left as set by {", ".join(user)}'
    name = ctypes.util.find_library('c')
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        if not hasattr(libc, 'gnu_get_libc_version'):
            return 'malloc unchanged: not glibc'
    except (OSError, AttributeError, TypeError):
        return 'malloc unchanged: no C library with mallopt'
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = [mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD),
               mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD), mallopt(M_TOP_PAD, TOP_PAD)]
    if not all(applied):
        return f'malloc: mallopt refused a setting ({applied})'
    return (f'malloc keeps freed memory: mmap threshold {MMAP_THRESHOLD >> 20} MB, no trim, '
            f'top pad {TOP_PAD >> 20} MB')
