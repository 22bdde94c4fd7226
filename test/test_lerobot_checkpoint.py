"""LeRobot π0.5 checkpoints load to the same model, norm stats and outputs as openpi's layout.

Both folders are written here from one tiny random model: openpi's with save_pi05, LeRobot's
with test/lerobot_layout.py (config.json "type": "pi05", `model.`-prefixed weights, processor
files with the statistics, the tokenizer only named and found in a stand-in hub cache).
"""

import json
import shutil

import numpy as np
import pytest
import torch

from lerobot_layout import put_in_hub_cache, save_lerobot_pi05
from oxygen_ros.cli import main as cli_main
from oxygen_ros.engine import random_observation
from oxygen_ros.model import get_preset, load_pi05, NormStats, Pi05Model, save_pi05
from oxygen_ros.model.checkpoint import CheckpointError
from oxygen_ros.model.lerobot import LeRobotCheckpointError
from oxygen_ros.model.tokenizer import train_tiny_tokenizer
from oxygen_ros.runtime.engine_setup import build_engine, EngineSetupError
from oxygen_ros.runtime.params import robot_defaults, Settings

FRAMES = 6


def float32_stats(dim, seed):
    """Statistics exactly representable in float32 (LeRobot stores them so)."""
    rng = np.random.default_rng(seed)
    q01 = rng.uniform(-1, 0, dim).astype(np.float32)
    q99 = (q01 + rng.uniform(1, 2, dim)).astype(np.float32)
    return NormStats(mean=rng.normal(size=dim).astype(np.float32),
                     std=rng.uniform(0.5, 1, dim).astype(np.float32), q01=q01, q99=q99)


# Tiny models on a shared CPU: more threads only add contention (conftest.py).
pytestmark = pytest.mark.usefixtures('one_torch_thread')


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    """(openpi folder, LeRobot folder, hf_home) of the same tiny model and statistics."""
    root = tmp_path_factory.mktemp('layouts')
    cfg = get_preset('tiny')
    sp = train_tiny_tokenizer(root / 'sp', vocab_size=cfg.backbone.vocab_size)
    model = Pi05Model(cfg).init_random(seed=5).eval()
    stats = {'state': float32_stats(8, 1), 'actions': float32_stats(7, 2)}
    openpi = save_pi05(model, root / 'openpi', norm_stats=stats,
                       asset_id='physical-intelligence/libero', tokenizer_path=sp)
    lerobot = save_lerobot_pi05(model, root / 'lerobot', stats)
    hf_home = root / 'hf_home'
    put_in_hub_cache(hf_home, sp)
    return openpi, lerobot, hf_home


@pytest.fixture
def hub_cache(monkeypatch, folders):
    monkeypatch.delenv('HF_HUB_CACHE', raising=False)
    monkeypatch.setenv('HF_HOME', str(folders[2]))


def run_engine(checkpoint):
    """Actions and token ids of FRAMES frames through the node's engine for `checkpoint`."""
    settings = Settings.from_values({**robot_defaults('libero'), 'checkpoint': str(checkpoint),
                                     'tokens_per_request': 4, 'decode_budget': '2', 'seed': 3})
    engine = build_engine(settings, warmup=False)
    size = engine.system.runner.model.config.vision.image_size
    actions, tokens = [], []
    for i in range(FRAMES):
        result = engine.system.step(random_observation('libero', i, seed=9, image_size=size))
        actions.append(result.action.actions)
        tokens += [(d.request_id, tuple(d.token_ids)) for d in result.deltas]
    return np.stack(actions), tokens, engine.description


def test_lerobot_folder_loads_the_same_model_and_stats(folders, hub_cache):
    openpi, lerobot, _ = folders
    a, b = load_pi05(openpi), load_pi05(lerobot)
    assert (a.layout, b.layout) == ('openpi', 'lerobot')
    assert a.config == b.config
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    stats_a = a.norm_stats['physical-intelligence/libero']
    stats_b = b.norm_stats['lerobot']
    for key in ('state', 'actions'):
        for field in ('mean', 'std', 'q01', 'q99'):
            np.testing.assert_array_equal(getattr(stats_a[key], field),
                                          getattr(stats_b[key], field))
    assert b.tokenizer_path.read_bytes() == a.tokenizer_path.read_bytes()
    assert 'hub cache' in b.tokenizer_note


def test_lerobot_and_openpi_layouts_give_identical_actions_and_tokens(folders, hub_cache):
    openpi, lerobot, _ = folders
    actions_a, tokens_a, desc_a = run_engine(openpi)
    actions_b, tokens_b, desc_b = run_engine(lerobot)
    horizon = get_preset('tiny').action_horizon
    assert actions_a.shape == (FRAMES, horizon, 7)
    np.testing.assert_array_equal(actions_a, actions_b)
    assert tokens_a and tokens_a == tokens_b
    assert desc_a['source'].startswith('openpi checkpoint')
    assert desc_b['source'].startswith('lerobot checkpoint')


