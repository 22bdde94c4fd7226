"""runtime/allocator.py: a frame's freed activations stay in the process (glibc)."""

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent('''
    import ctypes, sys
    import torch
    from oxygen_ros.runtime.allocator import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks',
            'uordblks', 'fordblks', 'keepcost')]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == 'keep':
        print(keep_freed_memory())
    # A pi05-cpu-sized activation (555 x 1024 float32: 2.3 MB), made and freed as a frame does:
    # the bytes it added to mmapped blocks while alive, and the heap's free bytes after.
    before, mapped = libc.mallinfo2().hblkhd, 0
    for _ in range(3):
        x = torch.empty(555, 1024)
        x.fill_(1.0)
        mapped = max(mapped, libc.mallinfo2().hblkhd - before)
        del x
    print(mapped, libc.mallinfo2().fordblks)
''')


def _probe(mode: str, **env) -> tuple[str, int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith('MALLOC_')} | env
    out = subprocess.run([sys.executable, '-c', PROBE, mode], capture_output=True, text=True,
                         env=env, check=True).stdout.splitlines()
    mmapped, free = map(int, out[-1].split())
    return '\n'.join(out[:-1]), mmapped, free


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc malloc only')
def test_freed_activations_stay_in_the_heap_for_the_next_frame():
    said, mmapped, free = _probe('keep')
    assert 'keeps freed memory' in said and 'mmap threshold 32 MB' in said
    assert mmapped == 0 and free >= 555 * 1024 * 4     # from the heap, and kept there
    # glibc's defaults for comparison: the first block was mmapped (and unmapped when freed).
    _, default_mmapped, _ = _probe('default')
    assert default_mmapped >= 555 * 1024 * 4


def test_a_users_malloc_settings_are_left_alone():
    said, _, _ = _probe('keep', MALLOC_TOP_PAD_='1048576')
    assert said == 'malloc left as set by MALLOC_TOP_PAD_'
