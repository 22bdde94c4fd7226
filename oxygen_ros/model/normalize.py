"""openpi norm stats (assets/<asset_id>/norm_stats.json): load, save, normalise, unnormalise.

Dimension matching follows openpi's Normalize / Unnormalize transforms:
- normalise x [..., D]: stats longer than D are cut to D; shorter stats are an error.
- unnormalise x [..., D]: stats shorter than D transform the first dims and leave the rest
  (the model's zero padding) unchanged; longer stats are an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

EPS = 1e-6
NORM_STATS_FILE = 'norm_stats.json'
_FIELDS = ('mean', 'std', 'q01', 'q99')


class NormStatsError(ValueError):
    """Norm stats are missing, malformed, or do not fit the vector they are applied to."""


@dataclasses.dataclass(frozen=True)
class NormStats:
    """Per-dimension statistics of one vector (state or actions), float64 [D] each."""

    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray | None = None  # 1st percentile
    q99: np.ndarray | None = None  # 99th percentile

    def __post_init__(self):
        dims = set()
        for name in _FIELDS:
            value = getattr(self, name)
            if value is None:
                if name in ('mean', 'std'):
                    raise NormStatsError(f'norm stats field {name!r} is required')
                continue
            arr = np.asarray(value, dtype=np.float64)
            if arr.ndim != 1:
                raise NormStatsError(f'norm stats {name!r} must be 1-D, got shape {arr.shape}')
            if not np.all(np.isfinite(arr)):
                raise NormStatsError(f'norm stats {name!r} contains NaN or inf')
            object.__setattr__(self, name, arr)
            dims.add(arr.shape[0])
        if len(dims) != 1:
            lengths = {n: len(getattr(self, n)) for n in _FIELDS if getattr(self, n) is not None}
            raise NormStatsError(f'norm stats fields have different lengths: {lengths}')

    @property
    def dim(self) -> int:
        """Vector length D the stats describe."""
        return self.mean.shape[0]

    @property
    def has_quantiles(self) -> bool:
        """Whether q01 and q99 are present (needed for quantile normalisation)."""
        return self.q01 is not None and self.q99 is not None

    def to_dict(self) -> dict:
        """Return the JSON object openpi writes for one NormStats."""
        return {n: (None if getattr(self, n) is None else getattr(self, n).tolist())
                for n in _FIELDS}

    @classmethod
    def from_dict(cls, d: dict, where: str = 'norm stats') -> NormStats:
        """Parse one NormStats JSON object; `where` prefixes error messages."""
        if not isinstance(d, dict):
            raise NormStatsError(f'{where}: expected an object, got {type(d).__name__}')
        unknown = set(d) - set(_FIELDS)
        if unknown:
            raise NormStatsError(f'{where}: unknown fields {sorted(unknown)}')
        missing = {'mean', 'std'} - set(d)
        if missing:
            raise NormStatsError(f'{where}: missing fields {sorted(missing)}')
        try:
            return cls(**{n: d.get(n) for n in _FIELDS})
        except NormStatsError as err:
            raise NormStatsError(f'{where}: {err}') from None


def _check_vector(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim < 1 or not np.issubdtype(x.dtype, np.number):
        raise NormStatsError(f'{what}: expected a numeric array [..., D], got {x.dtype} {x.shape}')
    return x.astype(np.float64)


def _quantiles(stats: NormStats, what: str) -> tuple[np.ndarray, np.ndarray]:
    if not stats.has_quantiles:
        raise NormStatsError(f'{what}: quantile normalisation needs q01 and q99 in the norm stats')
    return stats.q01, stats.q99


def normalize(x: np.ndarray, stats: NormStats, use_quantiles: bool = True,
              what: str = 'vector', dtype=np.float32) -> np.ndarray:
    """Normalise x [..., D] -> dtype [..., D]; quantile maps [q01, q99] to [-1, 1].

    Computed in float64 (like openpi's numpy transforms), then cast to dtype.
    """
    x = _check_vector(x, what)
    d = x.shape[-1]
    if stats.dim < d:
        raise NormStatsError(f'{what}: norm stats have {stats.dim} dims but the vector has {d}')
    if use_quantiles:
        q01, q99 = (q[:d] for q in _quantiles(stats, what))
        y = (x - q01) / (q99 - q01 + EPS) * 2.0 - 1.0
    else:
        y = (x - stats.mean[:d]) / (stats.std[:d] + EPS)
    return y.astype(dtype)


def unnormalize(x: np.ndarray, stats: NormStats, use_quantiles: bool = True,
                what: str = 'vector', dtype=np.float32) -> np.ndarray:
    """Invert normalize for x [..., D] -> dtype [..., D]; dims past the stats pass through."""
    x = _check_vector(x, what)
    d, k = x.shape[-1], stats.dim
    if k > d:
        raise NormStatsError(f'{what}: norm stats have {k} dims but the vector has only {d}')
    y = x.copy()
    if use_quantiles:
        q01, q99 = _quantiles(stats, what)
        y[..., :k] = (x[..., :k] + 1.0) / 2.0 * (q99 - q01 + EPS) + q01
    else:
        # openpi pads mean with 0 and std with 1, so padded dims get x * (1 + eps).
        mean = np.concatenate([stats.mean, np.zeros(d - k)])
        std = np.concatenate([stats.std, np.ones(d - k)])
        y = x * (std + EPS) + mean
    return y.astype(dtype)


def _stats_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path / NORM_STATS_FILE if path.is_dir() else path


def load_norm_stats(path: str | os.PathLike) -> dict[str, NormStats]:
    """Load {"norm_stats": {key: NormStats}} from a norm_stats.json or its directory."""
    file = _stats_path(path)
    if not file.is_file():
        raise FileNotFoundError(f'norm stats file not found: {file}')
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise NormStatsError(f'{file}: not valid JSON: {err}') from None
    if not isinstance(data, dict) or not isinstance(data.get('norm_stats'), dict):
        raise NormStatsError(f'{file}: expected {{"norm_stats": {{...}}}} at the top level')
    return {key: NormStats.from_dict(value, where=f'{file} [{key}]')
            for key, value in data['norm_stats'].items()}


def save_norm_stats(path: str | os.PathLike, stats: dict[str, NormStats]) -> Path:
    """Write stats in openpi's format; path is a directory or a .json file. Return the file."""
    path = Path(path)
    file = path if path.suffix == '.json' else path / NORM_STATS_FILE
    file.parent.mkdir(parents=True, exist_ok=True)
    body = {'norm_stats': {key: s.to_dict() for key, s in stats.items()}}
    file.write_text(json.dumps(body, indent=2))
    return file


def find_norm_stats(assets_dir: str | os.PathLike) -> dict[str, dict[str, NormStats]]:
    """Load every assets/<asset_id>/norm_stats.json; asset ids may contain '/'.

    openpi names assets by repo id, e.g. 'physical-intelligence/libero', so search recursively.
    """
    root = Path(assets_dir)
    if not root.is_dir():
        return {}
    return {file.parent.relative_to(root).as_posix(): load_norm_stats(file)
            for file in sorted(root.rglob(NORM_STATS_FILE))}