def test_tied_embedding_under_its_other_name_loads(tmp_path, folders, hub_cache):
    openpi, _, _ = folders
    loaded = load_pi05(openpi)
    stats = loaded.norm_stats['physical-intelligence/libero']
    path = save_lerobot_pi05(loaded.model, tmp_path / 'embed', stats, embed_name=True)
    again = load_pi05(path)
    key = 'paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight'
    assert torch.equal(again.model.state_dict()[key], loaded.model.state_dict()[key])


def copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize('remove, named', [
    ('policy_preprocessor.json', 'policy_preprocessor.json'),
    ('policy_postprocessor.json', 'policy_postprocessor.json'),
    ('policy_postprocessor_step_0_unnormalizer_processor.safetensors',
     'policy_postprocessor_step_0_unnormalizer_processor.safetensors'),
    ('model.safetensors', 'model.safetensors'),
])
def test_missing_file_is_named_with_its_role(tmp_path, folders, remove, named):
    path = copy_folder(folders[1], tmp_path / 'ckpt')
    (path / remove).unlink()
    with pytest.raises((LeRobotCheckpointError, FileNotFoundError)) as err:
        load_pi05(path)
    assert named in str(err.value)
    assert 'needed for' in str(err.value) or 'weights' in str(err.value)


def test_missing_tokenizer_says_which_and_where_it_looked(tmp_path, folders, monkeypatch):
    monkeypatch.setenv('HF_HOME', str(tmp_path / 'empty_hf'))
    monkeypatch.delenv('HF_HUB_CACHE', raising=False)
    settings = Settings.from_values({**robot_defaults('libero'), 'checkpoint': str(folders[1])})
    with pytest.raises(EngineSetupError) as err:
        build_engine(settings, warmup=False)
    message = str(err.value)
    assert 'google/paligemma-3b-pt-224' in message
    assert str(tmp_path / 'empty_hf' / 'hub') in message
    assert "parameter 'tokenizer'" in message


def test_other_policy_type_is_refused(tmp_path, folders):
    path = copy_folder(folders[1], tmp_path / 'pi0')
    data = json.loads((path / 'config.json').read_text())
    (path / 'config.json').write_text(json.dumps({**data, 'type': 'pi0'}))
    with pytest.raises(LeRobotCheckpointError, match='"pi05"'):
        load_pi05(path)


def test_openpi_weights_in_a_lerobot_folder_get_a_hint(tmp_path, folders):
    path = copy_folder(folders[1], tmp_path / 'mixed')
    (path / 'model.safetensors').write_bytes((folders[0] / 'model.safetensors').read_bytes())
    with pytest.raises(CheckpointError, match="no key starts with 'model.'"):
        load_pi05(path)


def test_lerobot_weights_under_an_openpi_config_get_a_hint(tmp_path, folders):
    path = copy_folder(folders[0], tmp_path / 'mixed')
    (path / 'model.safetensors').write_bytes((folders[1] / 'model.safetensors').read_bytes())
    with pytest.raises(CheckpointError, match='"type": "pi05"'):
        load_pi05(path)


@pytest.mark.parametrize('layout', ['openpi', 'lerobot'])
def test_check_checkpoint_runs_a_frame_and_says_what_it_found(layout, folders, hub_cache,
                                                              capsys):
    path = folders[0] if layout == 'openpi' else folders[1]
    assert cli_main(['check-checkpoint', str(path), '--robot', 'libero', '--threads', '1']) == 0
    out = capsys.readouterr().out
    assert f'{layout} checkpoint {path}' in out
    cfg = get_preset('tiny')
    assert f'actions    [{cfg.action_horizon}, 7]' in out
    assert f'[{cfg.action_horizon}, {cfg.action_dim}]' in out
    assert 'tokenizer' in out and 'tokenizer.model' in out
    assert ('lerobot' if layout == 'lerobot' else 'physical-intelligence/libero') in out


def test_check_checkpoint_names_the_missing_file(tmp_path, folders, capsys):
    path = copy_folder(folders[1], tmp_path / 'ckpt')
    (path / 'policy_postprocessor.json').unlink()
    assert cli_main(['check-checkpoint', str(path)]) == 2
    err = capsys.readouterr().err
    assert 'missing policy_postprocessor.json' in err and 'action' in err
    assert cli_main(['check-checkpoint', str(tmp_path / 'nowhere')]) == 2
    assert 'no model.safetensors' in capsys.readouterr().err
