"""A policy that behaves like a trained one, for the RTC benchmark: smooth, multi-modal chunks.

Why: every preset here has random weights, and a random action expert denoises to noise-like
chunks: two consecutive rows of one chunk lie about as far apart as rows of two different
chunks, so no boundary can be smoother than the chunk itself and real-time chunking has
nothing to show. A trained π0.5 produces smooth chunks whose content depends on the noise
(several ways to move are plausible): exactly where chunks disagree at their boundaries and
RTC matters. No real weights can be downloaded here, so this module makes such a policy:

  demonstrations   chunks [H, A] in the model's normalised space: per action column a sum of
                   two slow sinusoids (periods PERIODS_ROWS rows) with a random amplitude and
                   phase each: each chunk is a smooth path and the noise picks which one. A
                   time shift of a chunk is again a chunk of the family, so a chunk that
                   continues another one is one the policy knows. Padding columns are 0, as
                   openpi pads actions. The chunks do not depend on the observation: the
                   extreme of a multi-modal policy (a real one's next chunk also follows the
                   scene, which makes chunks without RTC agree more than these do).
  fine-tune        openpi's flow-matching loss (pi0.py compute_loss) on the action expert,
                   action_in/out_proj and time_mlp_in/out: t ~ Beta(1.5, 1) · 0.999 + 0.001,
                   x_t = t·noise + (1 − t)·actions, target u = noise − actions, loss = mean of
                   (v − u)² over the action columns, then rows and batch. The backbone (SigLIP
                   + Gemma) keeps its random weights, frozen: a bank of synthetic observations
                   is prefilled once under no_grad and each training row reads one of them.
  checkpoint       openpi's layout (model.safetensors, config.json, assets/<the robot's asset
                   id>/norm_stats.json with identity statistics, the tiny tokenizer as
                   tokenizer.model), so `oxygen-ros bench --parts rtc`, `oxygen-ros replay
                   --checkpoint` and the node all load it; smooth_policy() caches it by
                   everything it depends on, plus smooth_policy.json (how it was made).

Deterministic for a seed (one process, one device). Nothing in the shipped runtime imports
this module: it is benchmark tooling.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from pathlib import Path
import shutil
import tempfile
import time
from typing import Callable

import numpy as np
import torch

TRAINER_VERSION = 1                     # bump when what a checkpoint holds would change
PERIODS_ROWS = (24.0, 64.0)             # the demonstrations' sinusoid periods, in rows
AMPLITUDE = (0.15, 0.45)                # each sinusoid's amplitude range (|action| <= 0.9)
CACHE_DIR = Path.home() / '.cache' / 'oxygen_ros' / 'smooth_policies'
INFO_FILE = 'smooth_policy.json'        # how the checkpoint was made, beside openpi's files
INSTRUCTIONS = ('pick up the black bowl', 'pick up the red block', 'open the drawer')
# What the fine-tune trains (name prefixes); the backbone and vision tower stay as they are.
TRAINED = ('paligemma_with_expert.gemma_expert.', 'action_in_proj', 'action_out_proj',
           'time_mlp_in', 'time_mlp_out')


@dataclasses.dataclass(frozen=True)
class SmoothPolicyOptions:
    """What the trained policy depends on (all of it goes into the cache key)."""

    preset: str = 'pi05-cpu'       # the random-weight model it starts from
    robot: str = 'libero'          # the columns that move; the norm stats' asset id
    seed: int = 0                  # weights, demonstrations, noise, flow times
    steps: int = 400               # optimiser steps (pi05-cpu: ~1.5 min on one thread)
    batch: int = 32                # chunks per step
    lr: float = 5e-3               # AdamW peak learning rate, cosine to a tenth
    observations: int = 16         # prefilled observations the rows draw from


def demonstrations(generator: torch.Generator, batch: int, horizon: int, action_dim: int,
                   columns: int) -> torch.Tensor:
    """Return smooth chunks float32 [batch, horizon, action_dim] (padding columns 0).

    Column c of a chunk: Σ_k a_k sin(2π row / period_k + φ_k), a_k uniform in AMPLITUDE, φ_k
    uniform, k over PERIODS_ROWS.
    """
    periods = torch.tensor(PERIODS_ROWS)                                     # [K]
    shape = (batch, 1, columns, len(PERIODS_ROWS))                           # [B, 1, c, K]
    low, high = AMPLITUDE
    amplitude = low + (high - low) * torch.rand(shape, generator=generator)
    phase = 2 * math.pi * torch.rand(shape, generator=generator)
    rows = torch.arange(horizon, dtype=torch.float32)[None, :, None, None]  # [1, H, 1, 1]
    paths = (amplitude * torch.sin(2 * math.pi * rows / periods + phase)).sum(-1)  # [B, H, c]
    chunks = torch.zeros(batch, horizon, action_dim)
    chunks[..., :columns] = paths
    return chunks


def flow_matching_loss(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       actions: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Return openpi's π0 flow-matching loss of actions [B, H, A] (a scalar).

    t ~ Beta(1.5, 1) · 0.999 + 0.001 per row (t = 1 is noise), x_t = t·noise + (1 − t)·actions,
    u = noise − actions; (v(x_t, t) − u)² averaged over the columns, then rows and batch.
    Noise and t are drawn on the CPU from `generator` (reproducible on any device).
    """
    B, device = actions.shape[0], actions.device
    noise = torch.randn(actions.shape, generator=generator).to(device)
    # Beta(1.5, 1) by its inverse CDF (F(t) = t^1.5): torch's Beta takes no generator.
    t = (torch.rand(B, generator=generator) ** (1 / 1.5) * 0.999 + 0.001).to(device)
    x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
    u = noise - actions
    return (velocity(x_t, t) - u).square().mean(-1).mean()


