"""Pages of memory-mapped checkpoints that no weight uses any more, given back (Linux).

Weights loaded from a safetensors file stay views of its mapping (checkpoint.py); configure
replaces many of them (fused projections, weights packed in place), but the file pages they
touched stay resident and count in the process's RSS until the kernel reclaims them.
"""

from __future__ import annotations

import ctypes
import os

import torch

MADV_DONTNEED = 4   # Linux


def _checkpoint_mappings() -> list[tuple[int, int]]:
    """Address ranges [start, end) of this process's mappings of safetensors files."""
    try:
        with open('/proc/self/maps') as maps:
            lines = maps.read().splitlines()
    except OSError:   # not Linux: nothing to do
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith('.safetensors'):
            start, end = (int(x, 16) for x in fields[0].split('-'))
            ranges.append((start, end))
    return ranges


def release_unused_pages(model: torch.nn.Module) -> int:
    """Drop the resident pages of memory-mapped checkpoints that no tensor of `model` uses.

    pi05 packed in place left ~4 GB of such pages. Only mappings that hold some of
    `model`'s tensors are touched, and only whole pages outside every live parameter and
    buffer of `model` (madvise DONTNEED); a page read again later is read from the file.
    Returns the bytes advised (resident or not).
    """
    mappings = _checkpoint_mappings()
    if not mappings:
        return 0
    page = os.sysconf('SC_PAGE_SIZE')
    live = sorted({(t.untyped_storage().data_ptr(),
                    t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                   for t in [*model.parameters(), *model.buffers()]
                   if t.device.type == 'cpu' and not t.is_meta})
    libc = ctypes.CDLL(None, use_errno=True)
    dropped = 0
    for start, end in mappings:
        inside = [(lo, hi) for lo, hi in live if hi > start and lo < end]
        if not inside:   # another model's file (or a reader's): not this model's to drop
            continue
        cursor = start
        for lo, hi in [*inside, (end, end)]:
            gap_lo = -(-cursor // page) * page          # whole pages inside the gap only
            gap_hi = (min(lo, end) // page) * page
            if gap_hi > gap_lo:
                libc.madvise(ctypes.c_void_p(gap_lo), ctypes.c_size_t(gap_hi - gap_lo),
                             MADV_DONTNEED)
                dropped += gap_hi - gap_lo
            cursor = max(cursor, hi)
    return dropped
