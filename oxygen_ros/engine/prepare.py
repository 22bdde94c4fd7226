"""Make a loaded model fast before the first tick: fuse projections, compile the hot loops.

`prepare_model` runs at configure, after the weights, dtype and device are final:
  1. fuse q/k/v and gate/up into one matmul each (no extra memory; Pi05Model.fuse), and on
     a CPU in bf16 prepack the linears' weights for oneDNN (model/packed.py);
  2. decide, per pass, whether to compile (`compile_plan`) and set it up: the prefill (vision
     tower, backbone layers over a dynamic number of valid positions), the denoise loop as one
     graph (on a GPU one CUDA graph) and the decode step (torch.compile: inductor on the CPU,
     CUDA graphs on a GPU);
  3. nothing compiles yet: the warm-up frames that follow do it (ModelRunner.warm_up_compiled
     covers every shape the engine will use), then `seal` makes sure no tick ever compiles.
Where compiling is unavailable (no C++ compiler, no triton) or fails, the model runs eager
and the log says why.

compile 'auto' compiles a pass where it pays:
  * CUDA: always (one CUDA graph per denoise loop / decode shape removes every launch).
  * CPU: a pass whose weights hold MIN_COMPILE_PARAMS .. MAX_CPU_COMPILE_PARAMS parameters.
    Below, a test-sized model, compiling (tens of seconds) costs more than it saves; above,
    the pass reads so many weights per op that per-op overhead is a few % (pi05's decode step
    reads 4 GB) while freezing the weights into the graph would copy them.
  * auto compiles the whole denoise loop as one graph, every step traced (one C++ call
    without the GIL), and the vision tower: a first configure of about two minutes and a
    restart of seconds (pi05-cpu, docs/bench/phases.md). max does the same.
compile 'on' compiles every pass whatever its size, the denoise loop as a loop of step regions
(one step traced: a third of the first configure's compile, ~2 ms more a pi05-cpu denoise).
On the CPU every compiled graph but a loop of step regions runs as one C++ call that releases
the GIL (cpp_wrapper, see compile_settings).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Sequence

import torch

from oxygen_ros.model import packed_native
from oxygen_ros.model.compiled import unavailable_reason, use_persistent_cache
from oxygen_ros.model.packed import PACKED, packing_unavailable_reason, use_native_kernel
from oxygen_ros.model.pages import release_unused_pages
from oxygen_ros.model.pi05 import Pi05Model

logger = logging.getLogger(__name__)

COMPILE_CHOICES = ('auto', 'max', 'on', 'off')
MIN_COMPILE_PARAMS = 1_000_000
MAX_CPU_COMPILE_PARAMS = 128_000_000
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)   # decode batch sizes of a CUDA-graph runner


@dataclasses.dataclass
class CompilePlan:
    """Which passes run compiled, and why (what the log and the diagnostics say)."""

    denoise: bool
    decode: bool
    reason: str
    prefill: bool | None = None         # the backbone's prefill layers; None: as decode
    mode: str = ''                      # torch.compile mode of the compiled passes
    whole_loop: bool = False            # the denoise loop unrolled as one graph (else one
    #                                     loop of step regions: one step traced, compile_actions)
    seconds: float = 0.0                # warm-up (compile) time, set by the caller
    packed_bytes: int = 0               # weights prepacked for oneDNN (model/packed.py)
    packed_in_place: bool = False       # the packed copies replaced the plain weights
    native_kernel: bool = False         # packed_native's C++ library is loaded (its kernels)
    blocked_rows_copies: int = 0        # in-place copies a decode step's rows read in C++

    def __post_init__(self):
        if self.prefill is None:
            self.prefill = self.decode

    @property
    def vision(self) -> bool:
        """The vision tower compiles with the prefill (its GELU and layer norms fuse)."""
        return self.prefill

    @property
    def packed_expert(self) -> bool:
        """The expert's layers run packed: in place, or beside where the C++ kernel calls them."""
        return bool(self.packed_bytes) and (self.packed_in_place or
                                            (self.denoise and self.native_kernel))

    @property
    def any(self) -> bool:
        return self.prefill or self.denoise or self.decode

    def describe(self) -> str:
        denoise = 'denoise loop' if self.whole_loop else 'denoise loop of step regions'
        passes = [name for name, on in (('vision', self.vision), ('prefill', self.prefill),
                                        (denoise, self.denoise),
                                        ('decode step and extend pass', self.decode)) if on]
        what = f'compiled: {", ".join(passes)} ({self.mode})' if passes else 'eager'
        where = ('vision tower, backbone and expert layers on weights prepacked in place'
                 if self.packed_in_place else
                 f'vision tower, backbone{", expert" if self.packed_expert else ""} and LM '
                 'head on prepacked weights')
        # the kernels of packed_native's library that run (the library is the process's)
        kernels = [name for name, on in (
            ('packed linear', not self.packed_in_place),
            ('AMX attention' if packed_native.attention_on_amx() else 'AVX-512 attention',
             packed_native.ready('oxygen_attention')),
            ('AVX-512 GELU', packed_native.ready('oxygen_activation')),
            ('AMX gate/up with GELU',   # needs the copies beside the weights
             packed_native.ready('gated_gelu') and not self.packed_in_place),
            ('plain-weight LM head',   # in place the tied head stays plain (the embedding)
             packed_native.ready('plain_rows') and self.packed_in_place),
            ('few rows on the packed copies',   # where oneDNN's layout is the one it reads
             self.blocked_rows_copies > 0)) if on]
        kernels = kernels if self.native_kernel else []
        kernel = f'; C++ kernels: {", ".join(kernels)}' if kernels else ''
        packed = (f'; {where} ({self.packed_bytes / 2**20:.0f} MB)'
                  if self.packed_bytes else '')
        return f'{what}: {self.reason}{packed}{kernel}'