def observation_bank(robot: str, count: int, seed: int, image_size: int) -> list:
    """Synthetic observations (panning waves and noise images, three instructions)."""
    from oxygen_ros.engine import random_observation, synthetic_frame

    bank = []
    for i in range(count):
        if i % 2:
            bank.append(random_observation(robot, i, seed=seed, image_size=image_size,
                                           instruction=INSTRUCTIONS[i % len(INSTRUCTIONS)]))
        else:
            bank.append(synthetic_frame(robot, i, 0.37 * i, seed + i, image_size))
    return bank


def prepare(frontend, obs) -> dict[str, torch.Tensor]:
    """Return prefill's inputs of one observation (batch of one)."""
    # Small presets' prompt slots cut the synthetic prompts' state tokens: expected here, and
    # not worth the tokenizer's warning per prompt.
    tokenizer_log = logging.getLogger('oxygen_ros.model.tokenizer')
    level = tokenizer_log.level
    tokenizer_log.setLevel(logging.ERROR)
    try:
        return frontend.prepare(obs).tensors
    finally:
        tokenizer_log.setLevel(level)


@dataclasses.dataclass
class TrainResult:
    """A fine-tuned model, its frontend, and how the training went."""

    model: object                  # Pi05Model, eval mode, no parameter requires grad
    frontend: object               # Frontend (identity norm stats, the tiny tokenizer)
    losses: list[float]            # per optimiser step
    seconds: float


def train(opts: SmoothPolicyOptions, device: str = 'cpu',
          progress: Callable[[str], None] = lambda line: None) -> TrainResult:
    """Fine-tune the preset's random action expert on smooth demonstrations."""
    from oxygen_ros.engine import random_setup
    from oxygen_ros.model import get_preset

    start = time.perf_counter()
    config = get_preset(opts.preset)
    model, frontend = random_setup(config, opts.robot, seed=opts.seed, device=device)
    H, A = config.action_horizon, config.action_dim
    columns = frontend.adapter.spec.action_dim
    bank = [prepare(frontend, obs) for obs in observation_bank(
        opts.robot, opts.observations, opts.seed, config.vision.image_size)]
    with torch.no_grad():   # the frozen prefix, once: K/V of every bank row
        prefix = model.prefill(**{key: torch.cat([row[key] for row in bank]) for key in bank[0]})
        prefix_kv, bias, cos, sin = model.action_context(prefix, H, device)
    model.requires_grad_(False)
    params = [p for name, p in model.named_parameters() if name.startswith(TRAINED)]
    for p in params:
        p.requires_grad_(True)
    optimiser = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * step / opts.steps)))
    generator = torch.Generator().manual_seed(opts.seed)
    losses = []
    for step in range(opts.steps):
        rows = torch.randint(len(bank), (opts.batch,), generator=generator).to(device)
        context = ([(k[rows], v[rows]) for k, v in prefix_kv], bias[rows], cos[rows], sin[rows])
        actions = demonstrations(generator, opts.batch, H, A, columns).to(device)
        loss = flow_matching_loss(lambda x, t: model.denoise_velocity(*context, x, t),
                                  actions, generator)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == opts.steps:
            progress(f'smooth policy: step {step + 1}/{opts.steps}, loss '
                     f'{np.mean(losses[-100:]):.4f}')
    model.requires_grad_(False)
    return TrainResult(model.eval(), frontend, losses, time.perf_counter() - start)


