"""What this machine does per second, measured: matmul rate per dtype, copy bandwidth.

Two users:
  * `choose_dtype` (dtype 'auto' at configure): bfloat16 where the device multiplies bf16
    fast: CUDA with bf16 support, or a CPU whose bf16 matmul at the model's shape beats float32
    by BF16_MIN_SPEEDUP (AMX or AVX512-BF16 do; an AVX2 CPU emulates bf16 and loses). Decided
    by a timing probe of ~0.1 s, not by the CPU's name; the flags are only reported.
  * the phase floors (bench/floors.py): `measure_machine` gives the peak matmul rate per dtype
    at the thread count in use and the copy bandwidth, measured in the same run as the phases.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from oxygen_ros.model.config import Pi05Config

# bf16 must beat float32 by this factor at the model's matmul shape to be chosen.
BF16_MIN_SPEEDUP = 1.5
# The phase-floor matmul: one prefill MLP matmul of a LIBERO frame at pi05 expert-ish width.
PEAK_SHAPE = (555, 1024, 4096)
COPY_BYTES = 256 << 20   # large enough to leave every cache
CPU_FLAGS = ('amx_bf16', 'avx512_bf16', 'avx512f', 'avx2')
DTYPE_NAMES = {torch.float32: 'float32', torch.bfloat16: 'bfloat16'}


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5,
                 min_total_s: float = 0.0) -> float:
    """Fastest of `repeats` timed calls (after one warm-up), repeating until min_total_s."""
    fn()
    _sync(device)
    best, total, runs = float('inf'), 0.0, 0
    while runs < repeats or total < min_total_s:
        start = time.perf_counter()
        fn()
        _sync(device)
        elapsed = time.perf_counter() - start
        best, total, runs = min(best, elapsed), total + elapsed, runs + 1
    return best


def matmul_flops(dtype: torch.dtype, shape: tuple[int, int, int] = PEAK_SHAPE,
                 device: torch.device | str = 'cpu', repeats: int = 5,
                 min_total_s: float = 0.0) -> float:
    """FLOP/s of an [M, K] x [K, N] matmul in `dtype` (best of `repeats`, current threads)."""
    device = torch.device(device)
    M, K, N = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(M, K, generator=gen).to(device, dtype)
    b = torch.randn(K, N, generator=gen).to(device, dtype)
    return 2 * M * K * N / best_seconds(lambda: torch.mm(a, b), device, repeats, min_total_s)


def copy_bandwidth(device: torch.device | str = 'cpu', nbytes: int = COPY_BYTES,
                   repeats: int = 5) -> float:
    """Bytes per second a large copy moves, reads plus writes (STREAM's 'copy' convention)."""
    device = torch.device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)   # both resident before timing
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), device, repeats)


def cpu_flags() -> tuple[str, ...]:
    """Return the CPU's bf16-relevant flags from /proc/cpuinfo (reported, never decisive)."""
    try:
        with open('/proc/cpuinfo') as info:
            flags = next((line.split(':', 1)[1].split() for line in info
                          if line.startswith('flags')), [])
    except OSError:
        return ()
    return tuple(f for f in CPU_FLAGS if f in flags)


@dataclasses.dataclass
class MachinePeaks:
    """Peak rates of this device at `threads` torch threads, measured now."""

    device: str
    threads: int
    matmul_flops: dict[str, float]   # dtype name -> FLOP/s of the PEAK_SHAPE matmul
    copy_bytes_per_s: float          # copy bandwidth, reads + writes
    matmul_shape: tuple[int, int, int] = PEAK_SHAPE

    def floor_s(self, flops: float, nbytes: float, dtype: str) -> tuple[float, str]:
        """Least time for `flops` of `dtype` matmuls and `nbytes` of memory traffic.

        Returns (seconds, 'compute' or 'memory': which of the two binds).
        """
        compute = flops / self.matmul_flops[dtype]
        memory = nbytes / self.copy_bytes_per_s
        return (compute, 'compute') if compute >= memory else (memory, 'memory')

    def describe(self) -> str:
        rates = ', '.join(f'{name} {flops / 1e9:.0f} GFLOP/s'
                          for name, flops in self.matmul_flops.items())
        M, K, N = self.matmul_shape
        return (f'{self.device}, {self.threads} threads: matmul {M}x{K}x{N} {rates}; copy '
                f'{self.copy_bytes_per_s / 1e9:.1f} GB/s (read + write)')


