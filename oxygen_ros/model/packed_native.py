"""Build and load the C++ kernels once per machine: packed linear, attention, activation.

packed_linear.cpp (oxygen_packed_native), attention_kernel.cpp (oxygen_attention) and
activation_kernel.cpp (oxygen_activation, AVX-512) make one library, built at the first
configure that packs weights (~13 s with g++ on 2 cores, the sources compiled at once; g++ is
the compiler inductor needs too), into the compile cache next to inductor's kernels, so a
restart loads it in milliseconds. The file name carries a hash of the sources, the torch
version and the commands, so an upgrade builds it again. Where it cannot build (no compiler,
an error), `load` says why: model/packed.py keeps its Python kernel and model/gemma.py SDPA
and torch's GELU.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
import subprocess
import tempfile
import threading
import time

import torch

from .compiled import cxx_compiler

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in
                ('packed_linear.cpp', 'attention_kernel.cpp', 'activation_kernel.cpp'))
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ('cpu_features.h', 'fast_exp.h', 'pair_dot.h'))
BUILD_TIMEOUT_S = 300
_lock = threading.Lock()
_loaded: Path | None = None
# The library's kernels beside the packed linear: op namespace -> [runs on this CPU (its
# available() op, once loaded), switched on (use_kernel)]
_KERNELS = {'oxygen_attention': [False, True], 'oxygen_activation': [False, True],
            'gated_gelu': [False, True], 'plain_rows': [False, True],
            'blocked_rows': [False, True], 'row_argmax': [False, True]}
# Whether the attention kernel multiplies on AMX tiles (else vdpbf16ps), once loaded
_attention_amx = [True]


def _compile_command(compiler: str, source: Path, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is a header template that opens its OpenMP region in the
    # caller's code; compiled without it, every kernel ran on one thread whatever
    # torch.get_num_threads() said (full pi05's LM head: 26 GB/s at 1 thread or 2).
    return ([compiler, '-O2', '-std=c++20', '-fPIC', '-w', '-fopenmp',
             f'-D_GLIBCXX_USE_CXX11_ABI={abi}']
            + [f'-I{path}' for path in cpp_extension.include_paths()]
            + ['-c', str(source), '-o', str(output)])


def _link_command(compiler: str, objects: list[Path], output: Path) -> list[str]:
    from torch.utils import cpp_extension

    # -fopenmp links libgomp.so.1 by name: torch's own copy (same soname), already loaded, so
    # the kernels share torch's thread pool rather than starting a second one.
    return ([compiler, '-shared', '-fopenmp'] + [str(o) for o in objects] + ['-o', str(output)]
            + [f'-L{path}' for path in cpp_extension.library_paths()]
            + ['-lc10', '-ltorch_cpu', '-ltorch'])


def library_path(cache_dir: Path, compiler: str) -> Path:
    """Where the built kernel for this source, torch and compiler lives under cache_dir."""
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    key.update(torch.__version__.encode())
    key.update(' '.join(_compile_command(compiler, Path('in'), Path('out'))
                        + _link_command(compiler, [], Path('out'))).encode())
    return cache_dir / 'oxygen_packed' / f'kernels-{key.hexdigest()[:16]}.so'


def load(cache_dir: Path) -> str | None:
    """Load the kernel (building it first if no cached build fits); None, or why it failed."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return None
        compiler = cxx_compiler()
        if compiler is None:
            return 'no C++ compiler (g++, c++ or clang++) on PATH'
        path = library_path(Path(cache_dir), compiler)
        if not path.exists():
            why = _build(compiler, path)
            if why:
                return why
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as err:
            return f'loading {path} failed: {err}'
        _loaded = path
        for name, fake in (('oxygen_attention::attention', _attention_fake),
                           ('oxygen_activation::gelu_tanh', _gelu_fake)):
            space = name.split('::')[0]
            _KERNELS[space][0] = bool(getattr(torch.ops, space).available())
            if _KERNELS[space][0]:
                torch.library.register_fake(name)(fake)
        _KERNELS['gated_gelu'][0] = bool(torch.ops.oxygen_packed_native.small_rows_on_amx())
        _KERNELS['plain_rows'][0] = bool(
            torch.ops.oxygen_packed_native.small_rows_available())   # AVX512-BF16
        _KERNELS['blocked_rows'][0] = bool(
            torch.ops.oxygen_packed_native.blocked_rows_available())
        _KERNELS['row_argmax'][0] = bool(torch.ops.oxygen_packed_native.row_argmax_available())
        if _KERNELS['row_argmax'][0]:
            torch.library.register_fake('oxygen_packed_native::row_argmax')(_argmax_fake)
        _attention_amx[0] = bool(torch.ops.oxygen_attention.on_amx())
        return None


