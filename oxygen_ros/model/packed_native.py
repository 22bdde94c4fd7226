"""Build and load packed_linear.cpp, the C++ kernel of the packed linear, once per machine.

Compiled at the first configure that packs weights for compiled passes (~20 s with g++,
the same compiler inductor needs), into the compile cache next to inductor's kernels, so a
restart loads it in milliseconds. The file name carries a hash of the source, the torch
version and the command, so an upgrade builds it again. Where it cannot build (no compiler,
an error), `load` says why and model/packed.py keeps its Python kernel.
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

SOURCE = Path(__file__).with_name('packed_linear.cpp')
BUILD_TIMEOUT_S = 300
_lock = threading.Lock()
_loaded: Path | None = None


def _command(compiler: str, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ([compiler, '-O2', '-std=c++20', '-shared', '-fPIC', '-w',
             f'-D_GLIBCXX_USE_CXX11_ABI={abi}']
            + [f'-I{path}' for path in cpp_extension.include_paths()]
            + [str(SOURCE), '-o', str(output)]
            + [f'-L{path}' for path in cpp_extension.library_paths()]
            + ['-lc10', '-ltorch_cpu', '-ltorch'])


def library_path(cache_dir: Path, compiler: str) -> Path:
    """Where the built kernel for this source, torch and compiler lives under cache_dir."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(torch.__version__.encode())
    key.update(' '.join(_command(compiler, Path('out'))).encode())
    return cache_dir / 'oxygen_packed' / f'packed_linear-{key.hexdigest()[:16]}.so'


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
        return None


def _build(compiler: str, path: Path) -> str | None:
    logger.info('building the packed-linear kernel (C++, once per machine and torch) ...')
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
        done = subprocess.run(_command(compiler, Path(tmp)), capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ['(no output)'])[:3]
            return f'{compiler} failed ({done.returncode}): ' + ' | '.join(first)[:400]
        os.replace(tmp, path)
    except subprocess.TimeoutExpired:
        return f'{compiler} ran over {BUILD_TIMEOUT_S} s'
    except OSError as err:
        return f'running {compiler} failed: {err}'
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info('built the packed-linear kernel in %.1f s: %s', time.perf_counter() - started,
                path)
    return None


def loaded() -> bool:
    """Whether the C++ kernel is loaded in this process."""
    return _loaded is not None