def chunk_smoothness(model, frontend, observations: list, samples: int = 4, seed: int = 0
                     ) -> dict:
    """Measure chunks sampled without RTC: how smooth one is, how far apart two are.

    Per observation, `samples` chunks from different noise, over the robot's columns (model
    space): row_step = mean ||row[i+1] - row[i]|| within a chunk; across_chunks = mean
    ||a[i] - b[i]|| between two chunks of one observation at the same row (what a boundary
    jumps when nothing makes the next chunk continue the last one). A trained policy has
    row_step << across_chunks; random weights have them about equal.
    """
    config = model.config
    columns = frontend.adapter.spec.action_dim
    generator = torch.Generator().manual_seed(seed)
    steps, across = [], []
    for obs in observations:
        tensors = prepare(frontend, obs)
        noise = torch.randn(samples, config.action_horizon, config.action_dim,
                            generator=generator).to(frontend.device)
        with torch.no_grad():
            prefix = model.prefill(**{key: value.expand(samples, *value.shape[1:])
                                      for key, value in tensors.items()})
            chunks = model.sample_actions(prefix, noise)[..., :columns].cpu()  # [S, H, c]
        steps.append(chunks.diff(dim=1).norm(dim=-1).mean().item())
        pairs = (chunks[:, None] - chunks[None]).norm(dim=-1).mean(-1)       # [S, S]
        across.append((pairs.sum() / (samples * (samples - 1))).item())
    row_step, jump = float(np.mean(steps)), float(np.mean(across))
    return {'row_step': row_step, 'across_chunks': jump, 'ratio': row_step / jump}


def cache_key(opts: SmoothPolicyOptions) -> str:
    """Return the folder name of `opts`' checkpoint in the cache (a hash of its inputs)."""
    from oxygen_ros.model import get_preset
    from oxygen_ros.model.robot_spec import get_robot

    spec = get_robot(opts.robot)
    inputs = {'version': TRAINER_VERSION, 'options': dataclasses.asdict(opts),
              'config': get_preset(opts.preset).to_dict(), 'periods': PERIODS_ROWS,
              'amplitude': AMPLITUDE, 'instructions': INSTRUCTIONS,
              'robot': [spec.action_dim, spec.state_dim, list(spec.camera_names)]}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]
    return f'{opts.preset}-{spec.name}-{digest}'


def save(result: TrainResult, opts: SmoothPolicyOptions, path: str | os.PathLike,
         smoothness: dict | None = None) -> Path:
    """Write the fine-tuned model as an openpi checkpoint folder, plus INFO_FILE."""
    from oxygen_ros.engine import identity_norm_stats
    from oxygen_ros.model.checkpoint import save_pi05

    spec = result.frontend.adapter.spec
    path = save_pi05(result.model, path, norm_stats=identity_norm_stats(spec),
                     asset_id=spec.asset_id, tokenizer_path=result.frontend.tokenizer.model_path)
    tail = max(1, len(result.losses) // 10)
    info = {'made_by': 'oxygen_ros.bench.smooth_policy: a flow-matching fine-tune on '
                       'synthetic smooth demonstrations, for benchmarks only',
            'trainer_version': TRAINER_VERSION, 'options': dataclasses.asdict(opts),
            'loss_first': float(np.mean(result.losses[:tail])),
            'loss_last': float(np.mean(result.losses[-tail:])),
            'train_seconds': result.seconds, 'smoothness': smoothness}
    (path / INFO_FILE).write_text(json.dumps(info, indent=2) + '\n')
    return path


def read_info(path: str | os.PathLike) -> dict | None:
    """Return a checkpoint's INFO_FILE (None: not made here)."""
    info = Path(path) / INFO_FILE
    return json.loads(info.read_text()) if info.is_file() else None


def smooth_policy(opts: SmoothPolicyOptions = SmoothPolicyOptions(), device: str = 'cpu',
                  cache_dir: str | os.PathLike | None = None,
                  progress: Callable[[str], None] = lambda line: None) -> Path:
    """Return the checkpoint folder of `opts`' smooth policy: from the cache, else trained.

    The folder is written under a temporary name and renamed into place, so a concurrent run
    never sees half a checkpoint (both would write the same weights; the first rename wins).
    """
    cache = Path(cache_dir) if cache_dir is not None else CACHE_DIR
    path = cache / cache_key(opts)
    if (path / INFO_FILE).is_file():
        return path
    progress(f'smooth policy: fine-tuning the action expert of preset {opts.preset} on smooth '
             f'demonstrations ({opts.steps} steps; once, then cached in {path})')
    result = train(opts, device, progress)
    held_out = observation_bank(opts.robot, 4, opts.seed + 1000,
                                result.model.config.vision.image_size)
    smoothness = chunk_smoothness(result.model, result.frontend, held_out, seed=opts.seed)
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=f'.{path.name}.'))
    staging.chmod(0o755)   # mkdtemp's 0700 would keep the node of another user out
    save(result, opts, staging, smoothness)
    try:
        os.rename(staging, path)
    except OSError:   # another run put its copy there first: keep that one
        shutil.rmtree(staging, ignore_errors=True)
    progress(f'smooth policy: trained in {result.seconds:.0f} s; chunks: row step '
             f'{smoothness["row_step"]:.3f} vs {smoothness["across_chunks"]:.3f} between two '
             f'chunks ({smoothness["ratio"]:.2f}x); {path}')
    return path
