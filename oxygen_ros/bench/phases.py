"""Per-phase cost of the π0.5 passes: measured time next to FLOP and byte accounting.

Used for the model's phase table (`oxygen-ros phases`) and as the benchmark's component
model: prefill P, denoise D, decode step d(B) per batch size; for several robots served by one
engine also P(R) and D(R), one prefill / denoise over the frames of R robots.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Sequence

import torch

from ..model import KVTensors, Pi05Config, Pi05Model


@dataclasses.dataclass
class PhaseCosts:
    """Median wall time per phase, in seconds, plus analytic FLOPs and weight bytes."""

    vision_s: float
    prefill_s: float                 # vision + backbone over the prefix (includes vision_s)
    denoise_s: float                 # all flow-matching steps of one frame
    decode_s: dict[int, float]       # batch size -> one decode step
    flops: dict[str, float]          # analytic multiply-adds × 2 per phase
    weight_bytes: dict[str, float]   # parameter bytes each phase reads
    prefill_rows_s: dict[int, float] = dataclasses.field(default_factory=dict)  # R -> P(R)
    denoise_rows_s: dict[int, float] = dataclasses.field(default_factory=dict)  # R -> D(R)

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
        """(2P + D + N·d(1)) / (P + D + k·d(ceil(N/k))): isolated vs oxygen frame time."""
        batch = -(-n_tokens // k)
        d1, dB = self.decode_at(1), self.decode_at(batch)
        isolated = 2 * self.prefill_s + self.denoise_s + n_tokens * d1
        return isolated / (self.prefill_s + self.denoise_s + k * dB)

    def decode_at(self, batch: int) -> float:
        """Decode step time at `batch`, linearly interpolated between measured sizes."""
        sizes = sorted(self.decode_s)
        if batch in self.decode_s:
            return self.decode_s[batch]
        lo = max([s for s in sizes if s < batch], default=sizes[0])
        hi = min([s for s in sizes if s > batch], default=sizes[-1])
        if lo == hi:
            return self.decode_s[lo] * batch / lo
        w = (batch - lo) / (hi - lo)
        return (1 - w) * self.decode_s[lo] + w * self.decode_s[hi]


def analytic_costs(cfg: Pi05Config) -> tuple[dict[str, float], dict[str, float]]:
    """Count FLOPs (2 × multiply-adds, matmuls only) and fp32 parameter bytes per phase."""
    b, e, v = cfg.backbone, cfg.expert, cfg.vision

    def gemma_layer_params(g):
        attn = g.width * (2 * g.num_heads + 2 * g.num_kv_heads) * g.head_dim
        return attn + 3 * g.width * g.mlp_dim

    vis_params = v.depth * (4 * v.hidden ** 2 + 2 * v.hidden * v.mlp_dim) + v.hidden * b.width
    bb_params = b.depth * gemma_layer_params(b)
    ex_params = e.depth * gemma_layer_params(e)
    lm_head = b.vocab_size * b.width
    P, H, Ti = cfg.prefix_len, cfg.action_horizon, cfg.tokens_per_image
    attn_prefill = b.depth * 2 * P * P * b.num_heads * b.head_dim
    flops = {
        'vision': 2 * cfg.num_cameras * Ti * vis_params,
        'prefill': 2 * cfg.num_cameras * Ti * vis_params + 2 * P * bb_params + 2 * attn_prefill,
        'denoise': cfg.num_steps * (2 * H * ex_params + 4 * e.depth * H * (P + H)
                                    * e.num_heads * e.head_dim),
        'decode_step_b1': 2 * (bb_params + lm_head) + 4 * b.depth * P * b.num_heads * b.head_dim,
    }
    weight_bytes = {'vision': 4 * vis_params, 'prefill': 4 * (vis_params + bb_params),
                    'denoise': 4 * ex_params * cfg.num_steps,
                    'decode_step': 4 * (bb_params + lm_head)}
    return flops, weight_bytes


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
    """

    @torch.no_grad()
    def __init__(self, model: Pi05Model, batches=(1, 4, 8), warmup: int = 2, seed: int = 0,
                 rows=(1,), frames: Sequence[dict] | None = None):
        cfg = model.config
        device = next(model.parameters()).device
        self.model = model
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
        self.samples: dict[str, list[float]] = {'vision': [], 'prefill': [], 'denoise': []}
        self.samples.update({f'decode {b}': [] for b in self.batches})
        self.samples.update({f'{phase} x{r}': [] for r in self.rows
                             for phase in ('prefill', 'denoise')})
        for _ in range(warmup):
            for fn in self._passes().values():
                fn()

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
                               self._n_valid[:batch], torch.full((batch,), 16),
                               torch.full((batch,), 5))

    def _passes(self) -> dict:
        passes = {'vision': lambda: self.model.vision.vision_model(self._shown_images),
                  'prefill': self._run_prefills,
                  'denoise': lambda: self.model.sample_actions(self._prefix, self._noise)}
        passes.update({f'decode {b}': (lambda b=b: self._decode(b)) for b in self.batches})
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
        flops, weight_bytes = analytic_costs(self.model.config)
        return PhaseCosts(s['vision'], s['prefill'], s['denoise'],
                          {b: s[f'decode {b}'] for b in self.batches}, flops, weight_bytes,
                          {r: s[f'prefill x{r}'] for r in self.rows},
                          {r: s[f'denoise x{r}'] for r in self.rows})


def measure_phases(model: Pi05Model, batches=(1, 4, 8), repeats: int = 5,
                   warmup: int = 2, seed: int = 0, statistic=statistics.median,
                   frames: Sequence[dict] | None = None) -> PhaseCosts:
    """Time each pass of `model` (warm-up excluded, synced clocks).

    `statistic` reduces the repeats of each pass (median by default; `min` gives the least
    disturbed run on a busy machine). frames: the prefill inputs to time (see PhaseProbe;
    None: random inputs with every camera).
    """
    probe = PhaseProbe(model, batches, warmup, seed, frames=frames)
    for _ in range(repeats):
        probe.sample()
    return probe.costs(statistic)


def format_phases(costs: PhaseCosts) -> str:
    """Format the measured phases as a markdown table."""
    gf = costs.flops
    lines = ['| phase | time (ms) | GFLOP | weights read (MB) |', '|---|---:|---:|---:|',
             f'| vision (cameras shown) | {costs.vision_s * 1e3:.1f} | {gf["vision"] / 1e9:.2f} '
             f'| {costs.weight_bytes["vision"] / 1e6:.1f} |',
             f'| prefill (vision + backbone) | {costs.prefill_s * 1e3:.1f} '
             f'| {gf["prefill"] / 1e9:.2f} | {costs.weight_bytes["prefill"] / 1e6:.1f} |',
             f'| denoise (all steps) | {costs.denoise_s * 1e3:.1f} | {gf["denoise"] / 1e9:.2f} '
             f'| {costs.weight_bytes["denoise"] / 1e6:.1f} |']
    for batch, sec in sorted(costs.decode_s.items()):
        lines.append(f'| decode step, batch {batch} | {sec * 1e3:.2f} '
                     f'| {batch * gf["decode_step_b1"] / 1e9:.3f} '
                     f'| {costs.weight_bytes["decode_step"] / 1e6:.1f} |')
    return '\n'.join(lines)