def tower_params(model: Pi05Model) -> tuple[int, int, int]:
    """Parameters (the denoise loop, a decode step, a prefill) reads."""
    expert = sum(p.numel() for p in model.expert.parameters())
    backbone = sum(p.numel() for p in model.backbone.parameters())
    prefill = sum(p.numel() for p in model.backbone.layers.parameters()) + sum(
        p.numel() for p in model.vision.parameters()) + sum(
        p.numel() for p in model.projector.parameters())
    return expert, backbone, prefill


def compile_plan(model: Pi05Model, device: str, setting: str = 'auto',
                 row_threads: int = 1) -> CompilePlan:
    """Decide which passes to compile for compile `setting` (COMPILE_CHOICES).

    row_threads: a fleet's row threads (runtime/engine_setup.row_threads). An eager op holds
    the GIL between its kernels, so eager passes make the row threads take turns, while a
    compiled graph runs as one C++ call without it (pi05-cpu, 2 robots on 2 row threads,
    2 cores: 12.4 action rows/s with one denoise step compiled, 14.4 with the vision tower
    compiled too, 17.2 with the whole denoise loop as one graph as well): 'on' takes the
    loop unrolled for them too.
    """
    if setting not in COMPILE_CHOICES:
        raise ValueError(f'compile {setting!r}: expected one of {COMPILE_CHOICES}')
    if setting == 'off':
        return CompilePlan(False, False, "compile is 'off'")
    why_not = unavailable_reason(device)
    if why_not:
        return CompilePlan(False, False, f'torch.compile unavailable ({why_not}); eager')
    if setting == 'on':
        regions = row_threads == 1 and torch.device(device).type == 'cpu'
        return CompilePlan(True, True, "compile is 'on'" + (
            ': the denoise loop as step regions' if regions else ''), whole_loop=not regions)
    if torch.device(device).type == 'cuda':   # the whole loop replayed as one CUDA graph
        return CompilePlan(True, True, 'CUDA: graphs remove the per-kernel launch cost',
                           whole_loop=True)
    expert, backbone, prefill = tower_params(model)

    def pays(params: int) -> bool:
        return MIN_COMPILE_PARAMS <= params <= MAX_CPU_COMPILE_PARAMS

    reason = (f'{setting} on the CPU: a pass is compiled when its weights hold '
              f'{MIN_COMPILE_PARAMS / 1e6:.0f}M..{MAX_CPU_COMPILE_PARAMS / 1e6:.0f}M parameters '
              f'(prefill {prefill / 1e6:.1f}M, denoise {expert / 1e6:.1f}M, decode '
              f'{backbone / 1e6:.1f}M)')
    # The vision tower compiles with the prefill: ~22 s of a first configure (2.3 s cached)
    # for 13.4 -> 9.1 ms a frame (pi05-cpu, AMX Xeon; its GELU and layer norms fuse). The
    # denoise loop unrolled: one call and guard check a frame, not one a step, and one C++ call
    # without the GIL (pi05-cpu: 6.3 ms a denoise against 8.2 for a loop of step regions run
    # from Python and 9-10 for a graph per step, at a first configure of ~2 minutes against
    # ~1; restarts from the cache 16 s against 12).
    return CompilePlan(pays(expert), pays(backbone), reason, prefill=pays(prefill),
                       whole_loop=True)


