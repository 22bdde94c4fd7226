"""Action error of predicted chunks against a dataset's recorded actions, per frame and episode.

A chunk predicted at frame t holds actions for t, t+1, ..., t+H-1; it is compared with the
recorded actions of those frames (fewer near the episode's end):

    l1[d]  = mean over rows |predicted[r, d] - recorded[t + r, d]|
    mse[d] = mean over rows (predicted[r, d] - recorded[t + r, d])^2

An episode's figure is the mean over its frames, per dimension.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np


def chunk_error(predicted: np.ndarray, recorded: np.ndarray, t: int
                ) -> tuple[np.ndarray, np.ndarray, int]:
    """Return (l1 [A], mse [A], rows compared) of chunk `predicted` [H, A] made at frame t.

    recorded: the episode's actions [T, A].
    """
    rows = min(predicted.shape[0], recorded.shape[0] - t)
    if rows <= 0:
        raise ValueError(f'frame {t} is past the episode ({recorded.shape[0]} frames)')
    diff = predicted[:rows].astype(np.float64) - recorded[t:t + rows]       # [rows, A]
    return np.abs(diff).mean(axis=0), (diff ** 2).mean(axis=0), rows


@dataclasses.dataclass
class EpisodeErrors:
    """Per-frame errors of one episode."""

    episode: int
    frames: list[int] = dataclasses.field(default_factory=list)
    l1: list[np.ndarray] = dataclasses.field(default_factory=list)     # [A] per frame
    mse: list[np.ndarray] = dataclasses.field(default_factory=list)    # [A] per frame

    def summary(self) -> dict:
        """Mean L1 / MSE per dimension over the episode, and over every dimension."""
        l1, mse = np.mean(self.l1, axis=0), np.mean(self.mse, axis=0)
        return {'episode': self.episode, 'frames': len(self.frames),
                'l1': l1.tolist(), 'mse': mse.tolist(),
                'l1_mean': float(l1.mean()), 'mse_mean': float(mse.mean())}


class ActionErrors:
    """Collects per-frame errors of every episode; summary() and plot() report them."""

    def __init__(self):
        self.episodes: dict[int, EpisodeErrors] = {}

    def add(self, episode: int, frame: int, l1: np.ndarray, mse: np.ndarray) -> None:
        errors = self.episodes.setdefault(episode, EpisodeErrors(episode))
        errors.frames.append(frame)
        errors.l1.append(l1)
        errors.mse.append(mse)

    def summary(self) -> list[dict]:
        return [e.summary() for e in self.episodes.values() if e.frames]

    def plot(self, path: str | Path) -> Path:
        """Write a PNG: mean L1 per frame for each episode, and per-dimension L1."""
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt

        fig, (over_time, per_dim) = plt.subplots(1, 2, figsize=(11, 4))
        for e in self.episodes.values():
            over_time.plot(e.frames, [float(v.mean()) for v in e.l1],
                           label=f'episode {e.episode}')
        over_time.set_xlabel('frame')
        over_time.set_ylabel('L1 action error (mean over dims and chunk)')
        over_time.legend(fontsize='small')
        summaries = self.summary()
        width = 0.8 / max(len(summaries), 1)
        for i, s in enumerate(summaries):
            dims = np.arange(len(s['l1']))
            per_dim.bar(dims + i * width, s['l1'], width, label=f'episode {s["episode"]}')
        per_dim.set_xlabel('action dimension')
        per_dim.set_ylabel('L1 (mean over the episode)')
        fig.suptitle('predicted chunks vs recorded actions')
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
