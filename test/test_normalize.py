"""openpi norm stats: file format, quantile / z-score maps, dimension matching."""

import json

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from oxygen_ros.model.normalize import (find_norm_stats, load_norm_stats, normalize, NormStats,
                                        NormStatsError, save_norm_stats, unnormalize)


def make_stats(dim, seed=0):
    rng = np.random.default_rng(seed)
    q01 = rng.uniform(-2, 0, dim)
    return NormStats(mean=rng.normal(size=dim), std=rng.uniform(0.1, 2, dim),
                     q01=q01, q99=q01 + rng.uniform(0.5, 3, dim))


def test_known_values():
    stats = NormStats(mean=[1.0, -2.0], std=[2.0, 0.5], q01=[0.0, -1.0], q99=[4.0, 1.0])
    x = np.array([[0.0, -1.0], [4.0, 1.0], [2.0, 0.0]])
    np.testing.assert_allclose(normalize(x, stats), [[-1, -1], [1, 1], [0, 0]], atol=1e-6)
    np.testing.assert_allclose(normalize(x, stats, use_quantiles=False),
                               [[-0.5, 2.0], [1.5, 6.0], [0.5, 4.0]], rtol=1e-5)
    assert normalize(x, stats).dtype == np.float32


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 16), st.integers(0, 10_000), st.booleans())
def test_round_trip(dim, seed, quantiles):
    stats = make_stats(dim, seed)
    x = np.random.default_rng(seed).normal(size=(5, dim)) * 3
    y = unnormalize(normalize(x, stats, quantiles), stats, quantiles)
    np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)


def test_dims_follow_openpi():
    stats = make_stats(4)
    # normalise: longer stats are cut to the vector.
    np.testing.assert_array_equal(normalize(np.ones(3), stats), normalize(np.ones(4), stats)[:3])
    with pytest.raises(NormStatsError, match='norm stats have 4 dims but the vector has 6'):
        normalize(np.ones(6), stats)
    # unnormalise: dims past the stats (model padding) pass through, quantile exactly.
    x = np.random.default_rng(1).normal(size=(2, 7))
    y = unnormalize(x, stats)
    np.testing.assert_array_equal(y[:, 4:], x[:, 4:].astype(np.float32))
    np.testing.assert_array_equal(y[:, :4], unnormalize(x[:, :4], stats))
    z = unnormalize(x, stats, use_quantiles=False)  # openpi: mean 0, std 1 padding
    np.testing.assert_allclose(z[:, 4:], x[:, 4:] * (1 + 1e-6), rtol=1e-6)
    with pytest.raises(NormStatsError, match='vector has only 3'):
        unnormalize(np.ones(3), stats)


def test_quantiles_required():
    stats = NormStats(mean=[0.0], std=[1.0])
    assert not stats.has_quantiles
    with pytest.raises(NormStatsError, match='q01 and q99'):
        normalize(np.zeros(1), stats)
    normalize(np.zeros(1), stats, use_quantiles=False)


def test_invalid_stats():
    with pytest.raises(NormStatsError, match='different lengths'):
        NormStats(mean=[0.0, 1.0], std=[1.0])
    with pytest.raises(NormStatsError, match='NaN'):
        NormStats(mean=[np.nan], std=[1.0])


def test_save_load_exact_openpi_format(tmp_path):
    stats = {'state': make_stats(8, 1), 'actions': NormStats(mean=[0.5], std=[2.0])}
    file = save_norm_stats(tmp_path / 'assets' / 'droid', stats)
    assert file == tmp_path / 'assets' / 'droid' / 'norm_stats.json'
    data = json.loads(file.read_text())
    assert set(data) == {'norm_stats'} and set(data['norm_stats']) == {'state', 'actions'}
    assert set(data['norm_stats']['state']) == {'mean', 'std', 'q01', 'q99'}
    assert data['norm_stats']['actions']['q01'] is None
    loaded = load_norm_stats(file.parent)
    for key in stats:
        for field in ('mean', 'std', 'q01', 'q99'):
            a, b = getattr(stats[key], field), getattr(loaded[key], field)
            assert (a is None and b is None) or np.array_equal(a, b)


def test_find_nested_asset_ids(tmp_path):
    save_norm_stats(tmp_path / 'physical-intelligence' / 'libero', {'state': make_stats(8)})
    save_norm_stats(tmp_path / 'trossen', {'state': make_stats(14)})
    found = find_norm_stats(tmp_path)
    assert sorted(found) == ['physical-intelligence/libero', 'trossen']
    assert found['trossen']['state'].dim == 14
    assert find_norm_stats(tmp_path / 'absent') == {}


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_norm_stats(tmp_path)
    bad = tmp_path / 'norm_stats.json'
    bad.write_text('{"state": {}}')
    with pytest.raises(NormStatsError, match='top level'):
        load_norm_stats(bad)
    bad.write_text('{"norm_stats": {"state": {"mean": [1.0]}}}')
    with pytest.raises(NormStatsError, match=r"\[state\].*missing fields \['std'\]"):
        load_norm_stats(bad)
