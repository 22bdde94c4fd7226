"""torch.compile for the denoise loop and the decode step: compiled once, then never again.

A `CompiledFunction` compiles on its first calls (the warm-up at configure). Once `seal()`ed,
an input that would need a new graph (a shape never warmed up) runs the eager function instead
of compiling inside a control tick: a recompile costs seconds, a missed tick is worse. Each
such fallback is logged once per function and counted.

Dynamo checks guards before every call of a graph: on the arguments, on globals, and on every
submodule, attribute and parameter of the model the pass is a method of (~530 of the decode
step's ~680). After a frame's prefill and denoise those objects are out of the caches: the
check took ~0.3 ms of pi05-cpu's ~2.2 ms first decode step (AMD EPYC, 1 thread). A compiled pass
keeps its model's structure fixed (prepare packs and fuses before it compiles; weights may
change in place), so the guards on the module tree are dropped (`guard_filter_fn`) and each
pass keeps its graphs to itself (`isolate_recompiles`): another model's call never finds them.
A torch without those options keeps every guard.

The compile cache (inductor's FX graph and AOT caches) lives under
~/.cache/oxygen_ros/torch_compile unless TORCHINDUCTOR_CACHE_DIR says otherwise, so a restart
of the node finds its kernels already built.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from pathlib import Path
import shutil
import threading
from typing import Callable

import torch

logger = logging.getLogger(__name__)

CACHE_DIR = Path.home() / '.cache' / 'oxygen_ros' / 'torch_compile'


def use_persistent_cache(path: str | os.PathLike | None = None) -> Path:
    """Keep torch.compile's caches in `path` (default CACHE_DIR) unless the env names one.

    Must run before the first compile of the process (inductor reads the variable then).
    torch itself writes its default (a folder in /tmp, gone after a reboot) into the variable
    the first time it looks; only a value that differs from that default is the user's.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get('TORCHINDUCTOR_CACHE_DIR')
    if current and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        return Path(current)
    cache = Path(path) if path else CACHE_DIR
    cache.mkdir(parents=True, exist_ok=True)
    os.environ['TORCHINDUCTOR_CACHE_DIR'] = str(cache)
    return cache


def cxx_compiler() -> str | None:
    """Return the C++ compiler on PATH ($CXX first, then g++, c++, clang++), or None."""
    for name in (os.environ.get('CXX'), 'g++', 'c++', 'clang++'):
        if name and shutil.which(name):
            return name
    return None


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why torch.compile (inductor) cannot run on `device` here, or None when it can."""
    kind = torch.device(device).type
    if kind == 'cpu':
        if cxx_compiler() is None:
            return 'inductor on the CPU needs a C++ compiler (g++ or clang++); none on PATH'
        return None
    if kind == 'cuda':
        try:
            import triton  # noqa: F401
        except ImportError:
            return 'inductor on CUDA needs triton, which this torch install lacks'
        return None
    return f'no inductor backend for device {kind!r}'


_stance_lock = threading.Lock()
_sealed_calls = 0   # sealed calls in flight, in any thread


@contextlib.contextmanager
def _no_recompile():
    """Dynamo's 'fail_on_recompile' stance while any thread is in a sealed call.

    The stance is process-wide: `with set_stance(...)` in two threads at once (a fleet's row
    threads) restored it out of order and left every later compile failing. A count under a
    lock sets it at the first call in and back at the last call out.
    """
    global _sealed_calls
    with _stance_lock:
        if not _sealed_calls:
            torch.compiler.set_stance('fail_on_recompile')
        _sealed_calls += 1
    try:
        yield
    finally:
        with _stance_lock:
            _sealed_calls -= 1
            if not _sealed_calls:
                torch.compiler.set_stance('default')


def _on_module_tree(name: str) -> bool:
    """Say whether a guard's source lies inside a module's submodules (self._modules[...])."""
    return '._modules[' in name


def _isolated(options: dict, counts: dict[str, int]) -> dict:
    """torch.compile options that keep the graphs to this call and skip module-tree guards.

    counts: 'kept' and 'dropped' guards, added up as graphs are built. Unchanged options
    where this torch lacks the two options, or where a mode other than inductor's cannot
    be written as options (both may not be given).
    """
    if 'isolate_recompiles' not in inspect.signature(torch.compile).parameters:
        return options
    options = dict(options)
    mode = options.pop('mode', None)
    backend_options = dict(options.pop('options', None) or {})
    if mode not in (None, 'default'):
        if options.get('backend', 'inductor') != 'inductor':
            return {**options, 'mode': mode, 'options': backend_options or None}
        from torch._inductor import list_mode_options

        backend_options = {**list_mode_options(mode, options.get('dynamic')),
                           **backend_options}

    def keep(entries) -> list[bool]:
        flags = [not _on_module_tree(entry.name) for entry in entries]
        counts['kept'] += sum(flags)
        counts['dropped'] += len(flags) - sum(flags)
        return flags

    backend_options['guard_filter_fn'] = keep
    return {**options, 'options': backend_options, 'isolate_recompiles': True}


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """Return a copy of `tensor` with row-major strides (contiguous() keeps a size-1 dim's 0)."""
    return torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)


class CompiledFunction:
    """torch.compile(fn) that, once sealed, runs `fn` eagerly instead of compiling again.

    config: inductor settings in force while it compiles (torch._inductor.config names, e.g.
    freezing). They are patched around the calls that compile rather than passed as
    torch.compile options, because some (freezing) are read while dynamo traces.
    guards: the guards kept ('kept': checked before a call) and the module-tree ones dropped,
    summed over its graphs.
    """

    def __init__(self, fn: Callable, name: str, config: dict | None = None, **options):
        self.fn = fn
        self.name = name
        self.config = dict(config or {})
        self.guards = {'kept': 0, 'dropped': 0}
        self.compiled = torch.compile(fn, **_isolated(options, self.guards))
        self.sealed = False
        self.failed = False      # compiling raised: eager from then on
        self.fallbacks = 0       # calls that ran eager because no graph fitted their inputs

    def seal(self, sealed: bool = True) -> None:
        """From now on never compile: inputs without a graph run eager (logged once).

        sealed False: compile again (a warm-up that follows a timed stretch).
        """
        self.sealed = sealed

    def __call__(self, *args):
        if self.failed:
            return self.fn(*args)
        # A broadcast input (stride 0, e.g. one robot's noise or n_valid expanded over a
        # fleet's rows) would fail the graph's stride guards and run eager: hand it over dense.
        args = tuple(_dense(a) if isinstance(a, torch.Tensor) and 0 in a.stride() else a
                     for a in args)
        if not self.sealed:
            import torch._inductor.config as inductor_config

            try:
                with inductor_config.patch(self.config):
                    return self.compiled(*args)
            except Exception as err:   # noqa: B902 - any compiler failure: run eager instead
                self.failed = True
                logger.warning('%s: torch.compile failed, running eager: %s: %s', self.name,
                               type(err).__name__, str(err).strip().splitlines()[0][:300])
                return self.fn(*args)
        try:
            with _no_recompile():
                return self.compiled(*args)
        except RuntimeError as err:
            if "stance is 'fail_on_recompile'" not in str(err):
                raise
            if not self.fallbacks:
                logger.warning('%s: inputs that were not warmed up at configure run eager '
                               '(compiling now would stall the tick): %s', self.name,
                               str(err).splitlines()[-1].strip())
            self.fallbacks += 1
            return self.fn(*args)