def tag_compile_cache(*schemas: str) -> None:
    """Key torch.compile's caches to these kernels' sources and the ops' `schemas`.

    A compiled C++ graph calls the ops through their schemas as they were at compile time: a
    graph cached before an op took an argument more would call it with the wrong arguments
    and crash, so changed kernels or schemas compile afresh. Call before the first compile
    (packed.py does at import, with its Python op's schema).
    """
    import torch.compiler.config as compiler_config

    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    for schema in schemas:
        key.update(schema.encode())
    ours = f'oxygen_kernels={key.hexdigest()[:16]}'
    tags = [t for t in compiler_config.cache_key_tag.split(';')
            if t and not t.startswith('oxygen_kernels=')]
    compiler_config.cache_key_tag = ';'.join(tags + [ours])


def _build(compiler: str, path: Path) -> str | None:
    logger.info('building the C++ kernels (once per machine and torch) ...')
    started = time.perf_counter()
    # Build beside the target and rename: a second process building at once never loads a
    # half-written file.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix='.so', dir=path.parent)
        os.close(fd)
    except OSError as err:
        return f'cannot write the kernel under {path.parent}: {err}'
    try:
        with tempfile.TemporaryDirectory(dir=path.parent) as objects:
            # the sources compile at once (one core each), then link
            jobs = [(source, Path(objects) / f'{source.stem}.o') for source in SOURCES]
            why = _run_all([_compile_command(compiler, source, obj) for source, obj in jobs],
                           compiler)
            why = why or _run_all([_link_command(compiler, [obj for _, obj in jobs],
                                                 Path(tmp))], compiler)
            if why:
                return why
        os.replace(tmp, path)
    except OSError as err:
        return f'running {compiler} failed: {err}'
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info('built the C++ kernels in %.1f s: %s', time.perf_counter() - started,
                path)
    return None


def _run_all(commands: list[list[str]], compiler: str) -> str | None:
    """Run the commands at once; None, or why the first that failed did (BUILD_TIMEOUT_S)."""
    running = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True) for command in commands]
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    why = None
    for process in running:
        try:
            _, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            why = why or f'{compiler} ran over {BUILD_TIMEOUT_S} s'
            continue
        if process.returncode != 0 and why is None:
            first = (stderr.strip().splitlines() or ['(no output)'])[:3]
            why = f'{compiler} failed ({process.returncode}): ' + ' | '.join(first)[:400]
    return why


def loaded() -> bool:
    """Whether the C++ kernel is loaded in this process."""
    return _loaded is not None


def ready(kernel: str) -> bool:
    """Whether `kernel` runs: the library loaded, the CPU has what it needs, switched on.

    kernel: 'oxygen_attention' (AVX512-BF16; AMX tiles where the CPU has them),
    'oxygen_activation' (AVX512-BF16),
    'gated_gelu' (packed_linear.cpp's gate/up with the gated GELU in one pass: AMX-BF16),
    'plain_rows' (packed_linear.cpp's few rows on a plain weight: AVX512-BF16),
    'blocked_rows' (its few rows on oneDNN's packed copy where it lies: AVX512-BF16) or
    'row_argmax' (packed_linear.cpp's greedy ids from float32 logits: AVX-512).
    A plain bool, so a traced pass asks it without a graph break.
    """
    available, on = _KERNELS[kernel]
    return available and on


def attention_on_amx() -> bool:
    """Whether the attention kernel multiplies on AMX tiles (else in vdpbf16ps)."""
    return _attention_amx[0]


def attention_min_rows() -> int:
    """Query rows a K/V group needs to attend through the kernel rather than SDPA.

    On AMX tiles the kernel computes 32 rows at a time: a decode step's 8 ran faster in SDPA
    (AMX Xeon). In vdpbf16ps it computes the rows asked and beats SDPA at any count (8 rows x
    572 keys 18 vs 44 us, 80 x 565 60 vs 217, 4440 x 555 2.7 vs 7.5 ms; AMD EPYC, 1 thread).
    """
    return 32 if _attention_amx[0] else 1


def use_kernel(kernel: str, on: bool) -> bool:
    """Switch `kernel` on or off (torch's ops then); return the old setting (A/B, tests)."""
    old, _KERNELS[kernel][1] = _KERNELS[kernel][1], on
    return old


def _attention_fake(q, k, v, key_bias, k2=None, v2=None, key_bias2=None, index=None,
                    index2=None):
    return q.new_empty(q.shape)


def _argmax_fake(x):
    return x.new_empty(x.shape[0], dtype=torch.long)


def _gelu_fake(x, up):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