def compile_settings(device: str) -> tuple[str, dict]:
    """(torch.compile mode, inductor settings while compiling) for a device.

    CUDA: 'reduce-overhead' (CUDA graphs). CPU: inductor's default mode with `cpp_wrapper`:
    the graph's calls run from one C++ function instead of a Python line each (a pi05-cpu
    denoise step is ~50 kernel and library calls) and that function releases the GIL, so a
    fleet's row threads run their graphs side by side instead of queueing for the
    interpreter. Not used (docs/bench/phases.md, measured side by side): `freezing`
    (weights prepacked for oneDNN: decode steps 0.8x, denoise 0.9x, but prepacked weights
    do not pickle, so no cache keeps those graphs and every configure compiles them again:
    ~80 s for auto, ~4.5 min for max) and autotuned GEMM templates (no faster a frame).
    """
    if torch.device(device).type == 'cuda':
        return 'reduce-overhead', {}
    return 'default', {'cpp_wrapper': True}


def prepare_model(model: Pi05Model, device: str, setting: str = 'auto',
                  kv=None, row_threads: int = 1) -> CompilePlan:
    """Fuse the model's projections and set up compilation (compiled by the warm-up).

    kv: the engine's KVTensors, marked static for CUDA graphs (None on the CPU); row_threads:
    a fleet's (compile_plan).
    """
    model.fuse()
    # The fused weights replaced views of a memory-mapped checkpoint: its pages they touched
    # would stay resident (model/pages.py; packing in place, below, gives its pages back
    # layer by layer itself).
    dropped = release_unused_pages(model)
    if dropped:
        logger.info('released %.0f MB of checkpoint pages the fused weights replaced',
                    dropped / 2**20)
    plan = compile_plan(model, device, setting, row_threads)
    # Prepacked bf16 weights (no oneDNN reorder per call, model/packed.py): where the
    # backbone's passes compile, a copy beside the plain weights (~20 MB at pi05-cpu); where
    # they run eager because the model is too big to compile (pi05), in place of them (a
    # second copy would be gigabytes).
    compiled = plan.prefill or plan.decode
    in_place = (not compiled and setting != 'off'
                and tower_params(model)[1] > MAX_CPU_COMPILE_PARAMS)
    if not packing_unavailable_reason(device, model.compute_dtype) and (compiled or in_place):
        # The C++ kernels where they build, loaded before anything traces: the packed
        # linear's (the compiled graphs call it, no Python frame per call), the attention and
        # the GELU (eager passes too: full pi05's [n, 16384] gates).
        why = use_native_kernel(use_persistent_cache())
        plan.native_kernel = why is None
        if why:
            logger.warning('packed linears, attention and GELU run in Python and torch: the '
                           'C++ kernels did not build (%s)', why)
        if in_place:
            plan.packed_bytes = model.pack_linears(in_place=True)
            plan.packed_in_place = True
            plan.blocked_rows_copies = PACKED.blocked_rows_copies(model.parameters())
        else:
            plan.packed_bytes = model.pack_linears(expert=plan.denoise and plan.native_kernel)
    mode, config = compile_settings(device)
    plan.mode = mode
    if plan.any:
        use_persistent_cache()
    # Prefill's length changes with the prompt: CUDA graphs would record one per length, so
    # on a GPU it compiles without them (compute-bound, its launches cost little).
    prefill_mode = 'default' if mode == 'reduce-overhead' else mode
    if plan.prefill:
        model.compile_prefill(prefill_mode, config, vision=plan.vision)
    else:
        model.compile_prefill(None)
    if plan.denoise:
        model.compile_actions(mode, config, graph='loop' if plan.whole_loop else 'regions')
    else:
        model.compile_actions(None)
    model.compile_decode(mode, kv, config) if plan.decode else model.compile_decode(None)
    # An extend pass (a new request's template) has the decode step's weights; its prompt
    # length varies, so no CUDA graphs (as the prefill).
    model.compile_extend(prefill_mode, config) if plan.decode else model.compile_extend(None)
    logger.info('model passes %s', plan.describe())
    if plan.denoise:
        logger.info('real-time chunking (rtc_mode guided or prefix) runs its denoise steps '
                    'eager, one expert pass each: the compiled loop has neither its per-token '
                    'flow time nor its gradient; nothing compiles in a tick')
    return plan


