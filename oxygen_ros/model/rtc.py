"""Real-time chunking (RTC): the next action chunk continues the one the robot is executing.

Black, Galliker, Levine 2025 (arXiv 2506.07339) treat the new chunk as inpainting. Its rows
line up in time with the rest of the committed chunk (the target Y):

    new chunk rows   0 .. d-1         d .. end-1            end .. H-1
    weight W_i       1 (frozen)       decays 1 -> 0         0 (free)
                     execute while    soft overlap:         beyond the committed
                     inference runs   guided toward Y       chunk's reach

Modes (the rows' weights are the same, what is done with them differs):
  guided   ΠGDM guidance (the paper's eq. 2-4): at each Euler step the velocity is corrected
           by the vector-Jacobian product of the weighted error of the one-step clean
           estimate, through the action expert, scaled by min(β, (1-τ)/(τ r²)).
  prefix   rows 0..d-1 are held clean (x = Y) with flow time 0 on their tokens, for
           checkpoints trained with delays (training-time RTC); they come out exactly Y.

Time convention: openpi's, not the paper's. Here x at t=1 is noise, t=0 the actions, Euler
steps dt = -1/n, and the expert's velocity is v = noise - actions. The paper's τ = 1 - t and
its velocity is -v, so with the clean estimate Â = x_t - t v:

    paper   v' = v_p + g(τ) Jᵀ W (Y - Â),   g(τ) = min(β, (1-τ) / (τ r_τ²)),
            r_τ² = (1-τ)² / (τ² + (1-τ)²)
    here    v' = v - g(t) Jᵀ W (Y - Â),     g(t) = min(β, (t² + (1-t)²) / (t (1-t)))

where J = ∂Â/∂x_t = I - t ∂v/∂x_t. The sign is checked by a test: with a velocity field that
does not depend on x the weighted error shrinks by exactly (1 - g/n) per step.

Shapes: B rows, H action rows, A action width (the model's, padding included).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np
import torch

from .config import DEFAULT_MAX_GUIDANCE_WEIGHT

OFF, GUIDED, PREFIX = 'off', 'guided', 'prefix'
MODES = (OFF, GUIDED, PREFIX)
LINEAR, EXP = 'linear', 'exp'
SCHEDULES = (LINEAR, EXP)

# velocity(x_t [B, H, A], t [B] or per token [B, H]) -> v [B, H, A]: one denoise step of the
# action expert over a slot's prefix K/V (Pi05Model.sample_actions binds the prefix).
Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def overlap_weights(horizon: int, delay: int, overlap_end: int,
                    schedule: str = EXP) -> np.ndarray:
    """Return the per-row weights W float32 [horizon] (the paper's eq. 5).

    Rows i < delay: 1; delay <= i < overlap_end: c_i = (end - i) / (end - d + 1), as is
    (linear) or c_i (e^c_i - 1) / (e - 1) (exp); rows i >= overlap_end: 0. overlap_end is
    the paper's H - s (s: the execution horizon); it is raised to at least `delay`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f'schedule must be one of {SCHEDULES}, got {schedule!r}')
    if not 0 <= delay <= horizon or overlap_end < 0:
        raise ValueError(f'need 0 <= delay <= horizon and overlap_end >= 0, got delay {delay}, '
                         f'horizon {horizon}, overlap_end {overlap_end}')
    end = min(max(overlap_end, delay), horizon)
    rows = np.arange(horizon, dtype=np.float64)
    c = (end - rows) / (end - delay + 1)
    if schedule == EXP:
        c = c * np.expm1(c) / (math.e - 1)
    weights = np.where(rows < delay, 1.0, np.where(rows < end, c, 0.0))
    return weights.astype(np.float32)


def guidance_weight(t: float, max_weight: float) -> float:
    """Return g(t) = min(β, (t² + (1-t)²) / (t (1-t))) at openpi flow time t (1 = noise)."""
    if t <= 0.0 or t >= 1.0:
        return max_weight
    return min(max_weight, (t * t + (1 - t) ** 2) / (t * (1 - t)))


@dataclasses.dataclass
class RowPlan:
    """What one row of a batch inpaints (plain numpy; Inpainting.from_rows makes tensors)."""

    target: np.ndarray            # float [n, A] normalised committed rows (n <= H)
    weights: np.ndarray           # float [H] guidance weight per row (guided; 0 = free)
    delay: int                    # d: rows 0..d-1 play before the chunk arrives
    hold: bool = False            # prefix mode: rows 0..d-1 held clean instead of guided
    max_guidance_weight: float = DEFAULT_MAX_GUIDANCE_WEIGHT   # β
    columns: int | None = None    # guided columns (the robot's; None: all): the padding
    #                               columns' error would otherwise steer the real ones


def row_plan(mode: str, target: np.ndarray, horizon: int, delay: int, overlap_end: int,
             schedule: str = EXP,
             max_guidance_weight: float = DEFAULT_MAX_GUIDANCE_WEIGHT,
             columns: int | None = None) -> RowPlan | None:
    """Plan one row: guided (weights over the overlap) or prefix (delay rows frozen).

    target: normalised committed rows [n, A] aligned with the new chunk's rows 0..n-1; rows
    past n have nothing to continue (weight 0). The delay is capped at n and below the
    horizon (the chunk keeps a row to play). None for mode off or when nothing is committed.
    """
    if mode not in MODES:
        raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
    n = min(len(target), horizon)
    if mode == OFF or n == 0:
        return None
    delay = max(0, min(delay, n, horizon - 1))
    if mode == PREFIX:
        return RowPlan(target[:n], np.zeros(horizon, np.float32), delay, True,
                       max_guidance_weight, columns)
    weights = overlap_weights(horizon, delay, min(overlap_end, n), schedule)
    return RowPlan(target[:n], weights, delay, False, max_guidance_weight, columns)


@dataclasses.dataclass
class Inpainting:
    """What a denoise loop inpaints, for every row of its batch (tensors on the model device)."""

    target: torch.Tensor          # float32 [B, H, A] committed rows (zeros where none)
    weights: torch.Tensor         # float32 [B, H, A] guidance weights (0 everywhere: no VJP)
    frozen: torch.Tensor          # bool [B, H, 1] rows held clean
    max_guidance_weight: torch.Tensor   # float32 [B, 1, 1] β per row
    guided: bool                  # any weight > 0: the loop pays the vector-Jacobian product
    held: bool                    # any frozen row: the loop passes per-token time

    @classmethod
    def from_rows(cls, rows: Sequence[RowPlan | None], horizon: int, action_dim: int,
                  device: torch.device | str = 'cpu') -> Inpainting | None:
        """Stack one plan per batch row (None: that row is free); None if every row is free."""
        if all(row is None for row in rows):
            return None
        B = len(rows)
        target = np.zeros((B, horizon, action_dim), np.float32)
        weights = np.zeros((B, horizon, action_dim), np.float32)
        frozen = np.zeros((B, horizon), bool)
        beta = np.zeros(B, np.float32)
        for b, row in enumerate(rows):
            if row is None:
                continue
            n, width = row.target.shape
            if width != action_dim or n > horizon or row.weights.shape != (horizon,):
                raise ValueError(f'row {b}: target {row.target.shape} / weights '
                                 f'{row.weights.shape} do not fit [{horizon}, {action_dim}]')
            target[b, :n] = row.target
            weights[b, :n, :row.columns] = row.weights[:n, None]   # nothing to continue past n
            frozen[b, :row.delay] = row.hold
            beta[b] = row.max_guidance_weight
        return cls(torch.from_numpy(target).to(device),
                   torch.from_numpy(weights).to(device),
                   torch.from_numpy(frozen[..., None]).to(device),
                   torch.from_numpy(beta[:, None, None]).to(device),
                   guided=bool(weights.any()), held=bool(frozen.any()))


def guided_velocity(velocity: Velocity, x_t: torch.Tensor, t: torch.Tensor, t_now: float,
                    inpaint: Inpainting) -> torch.Tensor:
    """Return v - g(t) Jᵀ W (Y - Â) [B, H, A], Â = x_t - t v (see the module docstring).

    One expert pass with autograd on and one backward pass to x_t only (the prefix K/V and
    the weights get no gradient), so the step costs about three plain passes.
    """
    with torch.enable_grad():
        x = x_t.detach().requires_grad_(True)
        v = velocity(x, t)
        clean = x - t_now * v                                          # Â [B, H, A]
        error = inpaint.weights * (inpaint.target - clean.detach())    # W (Y - Â)
        (correction,) = torch.autograd.grad(clean, x, error)           # Jᵀ W (Y - Â)
    g = torch.clamp(inpaint.max_guidance_weight,
                    max=guidance_weight(t_now, math.inf))              # [B, 1, 1]
    return v.detach() - g * correction


def sample(velocity: Velocity, noise: torch.Tensor, steps: int,
           inpaint: Inpainting) -> torch.Tensor:
    """Flow matching with inpainting: Euler from t=1 (noise [B, H, A]) to t=0 -> actions.

    With no frozen and no weighted row this is exactly the plain loop of sample_actions.
    """
    B, H, _ = noise.shape
    x_t = noise.float()
    dt = -1.0 / steps
    for step in range(steps):
        t_now = 1.0 - step / steps
        t = torch.full((B,), t_now, device=noise.device)
        if inpaint.held:
            # The frozen rows are clean: x = Y and flow time 0 on their tokens.
            x_t = torch.where(inpaint.frozen, inpaint.target, x_t)
            t = torch.where(inpaint.frozen[..., 0], 0.0, t[:, None])    # [B, H]
        if inpaint.guided:
            v = guided_velocity(velocity, x_t, t, t_now, inpaint)
        else:
            v = velocity(x_t, t)
        x_t = x_t + dt * v
    if inpaint.held:
        x_t = torch.where(inpaint.frozen, inpaint.target, x_t)
    return x_t