def measure_machine(device: torch.device | str = 'cpu',
                    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
                    ) -> MachinePeaks:
    """Measure the matmul peak per dtype (current thread count) and the copy bandwidth."""
    device = torch.device(device)
    flops = {DTYPE_NAMES[d]: matmul_flops(d, device=device, min_total_s=0.2) for d in dtypes}
    return MachinePeaks(str(device), torch.get_num_threads(), flops, copy_bandwidth(device))


def probe_shape(config: Pi05Config) -> tuple[int, int, int]:
    """Return the model's dominant matmul, capped: (about half the prefix) x W x mlp_dim."""
    backbone = config.backbone
    return (min(config.prefix_len // 2, 512), min(backbone.width, 2048),
            min(backbone.mlp_dim, 4096))


def bf16_speedup(config: Pi05Config, device: torch.device | str = 'cpu', rounds: int = 5,
                 min_total_s: float = 0.02) -> tuple[float, float, float]:
    """(bf16 / float32 speed, float32 FLOP/s, bf16 FLOP/s) at the model's matmul shape.

    The two dtypes are timed in alternation, best of each, so a stall of the machine hits
    both, not the one timed during it. On the CPU on one thread: the ratio is the ISA's, and
    a 2-thread matmul beside a busy core waits ~10 ms per call at OpenMP's barrier for its
    first dozen calls (measured here), which once made a loaded machine's float32 look 40x
    slower than bf16.
    """
    device = torch.device(device)
    threads = torch.get_num_threads()
    if device.type == 'cpu':
        torch.set_num_threads(1)
    try:
        return _bf16_speedup(config, device, rounds, min_total_s)
    finally:
        torch.set_num_threads(threads)


def _bf16_speedup(config, device, rounds, min_total_s) -> tuple[float, float, float]:
    M, K, N = probe_shape(config)
    gen = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(M, K, generator=gen), torch.randn(K, N, generator=gen)
    pairs = {dtype: (a32.to(device, dtype), b32.to(device, dtype))
             for dtype in (torch.float32, torch.bfloat16)}
    best = {dtype: float('inf') for dtype in pairs}
    total = 0.0
    for dtype, (a, b) in pairs.items():   # warm-up
        torch.mm(a, b)
    for run in range(1000):
        if run >= rounds and total >= min_total_s:
            break
        for dtype, (a, b) in pairs.items():
            _sync(device)
            start = time.perf_counter()
            torch.mm(a, b)
            _sync(device)
            elapsed = time.perf_counter() - start
            best[dtype], total = min(best[dtype], elapsed), total + elapsed
    fp32, bf16 = (2 * M * K * N / best[d] for d in (torch.float32, torch.bfloat16))
    return bf16 / fp32, fp32, bf16


def choose_dtype(config: Pi05Config, device: torch.device | str = 'cpu',
                 probe: Callable[[Pi05Config, torch.device], tuple[float, float, float]]
                 | None = None) -> tuple[torch.dtype, str]:
    """Resolve dtype 'auto': (bfloat16 or float32, why), by a timing probe on `device`.

    probe: returns (bf16 / float32 speed, float32 FLOP/s, bf16 FLOP/s); default bf16_speedup.
    """
    device = torch.device(device)
    if device.type == 'cuda':
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f'{torch.cuda.get_device_name(device)} supports bfloat16'
        return torch.float32, f'{torch.cuda.get_device_name(device)} has no bfloat16'
    if device.type != 'cpu':
        return torch.float32, f'no bfloat16 probe for device {device.type!r}'
    speedup, fp32, bf16 = (probe or bf16_speedup)(config, device)
    M, K, N = probe_shape(config)
    measured = (f'a {M}x{K}x{N} matmul in bfloat16 ran {speedup:.1f}x float32 '
                f'({bf16 / 1e9:.0f} vs {fp32 / 1e9:.0f} GFLOP/s on 1 thread; '
                f'CPU flags: {" ".join(cpu_flags()) or "unknown"})')
    if speedup >= BF16_MIN_SPEEDUP:
        return torch.bfloat16, measured
    return torch.float32, f'{measured}; bfloat16 needs {BF16_MIN_SPEEDUP}x'