def runner_options(plan: CompilePlan, device: str) -> dict:
    """Return the ModelRunner options of a plan: decode batch buckets for CUDA graphs."""
    if plan.decode and torch.device(device).type == 'cuda':
        return {'bucket_sizes': DECODE_BUCKETS}   # a few graphs, not one per batch size
    return {}


def warm_up(runner, plan: CompilePlan, frames: Sequence[dict],
            action_rows: Sequence[int] = (1,), prompt_len: int = 0,
            prompt_rows: Sequence[int] = (1, 2)) -> None:
    """Compile `plan`'s passes for every shape `runner` uses (ModelRunner.warm_up_compiled).

    prompt_len: the longest prompt template a request feeds (0: no extend pass); prompt_rows:
    the rows its passes may have (1: one a call, (1, 2): the graph of several too).

    Adds the time it took to plan.seconds; nothing to do when nothing is compiled.
    """
    if not plan.any:
        return
    start = time.perf_counter()
    runner.warm_up_compiled(action_rows=action_rows, frames=frames, prompt_len=prompt_len,
                            prompt_rows=prompt_rows)
    plan.seconds += time.perf_counter() - start


def seal(model: Pi05Model, plan: CompilePlan, started: float | None = None) -> None:
    """End the warm-up: nothing compiles any more; log what the warm-up cost.

    started: when the warm-up began (plan.seconds = the time since); None: plan.seconds as
    `warm_up` added it up.
    """
    model.seal_compiled()
    if started is not None:
        plan.seconds = time.perf_counter() - started
    if plan.any:
        guards = ', '.join(f"{fn.name} {fn.guards['kept']}/{fn.guards['dropped']}"
                           for fn in model.compiled_functions if any(fn.guards.values()))
        logger.info('compiled in %.1f s (cache: restarts reuse the kernels); dynamo guards '
                    'checked per call / skipped on the module tree, over each pass\'s graphs: '
                    '%s', plan.seconds, guards or 'all kept (this torch cannot filter them)')


@contextlib.contextmanager
def sealed(model: Pi05Model):
    """Compile nothing inside the block (timed frames run only warmed-up graphs), then again.

    A frame that would compile runs eager and is logged, instead of timing a compile.
    """
    model.seal_compiled()
    try:
        yield
    finally:
        model.seal_compiled(False)
