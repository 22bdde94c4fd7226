"""Make a loaded model fast before the first tick: fuse projections, compile the hot loops.

`prepare_model` runs at configure, after the weights, dtype and device are final:
  1. fuse q/k/v and gate/up into one matmul each (no extra memory; Pi05Model.fuse);
  2. decide, per pass, whether to compile (`compile_plan`) and set it up: the prefill (vision
     tower, backbone layers over a dynamic number of valid positions), the whole denoise
     loop and the decode step (torch.compile: inductor on the CPU, CUDA graphs on a GPU);
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
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import torch

from oxygen_ros.model.compiled import unavailable_reason, use_persistent_cache
from oxygen_ros.model.pi05 import Pi05Model

logger = logging.getLogger(__name__)

COMPILE_CHOICES = ('auto', 'on', 'off')
MIN_COMPILE_PARAMS = 1_000_000
MAX_CPU_COMPILE_PARAMS = 128_000_000
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)   # decode batch sizes of a CUDA-graph runner


@dataclasses.dataclass
class CompilePlan:
    """Which passes run compiled, and why (what the log and the diagnostics say)."""

    denoise: bool
    decode: bool
    reason: str
    prefill: bool | None = None         # vision + backbone layers; None: as decode
    mode: str = ''                      # torch.compile mode of the compiled passes
    seconds: float = 0.0                # warm-up (compile) time, set by the caller

    def __post_init__(self):
        if self.prefill is None:
            self.prefill = self.decode

    @property
    def any(self) -> bool:
        return self.prefill or self.denoise or self.decode

    def describe(self) -> str:
        passes = [name for name, on in (('prefill', self.prefill), ('denoise loop', self.denoise),
                                        ('decode step', self.decode)) if on]
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
    """Decide which passes to compile for compile `setting` ('auto', 'on' or 'off')."""
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

    reason = (f'auto on the CPU: a pass is compiled when its weights hold '
              f'{MIN_COMPILE_PARAMS / 1e6:.0f}M..{MAX_CPU_COMPILE_PARAMS / 1e6:.0f}M parameters '
              f'(prefill {prefill / 1e6:.1f}M, denoise {expert / 1e6:.1f}M, decode '
              f'{backbone / 1e6:.1f}M)')
    return CompilePlan(pays(expert), pays(backbone), reason, prefill=pays(prefill))


def compile_settings(device: str, dtype: torch.dtype) -> tuple[str, dict]:
    """(torch.compile mode, inductor settings while compiling) for a device and dtype.

    CUDA: 'reduce-overhead' (CUDA graphs). CPU bfloat16: weights frozen into the graph and
    matmuls autotuned, so inductor's own AMX / AVX512-BF16 micro-kernels replace oneDNN calls
    that cost ~20 us each at the expert's sizes (measured: 6 small matmuls 181 -> 42 us). CPU
    float32: the default mode (MKL's float32 matmuls are as fast as the generated ones).
    """
    if torch.device(device).type == 'cuda':
        return 'reduce-overhead', {}
    if dtype == torch.bfloat16:
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
    mode, config = compile_settings(device, model.compute_dtype)
    plan.mode = mode + (' + frozen weights' if config.get('freezing') else '')
    if plan.any:
        use_persistent_cache()
    # Prefill's length changes with the prompt: CUDA graphs would record one per length, so
    # on a GPU it compiles without them (compute-bound, its launches cost little).
    prefill_mode = 'default' if mode == 'reduce-overhead' else mode
    model.compile_prefill(prefill_mode, config) if plan.prefill else model.compile_prefill(None)
    model.compile_actions(mode, config) if plan.denoise else model.compile_actions(None)
    model.compile_decode(mode, kv, config) if plan.decode else model.compile_decode(None)
    logger.info('model passes %s', plan.describe())
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
