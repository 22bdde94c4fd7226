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
from typing import Callable, Sequence

import torch

from ..engine.hardware import MachinePeaks
from ..engine.runner import ModelRunner
from ..model import Pi05Model
from .floors import phase_work, Work

DECODE_GEN_LEN = 16   # generated tokens a timed decode step's rows already hold (J = 17)
# Steps timed in a row after a frame's first (the caches refill over a few steps: pi05-cpu on
# the AMX Xeon, one row: 3.5, 3.2, 2.6, 2.3, 2.1 ms, then 2.0-2.1; 29 rows: 9.5 ... 7.8, then
# 7.4-7.7 from the eighth); later steps cost as the last timed.
NEXT_STEPS = 5


@dataclasses.dataclass
class PhaseCosts:
    """Median wall time per phase, in seconds, plus each phase's work and floor."""

    vision_s: float
    prefill_s: float                 # vision + backbone over the prefix (includes vision_s)
    denoise_s: float                 # all flow-matching steps of one frame
    decode_s: dict[int, float]       # batch size -> a step right after a frame's passes
    flops: dict[str, float]          # phase ('vision', 'prefill', 'denoise', 'decode B') -> FLOPs
    memory_bytes: dict[str, float]   # phase -> bytes of weights and K/V it moves
    prefill_rows_s: dict[int, float] = dataclasses.field(default_factory=dict)  # R -> P(R)
    denoise_rows_s: dict[int, float] = dataclasses.field(default_factory=dict)  # R -> D(R)
    machine: MachinePeaks | None = None   # peaks measured in the same run (None: no floors)
    dtype: str = 'float32'           # the model's compute dtype (which matmul peak applies)
    # batch size -> the steps that follow a frame's first in a row (2nd, 3rd, ...: their
    # weights come back into the caches); later steps cost as the last; empty: as decode_s
    decode_next_s: dict[int, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    first_token_s: float = 0.0       # LM head over a new request's prefix (its first token)
    frontend_s: float = 0.0          # the frontend's conversion of one observation
    # batch size -> a prefill right after a frame's decode steps of that many rows (they
    # left the caches full of their prefixes); empty: prefill_s
    prefill_after_s: dict[int, float] = dataclasses.field(default_factory=dict)

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
        """Isolated frame time / oxygen frame time at (N, k) in the steady state.

        isolated: F + 2P + D + language(1, N), oxygen: F + P + D + language(B, k) with
        B = ceil(N/k) live requests (see language_s); F the frontend's conversions.
        """
        batch = -(-n_tokens // k)
        return self.frame_s(1, n_tokens, prefills=2) / self.frame_s(batch, k)

    def frame_s(self, batch: int, k: int, prefills: int = 1) -> float:
        """Seconds of one frame in the steady state (isolated: prefills=2).

        Frontend, `prefills` prefills, the denoise, language_s(batch, k); the first prefill
        follows the last frame's decode steps (prefill_after).
        """
        sizes = self.step_sizes(batch, k)
        first = self.prefill_after(max(sizes)) if sizes else self.prefill_s
        return (self.frontend_s + first + (prefills - 1) * self.prefill_s + self.denoise_s
                + self.language_s(batch, k))

    def prefill_after(self, batch: int) -> float:
        """Seconds of a prefill after steps of `batch` rows (outside the measured: nearest)."""
        if not self.prefill_after_s:
            return self.prefill_s
        sizes = sorted(self.prefill_after_s)
        return _interpolate(self.prefill_after_s, min(max(batch, sizes[0]), sizes[-1]))

    @staticmethod
    def step_sizes(batch: int, k: int, new: int = 1) -> list[int]:
        """Rows of each decode step of a frame (see language_s)."""
        return [b for b in [batch] * (k - 1) + [batch - new] if b > 0] if k > 0 else []

    def language_s(self, batch: int, k: int, new: int = 1) -> float:
        """One frame's language work: `batch` live requests advance k tokens each.

        `new` of them started this frame: their first token comes from the prefix (one LM
        head call, first_token_s) and they need k - 1 steps, so k - 1 steps run `batch` rows
        and the last `batch - new`. The first step reads weights the prefill and denoise
        evicted (decode_s), the next ones find more of them in the caches (decode_next_s: on
        the AMX Xeon a pi05-cpu step of nine rows 4.1, then 3.8, 3.2, 3.0 ms).
        """
        if k <= 0:
            return 0.0
        return self.first_token_s + sum(self.step_s(b, i) for i, b
                                        in enumerate(self.step_sizes(batch, k, new)))

    def step_s(self, batch: int, index: int) -> float:
        """Seconds of a frame's index-th decode step (0: the first) of `batch` rows."""
        if index == 0 or not self.decode_next_s:
            return self.decode_at(batch)
        later = min(index, len(next(iter(self.decode_next_s.values())))) - 1
        return _interpolate({b: steps[later] for b, steps in self.decode_next_s.items()}, batch)

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
    frontend: a call that converts the observations of `frames` (one each) as the engine's
    frontend does; timed as 'frontend', per observation like 'prefill' (None: F = 0).
    """

    @torch.no_grad()
    def __init__(self, model: Pi05Model, batches=(1, 4, 8), warmup: int = 2, seed: int = 0,
                 rows=(1,), frames: Sequence[dict] | None = None,
                 machine: MachinePeaks | None = None, compare_eager: bool = False,
                 frontend: Callable[[], object] | None = None):
        cfg = model.config
        self._frontend = frontend
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
        # Decode steps run as the engine runs them (ModelRunner.decode: each row's generated
        # entries in a block of their own, the engine's graph and host work); the prefills
        # write the runner's prefix slots.
        self._runner = ModelRunner(model, max_batch, 2 * DECODE_GEN_LEN)
        self._kv = self._runner.kv
        images, image_masks = self._prefill_inputs[:2]
        # The vision pass sees what prefill feeds it: the first frame's unmasked cameras.
        self._shown_images = images.flatten(0, 1)[image_masks.flatten()].to(model.compute_dtype)
        for slot in range(max_batch):
            self._prefix = self._run_prefill(slot)
            self._runner.store.record_prefix(slot, self._prefix.valid[0],
                                             self._prefix.n_valid[0], self._prefix.last_hidden[0])
        self._noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g).to(device)
        self._row_prefix = {r: self._run_prefill_rows(r) for r in self.rows}
        self.samples: dict[str, list[float]] = {name: [] for name in self._passes()}
        # A model its engine's warm-up sealed (the benchmark's) compiles the probe's own shapes
        # here too (its pool's sizes, batch sizes the engine's warm-up did not run), which a
        # sealed model would run eager in every timed sample.
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
        """One step of `batch` rows, each on a prefix of its own, DECODE_GEN_LEN generated."""
        rows = list(range(batch))
        self._runner.decode(rows, rows, [DECODE_GEN_LEN] * batch, [5] * batch)

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
                  'denoise': lambda: self.model.sample_actions(self._prefix, self._noise),
                  'first token': lambda: self.model.lm_logits(
                      self._prefix.last_hidden).argmax(-1).tolist()}
        if self._frontend is not None:
            passes['frontend'] = self._frontend
        passes.update({f'decode {b}': (lambda b=b: self._decode(b)) for b in self.batches})
        passes.update({f'decode {b} #{i}': (lambda b=b: self._decode(b))
                       for b in self.batches for i in range(2, 2 + NEXT_STEPS)})
        passes.update({f'prefill after {b}': self._run_prefills for b in self.batches})
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
        """Time every pass once (synced clocks), each where it runs in a frame.

        A frame runs prefill, denoise, its new requests' first token, then decode steps: the
        first step finds its weights evicted, and the next frame's prefill finds the caches
        full of what the steps read (B rows on B prefixes). So per batch size B: a frame's
        passes, 'decode B', 'decode B #2', ... in a row, and the prefill after them is timed
        as 'prefill after B' (the first frame's as 'prefill').
        """
        passes = self._passes()
        in_frames = {'prefill', 'denoise', 'first token'}
        after = None   # the batch whose steps ran last
        for batch in self.batches + (None,):
            name = 'prefill' if after is None else f'prefill after {after}'
            self._time(name, passes[name])
            in_frames.add(name)
            if batch is None:
                break
            for name in ('denoise', 'first token'):
                self._time(name, passes[name], record=after is None)
            for step in range(1, 2 + NEXT_STEPS):
                name = f'decode {batch}' + (f' #{step}' if step > 1 else '')
                self._time(name, passes[name])
                in_frames.add(name)
            eager = f'decode {batch} eager'
            if eager in passes:   # compared with 'decode B': after a frame's passes too
                for name in ('prefill', 'denoise', 'first token'):
                    self._time(name, passes[name], record=False)
                self._time(eager, passes[eager])
                in_frames.add(eager)
            after = batch
        for name, fn in passes.items():
            if name not in in_frames:
                self._time(name, fn)

    def _time(self, name: str, fn: Callable, record: bool = True) -> None:
        self._sync()
        start = time.perf_counter()
        fn()
        self._sync()
        if record:   # prefills and conversions of every frame: per frame
            per_frame = name == 'frontend' or (name.startswith('prefill') and ' x' not in name)
            runs = len(self._frames) if per_frame else 1
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
                          {b: tuple(s[f'decode {b} #{j}'] for j in range(2, 2 + NEXT_STEPS))
                           for b in self.batches},
                          s['first token'], s.get('frontend', 0.0),
                          {b: s[f'prefill after {b}'] for b in self.batches})

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
