"""Make a loaded model fast before the first tick: fuse projections, compile the hot loops.

`prepare_model` runs at configure, after the weights, dtype and device are final:
  1. fuse q/k/v and gate/up into one matmul each (no extra memory; Pi05Model.fuse);
  2. decide, per pass, whether to compile (`compile_plan`) and set it up: the prefill (vision
     tower, backbone layers over a dynamic number of valid positions), the denoise step (on
     a GPU the whole loop, one CUDA graph) and the decode step (torch.compile: inductor on
     the CPU, CUDA graphs on a GPU);
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
compile 'max' compiles the same passes with autotuned kernels (CPU bfloat16: weights frozen
into the graph, inductor's AMX GEMM templates; the whole denoise loop as one graph): minutes
at the first configure; see compile_settings. The default keeps configure short: pi05-cpu
configured in 90 s cold and 12 s from the cache on a shared 2-core machine (docs/bench/phases.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Sequence

import torch

from oxygen_ros.model.compiled import unavailable_reason, use_persistent_cache
from oxygen_ros.model.pi05 import Pi05Model

logger = logging.getLogger(__name__)

COMPILE_CHOICES = ('auto', 'max', 'on', 'off')
MIN_COMPILE_PARAMS = 1_000_000
MAX_CPU_COMPILE_PARAMS = 128_000_000
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)   # decode batch sizes of a CUDA-graph runner
NO_CUDA_GRAPHS = {'reduce-overhead': 'default', 'max-autotune': 'max-autotune-no-cudagraphs'}


@dataclasses.dataclass
class CompilePlan:
    """Which passes run compiled, and why (what the log and the diagnostics say)."""

    denoise: bool
    decode: bool
    reason: str
    prefill: bool | None = None         # the backbone's prefill layers; None: as decode
    vision: bool | None = None          # the vision tower; None: as prefill
    mode: str = ''                      # torch.compile mode of the compiled passes
    whole_loop: bool = True             # the denoise loop as one graph (else one step's)
    seconds: float = 0.0                # warm-up (compile) time, set by the caller

    def __post_init__(self):
        if self.prefill is None:
            self.prefill = self.decode
        if self.vision is None:
            self.vision = self.prefill

    @property
    def any(self) -> bool:
        return self.vision or self.prefill or self.denoise or self.decode

    def describe(self) -> str:
        denoise = 'denoise loop' if self.whole_loop else 'denoise step'
        passes = [name for name, on in (('vision', self.vision), ('prefill', self.prefill),
                                        (denoise, self.denoise), ('decode step', self.decode))
                  if on]
        what = f'compiled: {", ".join(passes)} ({self.mode})' if passes else 'eager'
        return f'{what}: {self.reason}'


def tower_params(model: Pi05Model) -> tuple[int, int, int]:
    """Parameters (the denoise loop, a decode step, a prefill) reads."""
    expert = sum(p.numel() for p in model.expert.parameters())
    backbone = sum(p.numel() for p in model.backbone.parameters())
    prefill = sum(p.numel() for p in model.backbone.layers.parameters()) + sum(
        p.numel() for p in model.vision.parameters()) + sum(
        p.numel() for p in model.projector.parameters())
    return expert, backbone, prefill


def compile_plan(model: Pi05Model, device: str, setting: str = 'auto') -> CompilePlan:
    """Decide which passes to compile for compile `setting` (COMPILE_CHOICES; 'max': as auto)."""
    if setting not in COMPILE_CHOICES:
        raise ValueError(f'compile {setting!r}: expected one of {COMPILE_CHOICES}')
    if setting == 'off':
        return CompilePlan(False, False, "compile is 'off'")
    why_not = unavailable_reason(device)
    if why_not:
        return CompilePlan(False, False, f'torch.compile unavailable ({why_not}); eager')
    if setting == 'on':
        return CompilePlan(True, True, "compile is 'on'")
    if torch.device(device).type == 'cuda':
        return CompilePlan(True, True, 'CUDA: graphs remove the per-kernel launch cost')
    expert, backbone, prefill = tower_params(model)

    def pays(params: int) -> bool:
        return MIN_COMPILE_PARAMS <= params <= MAX_CPU_COMPILE_PARAMS

    reason = (f'{setting} on the CPU: a pass is compiled when its weights hold '
              f'{MIN_COMPILE_PARAMS / 1e6:.0f}M..{MAX_CPU_COMPILE_PARAMS / 1e6:.0f}M parameters '
              f'(prefill {prefill / 1e6:.1f}M, denoise {expert / 1e6:.1f}M, decode '
              f'{backbone / 1e6:.1f}M)')
    # auto leaves the vision tower eager: a quarter of the first configure's compile for
    # ~1.6 ms of a 65 ms action path (pi05-cpu, docs/bench/phases.md).
    return CompilePlan(pays(expert), pays(backbone), reason, prefill=pays(prefill),
                       vision=pays(prefill) and setting == 'max')


def compile_settings(device: str, dtype: torch.dtype, autotune: bool = False
                     ) -> tuple[str, dict]:
    """(torch.compile mode, inductor settings while compiling) for a device and dtype.

    CUDA: 'reduce-overhead' (CUDA graphs); autotune: 'max-autotune' (graphs and autotuned
    kernels). CPU: the default mode. autotune on the CPU in bfloat16 (compile 'max'): weights
    frozen into the graph and matmuls autotuned, so inductor's AMX / AVX512-BF16
    micro-kernels replace oneDNN calls (6 small matmuls measured 181 -> 42 us alone), but
    the first configure of pi05-cpu took 220-340 s and a restart 66-69 s (frozen weights
    keep AOT's cache out) against 172 s / 18 s for the default mode, for no measurable gain
    per frame (docs/bench/phases.md).
    """
    if torch.device(device).type == 'cuda':
        return ('max-autotune' if autotune else 'reduce-overhead'), {}
    if autotune and dtype == torch.bfloat16:
        # No oneDNN weight prepacking: its packed tensors do not pickle, so every graph
        # holding one bypassed the compile cache (a restart compiled for minutes again); the
        # autotuned GEMM templates pack their own weights, which the cache keeps. (And the
        # autotuner's per-matmul timing tables would fill the node's log.)
        return 'max-autotune-no-cudagraphs', {'freezing': True, 'cpp.weight_prepack': False,
                                              'autotune_num_choices_displayed': 0,
                                              'max_autotune_report_choices_stats': False}
    return 'default', {}


def prepare_model(model: Pi05Model, device: str, setting: str = 'auto',
                  kv=None) -> CompilePlan:
    """Fuse the model's projections and set up compilation (compiled by the warm-up).

    kv: the engine's KVTensors, marked static for CUDA graphs (None on the CPU).
    """
    model.fuse()
    plan = compile_plan(model, device, setting)
    cuda = torch.device(device).type == 'cuda'
    mode, config = compile_settings(device, model.compute_dtype, autotune=setting == 'max')
    # One denoise step as the graph on the CPU: the unrolled loop was most of the compile
    # (cold and cached) for no faster frame; a GPU replays the whole loop as one CUDA graph.
    plan.whole_loop = cuda or setting == 'max'
    plan.mode = mode + (' + frozen weights' if config.get('freezing') else '')
    if plan.any:
        use_persistent_cache()
    # Prefill's length changes with the prompt: CUDA graphs would record one per length, so
    # on a GPU it compiles without them (compute-bound, its launches cost little).
    prefill_mode = NO_CUDA_GRAPHS.get(mode, mode)
    if plan.prefill:
        model.compile_prefill(prefill_mode, config, vision=plan.vision)
    else:
        model.compile_prefill(None)
    if plan.denoise:
        model.compile_actions(mode, config, whole_loop=plan.whole_loop)
    else:
        model.compile_actions(None)
    model.compile_decode(mode, kv, config) if plan.decode else model.compile_decode(None)
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
            action_rows: Sequence[int] = (1,)) -> None:
    """Compile `plan`'s passes for every shape `runner` uses (ModelRunner.warm_up_compiled).

    Adds the time it took to plan.seconds; nothing to do when nothing is compiled.
    """
    if not plan.any:
        return
    start = time.perf_counter()
    runner.warm_up_compiled(action_rows=action_rows, frames=frames)
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
        logger.info('compiled in %.1f s (cache: restarts reuse the kernels)', plan.seconds)


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
