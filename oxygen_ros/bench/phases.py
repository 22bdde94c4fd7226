"""Per-phase cost of the π0.5 passes: measured time next to its floor on this machine.

Used for the model's phase table (`oxygen-ros phases`) and as the benchmark's component
model: prefill P, denoise D, decode step d(B) per batch size; for several robots served by one
engine also P(R) and D(R), one prefill / denoise over the frames of R robots. Each phase
carries its analytic work (floors.py) and, with the machine's peaks measured in the same run,
its floor and the ratio of its time to it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Sequence

import torch

from ..engine.hardware import MachinePeaks
from ..model import KVTensors, Pi05Model
from .floors import phase_work, Work

DECODE_GEN_LEN = 16   # generated tokens a timed decode step's rows already hold (J = 17)


@dataclasses.dataclass
class PhaseCosts:
    """Median wall time per phase, in seconds, plus each phase's work and floor."""

    vision_s: float
    prefill_s: float                 # vision + backbone over the prefix (includes vision_s)
    denoise_s: float                 # all flow-matching steps of one frame
    decode_s: dict[int, float]       # batch size -> one decode step
    flops: dict[str, float]          # phase ('vision', 'prefill', 'denoise', 'decode B') -> FLOPs
    memory_bytes: dict[str, float]   # phase -> bytes of weights and K/V it moves
    prefill_rows_s: dict[int, float] = dataclasses.field(default_factory=dict)  # R -> P(R)
    denoise_rows_s: dict[int, float] = dataclasses.field(default_factory=dict)  # R -> D(R)
    machine: MachinePeaks | None = None   # peaks measured in the same run (None: no floors)
    dtype: str = 'float32'           # the model's compute dtype (which matmul peak applies)
    # batch size -> a decode step right after another of its batch (its weights still in the
    # caches: the second and later of a frame's steps); empty: as decode_s
    decode_warm_s: dict[int, float] = dataclasses.field(default_factory=dict)

    def seconds(self, phase: str) -> float:
        """Measured time of a phase ('vision', 'prefill', 'denoise', 'decode B', 'action')."""
        if phase == 'action':
            return self.prefill_s + self.denoise_s
        if phase.startswith('decode '):
            return self.decode_s[int(phase.split()[1])]
        return {'vision': self.vision_s, 'prefill': self.prefill_s,
                'denoise': self.denoise_s}[phase]

    def floor(self, phase: str) -> tuple[float, str]:
        """(floor seconds, what binds: compute / memory) of a phase; 'action' = P + D."""
        if self.machine is None:
            return float('nan'), ''
        if phase == 'action':
            (p, p_bound), (d, d_bound) = self.floor('prefill'), self.floor('denoise')
            return p + d, p_bound if p_bound == d_bound else f'{p_bound} + {d_bound}'
        return self.machine.floor_s(self.flops[phase], self.memory_bytes[phase], self.dtype)

    def x_floor(self, phase: str) -> float:
        """Measured time / floor of a phase."""
        return self.seconds(phase) / self.floor(phase)[0]

    def prefill_at(self, rows: int) -> float:
        """P(R): one prefill over R observations (R × P where R was not measured)."""
        if rows == 1:
            return self.prefill_s
        return self.prefill_rows_s.get(rows, rows * self.prefill_s)

    def denoise_at(self, rows: int) -> float:
        """D(R): one flow matching over R prefixes (R × D where R was not measured)."""
        if rows == 1:
            return self.denoise_s
        return self.denoise_rows_s.get(rows, rows * self.denoise_s)

    def ideal_speedup(self, n_tokens: int, k: int) -> float:
        """(2P + D + d1(N)) / (P + D + dB(k)): isolated vs oxygen frame time.

        d1(N): N decode steps of one row in a row, dB(k): k steps of B = ceil(N/k) rows
        (decode_steps: the first after the frame's prefill and denoise, the others warm).
        """
        batch = -(-n_tokens // k)
        isolated = 2 * self.prefill_s + self.denoise_s + self.decode_steps(1, n_tokens)
        return isolated / (self.prefill_s + self.denoise_s + self.decode_steps(batch, k))

    def decode_steps(self, batch: int, steps: int) -> float:
        """Seconds of `steps` decode steps of `batch` rows in a row, after a frame's passes.

        The first reads weights the prefill and denoise evicted (decode_s); the others find
        them in the caches (decode_warm_s: on the AMX Xeon a pi05-cpu step of one row 1.6 vs
        3.0 ms, so N steps in a row cost far less than N cold ones).
        """
        if steps <= 0:
            return 0.0
        warm = _interpolate(self.decode_warm_s or self.decode_s, batch)
        return self.decode_at(batch) + (steps - 1) * warm

    def decode_at(self, batch: int) -> float:
        """Decode step time at `batch`, linearly interpolated between measured sizes."""
        return _interpolate(self.decode_s, batch)


def _interpolate(seconds: dict[int, float], batch: int) -> float:
    """Time at `batch` from times at measured batch sizes, linearly between them."""
    sizes = sorted(seconds)
    if batch in seconds:
        return seconds[batch]
    lo = max([s for s in sizes if s < batch], default=sizes[0])
    hi = min([s for s in sizes if s > batch], default=sizes[-1])
    if lo == hi:
        return seconds[lo] * batch / lo
    w = (batch - lo) / (hi - lo)
    return (1 - w) * seconds[lo] + w * seconds[hi]


class PhaseProbe:
    """Times one run of every pass per `sample()`; `costs()` reduces the samples.

    Built once (random inputs, a private KV cache of max(batches) slots, warm-up done), then
    sampled as often as wanted: back to back by `measure_phases`, or interleaved with other
    work by the benchmark, so the component model sees the same machine state as the frames
    it is compared with.

    frames: prefill inputs of real frames (`Frontend.prepare(obs).tensors`, one row each).
    Prefill computes only the valid positions (unmasked cameras, prompt tokens), so its cost
    depends on the frame: a component model must see frames like the ones it is compared
    with. One 'prefill' sample is the mean over `frames`; P(R) cycles through them. None:
    random inputs with every camera and a quarter-length prompt (`oxygen-ros phases`).
    machine: peaks of this machine (hardware.measure_machine) for the floors, or None.
    compare_eager: also time denoise and decode 1 with the model's compiled passes switched
    off ('denoise eager', 'decode 1 eager'), side by side with the compiled ones.
    """

    @torch.no_grad()
    def __init__(self, model: Pi05Model, batches=(1, 4, 8), warmup: int = 2, seed: int = 0,
                 rows=(1,), frames: Sequence[dict] | None = None,
                 machine: MachinePeaks | None = None, compare_eager: bool = False):
        cfg = model.config
        device = next(model.parameters()).device
        self.model = model
        self.machine = machine
        self.compare_eager = compare_eager and (model._denoise_fn or model._decode_fn) is not None
        self.batches = tuple(sorted(batches))
        self.rows = tuple(sorted(r for r in set(rows) if r > 1))   # R of P(R), D(R)
        self._sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
        g = torch.Generator().manual_seed(seed)
        if frames:
            self._frames = [tuple(f[key].to(device) for key in
                                  ('images', 'image_masks', 'tokens', 'token_masks'))
                            for f in frames]
        else:
            S = cfg.vision.image_size
            images = (torch.rand(1, cfg.num_cameras, 3, S, S, generator=g) * 2 - 1).to(device)
            image_masks = torch.ones(1, cfg.num_cameras, dtype=torch.bool, device=device)
            tokens = torch.randint(3, cfg.backbone.vocab_size, (1, cfg.max_token_len),
                                   generator=g)
            token_masks = torch.zeros(1, cfg.max_token_len, dtype=torch.bool, device=device)
            token_masks[:, : cfg.max_token_len // 4] = True
            self._frames = [(images, image_masks, tokens.to(device), token_masks)]
        self._prefill_inputs = self._frames[0]
        max_batch = max(self.batches + self.rows)
        self._kv = KVTensors.allocate(cfg, max_batch, cfg.prefix_len + 64, model.compute_dtype,
                                      device)
        images, image_masks = self._prefill_inputs[:2]
        # The vision pass sees what prefill feeds it: the first frame's unmasked cameras.
        self._shown_images = images.flatten(0, 1)[image_masks.flatten()].to(model.compute_dtype)
        for slot in range(max_batch):
            self._prefix = self._run_prefill(slot)
        self._noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g).to(device)
        self._row_prefix = {r: self._run_prefill_rows(r) for r in self.rows}
        self._valid = self._prefix.valid.expand(max_batch, -1)     # [max_batch, P]
        self._n_valid = self._prefix.n_valid.expand(max_batch)     # [max_batch]
        self.samples: dict[str, list[float]] = {name: [] for name in self._passes()}
        # A model its engine's warm-up sealed (the benchmark's) compiles the probe's own shapes
        # here too: its decode keeps the generated entries in the prefix slot, another graph
        # than the engine's, which a sealed model would run eager in every timed sample.
        sealed = any(fn.sealed for fn in model.compiled_functions)
        model.seal_compiled(False)
        try:
            for _ in range(warmup):
                for fn in self._passes().values():
                    fn()
        finally:
            model.seal_compiled(sealed)

    def _run_prefill(self, slot: int = 0):
        return self.model.prefill(*self._prefill_inputs, kv=self._kv,
                                  slots=torch.tensor([slot]))

    def _run_prefills(self) -> None:
        """Prefill every frame once (one row each); `sample` divides the time by their count."""
        slots = self._kv.k.shape[1]
        for index, frame in enumerate(self._frames):
            self.model.prefill(*frame, kv=self._kv, slots=torch.tensor([index % slots]))

    def _run_prefill_rows(self, rows: int):
        """One prefill of `rows` observations (the frames in turn) into slots 0..R-1."""
        chosen = [self._frames[i % len(self._frames)] for i in range(rows)]
        inputs = [torch.cat(parts) for parts in zip(*chosen)]
        return self.model.prefill(*inputs, kv=self._kv, slots=torch.arange(rows))

    def _decode(self, batch: int):
        self.model.decode_step(self._kv, torch.arange(batch), self._valid[:batch],
                               self._n_valid[:batch], torch.full((batch,), DECODE_GEN_LEN),
                               torch.full((batch,), 5))

    def _eager(self, fn):
        """Run fn with the model's compiled passes switched off (the eager comparison)."""
        model = self.model
        saved = model._denoise_fn, model._decode_fn
        model._denoise_fn = model._decode_fn = None
        try:
            fn()
        finally:
            model._denoise_fn, model._decode_fn = saved

    def work(self) -> dict[str, Work]:
        """Analytic work of the timed passes (the first frame's shown cameras and positions)."""
        images, image_masks, _, token_masks = self._frames[0]
        shown = int(image_masks.sum())
        valid = shown * self.model.config.tokens_per_image + int(token_masks.sum())
        packed = self._kv.k.device.type == 'cpu'   # action_context packs on the host only
        return phase_work(self.model, shown, valid, self.batches, DECODE_GEN_LEN + 1,
                          self._kv.k.dtype, denoise_keys=valid if packed else None)

    def _passes(self) -> dict:
        passes = {'vision': lambda: self.model.vision_features(self._shown_images),
                  'prefill': self._run_prefills,
                  'denoise': lambda: self.model.sample_actions(self._prefix, self._noise)}
        passes.update({f'decode {b}': (lambda b=b: self._decode(b)) for b in self.batches})
        passes.update({f'decode {b} warm': (lambda b=b: self._decode(b)) for b in self.batches})
        if self.compare_eager:
            passes['denoise eager'] = lambda: self._eager(passes['denoise'])
            passes['decode 1 eager'] = lambda: self._eager(lambda: self._decode(1))
        for r in self.rows:
            noise = self._noise.expand(r, -1, -1)
            passes[f'prefill x{r}'] = lambda r=r: self._run_prefill_rows(r)
            passes[f'denoise x{r}'] = (lambda r=r, noise=noise:
                                       self.model.sample_actions(self._row_prefix[r], noise))
        return passes

    @torch.no_grad()
    def sample(self) -> None:
        """Time every pass once (synced clocks)."""
        for name, fn in self._passes().items():
            if name.endswith(' warm'):   # after an untimed step of its batch: warm weights
                fn()
            self._sync()
            start = time.perf_counter()
            fn()
            self._sync()
            runs = len(self._frames) if name == 'prefill' else 1   # mean over the frames
            self.samples[name].append((time.perf_counter() - start) / runs)

    def costs(self, statistic=statistics.median) -> PhaseCosts:
        """Per pass `statistic` of the samples so far, plus the analytic FLOPs and bytes."""
        assert self.samples['prefill'], 'no samples yet'
        s = {name: statistic(values) for name, values in self.samples.items()}
        work = self.work()
        return PhaseCosts(s['vision'], s['prefill'], s['denoise'],
                          {b: s[f'decode {b}'] for b in self.batches},
                          {name: w.flops for name, w in work.items()},
                          {name: w.bytes for name, w in work.items()},
                          {r: s[f'prefill x{r}'] for r in self.rows},
                          {r: s[f'denoise x{r}'] for r in self.rows}, self.machine,
                          str(self.model.compute_dtype).removeprefix('torch.'),
                          {b: s[f'decode {b} warm'] for b in self.batches})

    def eager_seconds(self, statistic=statistics.median) -> dict[str, float]:
        """Eager times of the compare_eager passes ({} without it)."""
        return {name.removesuffix(' eager'): statistic(values)
                for name, values in self.samples.items() if name.endswith(' eager') and values}


def measure_phases(model: Pi05Model, batches=(1, 4, 8), repeats: int = 5,
                   warmup: int = 2, seed: int = 0, statistic=statistics.median,
                   frames: Sequence[dict] | None = None,
                   machine: MachinePeaks | None = None) -> PhaseCosts:
    """Time each pass of `model` (warm-up excluded, synced clocks).

    `statistic` reduces the repeats of each pass (median by default; `min` gives the least
    disturbed run on a busy machine). frames: the prefill inputs to time (see PhaseProbe;
    None: random inputs with every camera). machine: peaks for the floors (None: no floors).
    """
    probe = PhaseProbe(model, batches, warmup, seed, frames=frames, machine=machine)
    for _ in range(repeats):
        probe.sample()
    return probe.costs(statistic)


PHASE_LABELS = {'vision': 'vision (cameras shown)', 'prefill': 'prefill (vision + backbone)',
                'denoise': 'denoise (all steps)', 'action': 'action path (prefill + denoise)'}


def floor_rows(costs: PhaseCosts, eager: dict[str, float] | None = None) -> list[dict]:
    """One row per phase (and the action path): time, work, floor, what binds, x floor."""
    eager = eager or {}
    phases = ['vision', 'prefill', 'denoise'] + [f'decode {b}' for b in sorted(costs.decode_s)]
    rows = []
    for phase in phases + ['action']:
        parts = ('prefill', 'denoise') if phase == 'action' else (phase,)
        floor, bound = costs.floor(phase)
        rows.append({
            'phase': phase,
            'label': PHASE_LABELS.get(phase, phase.replace('decode', 'decode step, batch')),
            'ms': 1e3 * costs.seconds(phase), 'eager_ms': 1e3 * eager.get(phase, math.nan),
            'gflop': sum(costs.flops[p] for p in parts) / 1e9,
            'mb_moved': sum(costs.memory_bytes[p] for p in parts) / 1e6,
            'floor_ms': 1e3 * floor, 'bound': bound, 'x_floor': costs.x_floor(phase),
            'dtype': costs.dtype})
    return rows


def _ms(seconds: float) -> str:
    return f'{seconds * 1e3:.2f}' if seconds < 0.01 else f'{seconds * 1e3:.1f}'


def format_phases(costs: PhaseCosts, eager: dict[str, float] | None = None) -> str:
    """Format the measured phases, their work and floors as a markdown table.

    eager: eager times of some phases measured side by side (PhaseProbe.eager_seconds).
    """
    rows = floor_rows(costs, eager)
    with_eager = any(not math.isnan(r['eager_ms']) for r in rows)
    lines = ['| phase | time (ms) | GFLOP | MB moved | floor (ms) | bound | x floor |'
             + (' eager (ms) |' if with_eager else ''),
             '|---|---:|---:|---:|---:|---|---:|' + ('---:|' if with_eager else '')]
    for r in rows:
        label = f'**{r["label"]}**' if r['phase'] == 'action' else r['label']
        line = (f'| {label} | {_ms(r["ms"] / 1e3)} | {r["gflop"]:.3f} | {r["mb_moved"]:.1f} | '
                f'{_ms(r["floor_ms"] / 1e3)} | {r["bound"]} | {r["x_floor"]:.1f} |')
        if with_eager:
            line += '' if math.isnan(r['eager_ms']) else f' {_ms(r["eager_ms"] / 1e3)}'
            line += ' |'
        lines.append(line)
    return '\n'.join(lines)
