"""The RTC benchmark's smooth policy: openpi's flow-matching loss, a fine-tune that lowers it,
and a checkpoint in openpi's layout that the package's loaders read back exactly."""

import dataclasses

import numpy as np
import pytest
import torch

from oxygen_ros.bench import smooth_policy as sp
from oxygen_ros.model import load_pi05

pytestmark = pytest.mark.usefixtures('one_torch_thread')

TINY = sp.SmoothPolicyOptions(preset='tiny', steps=40, batch=16, observations=4)


@pytest.fixture(scope='module')
def trained():
    return sp.train(TINY)


def test_loss_is_openpi_flow_matching_convention():
    """x_t = t·noise + (1 − t)·actions, u = noise − actions: the exact velocity costs 0."""
    generator = torch.Generator().manual_seed(1)
    actions = sp.demonstrations(generator, 8, 10, 32, 7)

    def exact(x_t, t):   # (x_t - actions) / t = noise - actions under that convention
        return (x_t - actions) / t[:, None, None]
    assert sp.flow_matching_loss(exact, actions, generator).item() < 1e-10
    zero = sp.flow_matching_loss(lambda x, t: torch.zeros_like(x), actions, generator)
    assert zero.item() > 0.5            # E (noise - actions)² ≈ 1 + E actions²


def test_demonstrations_are_smooth_paths_that_differ_between_chunks():
    chunks = sp.demonstrations(torch.Generator().manual_seed(0), 64, 10, 32, 7).numpy()
    assert chunks.shape == (64, 10, 32) and not chunks[..., 7:].any()   # padding columns 0
    assert np.abs(chunks).max() <= 2 * sp.AMPLITUDE[1]
    row_step = np.linalg.norm(np.diff(chunks, axis=1), axis=-1).mean()
    across = np.linalg.norm(chunks[1:] - chunks[:-1], axis=-1).mean()
    assert row_step < 0.25 * across


def test_fine_tune_lowers_the_loss_and_trains_only_the_action_expert(trained):
    losses = trained.losses
    assert len(losses) == TINY.steps
    assert np.mean(losses[-8:]) < 0.6 * np.mean(losses[:8])
    from oxygen_ros.engine import random_setup
    from oxygen_ros.model import get_preset

    start, _ = random_setup(get_preset('tiny'), 'libero', seed=TINY.seed)
    before, after = start.state_dict(), trained.model.state_dict()
    changed = {name for name in after if not torch.equal(before[name], after[name])}
    assert changed and all(name.startswith(sp.TRAINED) for name in changed)
    assert any(name.startswith('paligemma_with_expert.gemma_expert.') for name in changed)
    assert not any(p.requires_grad for p in trained.model.parameters())


def test_checkpoint_round_trips_exactly_and_loads_as_the_node_loads_it(trained, tmp_path):
    path = sp.save(trained, TINY, tmp_path / 'smooth', {'row_step': 1.0})
    loaded = load_pi05(path)
    assert loaded.config == trained.model.config
    saved = trained.model.state_dict()
    assert set(loaded.model.state_dict()) == set(saved)
    assert all(torch.equal(t, saved[name]) for name, t in loaded.model.state_dict().items())
    assert 'physical-intelligence/libero' in loaded.norm_stats
    assert loaded.tokenizer_path is not None
    assert sp.read_info(path)['options'] == dataclasses.asdict(TINY)

    from oxygen_ros.bench.rtc import load_policy
    from oxygen_ros.engine import synthetic_frame

    model, frontend, source = load_policy(path, 'libero', 'cpu', 'float32', 1)
    assert source.startswith('openpi checkpoint')
    obs = synthetic_frame('libero', 0, 0.0, 0, model.config.vision.image_size)
    noise = torch.randn(1, model.config.action_horizon, model.config.action_dim)
    with torch.no_grad():
        ours = trained.model.sample_actions(trained.model.prefill(**sp.prepare(frontend, obs)),
                                            noise)
        theirs = model.sample_actions(model.prefill(**sp.prepare(frontend, obs)), noise)
    assert torch.equal(ours, theirs)


def test_cache_reuses_the_checkpoint(tmp_path, monkeypatch):
    few = dataclasses.replace(TINY, steps=3)
    path = sp.smooth_policy(few, cache_dir=tmp_path)
    assert (path / 'model.safetensors').is_file() and path.parent == tmp_path
    assert sp.read_info(path)['smoothness']['across_chunks'] > 0

    def no_training(*args, **kwargs):
        raise AssertionError('trained again instead of reusing the cache')
    monkeypatch.setattr(sp, 'train', no_training)
    assert sp.smooth_policy(few, cache_dir=tmp_path) == path
    assert sp.cache_key(dataclasses.replace(few, seed=1)) != path.name   # another policy
    assert [p.name for p in tmp_path.iterdir()] == [path.name]            # no staging left


def test_smooth_policy_command_writes_a_checkpoint_the_checker_accepts(tmp_path, capsys):
    from oxygen_ros.cli import main

    out, cache = tmp_path / 'smooth', tmp_path / 'cache'
    argv = ['smooth-policy', '--preset', 'tiny', '--steps', '3', '--cache-dir', str(cache)]
    assert main(argv + ['--out', str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1] == str(out) and 'between two chunks' in printed
    assert load_pi05(out).config.action_horizon == 4
    assert main(['check-checkpoint', str(out), '--robot', 'libero', '--threads', '1']) == 0
    capsys.readouterr()
    assert main(argv) == 0                                   # the cached one: no training
    printed = capsys.readouterr().out
    assert 'fine-tuning' not in printed and printed.splitlines()[-1].startswith(str(cache))
    with pytest.raises(SystemExit, match='exists'):
        main(argv + ['--out', str(out)])
    with pytest.raises(SystemExit, match='expected one of'):
        main(['smooth-policy', '--preset', 'huge'])
