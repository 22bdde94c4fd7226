"""openpi checkpoint format: layout, round trip, clear failures, config.json, bf16 islands."""

import json
import re

import numpy as np
import pytest
from safetensors import safe_open
import safetensors.torch
import torch

from oxygen_ros.model import get_preset, Pi05Model
from oxygen_ros.model.checkpoint import (CheckpointError, config_from_json, EMBED_KEY,
                                         expected_layout, EXPERT_LM_HEAD_KEY, LM_HEAD_KEY,
                                         load_pi05, save_pi05)
from oxygen_ros.model.normalize import NormStats
from oxygen_ros.model.tokenizer import train_tiny_tokenizer

PG = 'paligemma_with_expert.paligemma.model.'
VIS = PG + 'vision_tower.vision_model.'
LM = PG + 'language_model.'
EXP = 'paligemma_with_expert.gemma_expert.model.'


def openpi_pi05_layout():
    """openpi's π0.5 model.safetensors (PaliGemma 3B + Gemma 300M expert), written from facts."""
    layout = {
        VIS + 'embeddings.patch_embedding.weight': (1152, 3, 14, 14),
        VIS + 'embeddings.patch_embedding.bias': (1152,),
        VIS + 'embeddings.position_embedding.weight': (256, 1152),
        VIS + 'post_layernorm.weight': (1152,),
        VIS + 'post_layernorm.bias': (1152,),
        PG + 'multi_modal_projector.linear.weight': (2048, 1152),
        PG + 'multi_modal_projector.linear.bias': (2048,),
        'paligemma_with_expert.paligemma.lm_head.weight': (257152, 2048),
        LM + 'norm.weight': (2048,),
        EXP + 'norm.dense.weight': (3072, 1024),
        EXP + 'norm.dense.bias': (3072,),
        'action_in_proj.weight': (1024, 32), 'action_in_proj.bias': (1024,),
        'action_out_proj.weight': (32, 1024), 'action_out_proj.bias': (32,),
        'time_mlp_in.weight': (1024, 1024), 'time_mlp_in.bias': (1024,),
        'time_mlp_out.weight': (1024, 1024), 'time_mlp_out.bias': (1024,),
    }
    for i in range(27):
        p = f'{VIS}encoder.layers.{i}.'
        for norm in ('layer_norm1', 'layer_norm2'):
            layout[p + norm + '.weight'] = layout[p + norm + '.bias'] = (1152,)
        for proj in ('q_proj', 'k_proj', 'v_proj', 'out_proj'):
            layout[f'{p}self_attn.{proj}.weight'] = (1152, 1152)
            layout[f'{p}self_attn.{proj}.bias'] = (1152,)
        layout[p + 'mlp.fc1.weight'], layout[p + 'mlp.fc1.bias'] = (4304, 1152), (4304,)
        layout[p + 'mlp.fc2.weight'], layout[p + 'mlp.fc2.bias'] = (1152, 4304), (1152,)
    for i in range(18):
        p = f'{LM}layers.{i}.'
        layout[p + 'input_layernorm.weight'] = (2048,)
        layout[p + 'post_attention_layernorm.weight'] = (2048,)
        layout[p + 'self_attn.q_proj.weight'] = (2048, 2048)   # 8 heads x 256
        layout[p + 'self_attn.k_proj.weight'] = (256, 2048)    # 1 kv head x 256
        layout[p + 'self_attn.v_proj.weight'] = (256, 2048)
        layout[p + 'self_attn.o_proj.weight'] = (2048, 2048)
        layout[p + 'mlp.gate_proj.weight'] = (16384, 2048)
        layout[p + 'mlp.up_proj.weight'] = (16384, 2048)
        layout[p + 'mlp.down_proj.weight'] = (2048, 16384)
        p = f'{EXP}layers.{i}.'
        for norm in ('input_layernorm', 'post_attention_layernorm'):  # adaRMSNorm
            layout[f'{p}{norm}.dense.weight'] = (3072, 1024)
            layout[f'{p}{norm}.dense.bias'] = (3072,)
        layout[p + 'self_attn.q_proj.weight'] = (2048, 1024)
        layout[p + 'self_attn.k_proj.weight'] = (256, 1024)
        layout[p + 'self_attn.v_proj.weight'] = (256, 1024)
        layout[p + 'self_attn.o_proj.weight'] = (1024, 2048)
        layout[p + 'mlp.gate_proj.weight'] = (4096, 1024)
        layout[p + 'mlp.up_proj.weight'] = (4096, 1024)
        layout[p + 'mlp.down_proj.weight'] = (1024, 4096)
    return layout


def test_pi05_meta_model_matches_openpi_layout():
    with torch.device('meta'):
        model = Pi05Model(get_preset('pi05'))
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    openpi = openpi_pi05_layout()
    # The one rename: the tied embedding.
    assert ours.pop(EMBED_KEY) == openpi.pop(LM_HEAD_KEY) == (257152, 2048)
    assert set(ours) - set(openpi) == set() and set(openpi) - set(ours) == set()
    assert ours == openpi
    assert len(list(model.buffers())) == 0  # nothing but parameters to load
    count = sum(int(np.prod(s)) for s in openpi_pi05_layout().values())
    assert 3.3e9 < count < 3.4e9
    assert expected_layout(get_preset('pi05')) == openpi_pi05_layout()


def norm_stats(dim=8, seed=0):
    rng = np.random.default_rng(seed)
    q01 = rng.uniform(-1, 0, dim)
    return NormStats(mean=rng.normal(size=dim), std=rng.uniform(0.5, 1, dim), q01=q01,
                     q99=q01 + 1.5)


@pytest.fixture(scope='module')
def tiny():
    cfg = get_preset('tiny')
    return cfg, Pi05Model(cfg).init_random(seed=1).eval()


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory, tiny):
    cfg, model = tiny
    root = tmp_path_factory.mktemp('ckpt')
    sp = train_tiny_tokenizer(root / 'sp', vocab_size=cfg.backbone.vocab_size)
    stats = {'state': norm_stats(8), 'actions': norm_stats(7, 1)}
    return save_pi05(model, root / 'pi05_tiny', norm_stats=stats,
                     asset_id='physical-intelligence/libero', tokenizer_path=sp)


def run(model, cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(2, cfg.num_cameras, 3, s, s, generator=gen) * 2 - 1
    image_masks = torch.tensor([[True, True, False], [True, True, True]])
    tokens = torch.randint(0, cfg.backbone.vocab_size, (2, cfg.max_token_len), generator=gen)
    token_masks = torch.arange(cfg.max_token_len)[None] < torch.tensor([[10], [17]])
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim, generator=gen)
    prefix = model.prefill(images, image_masks, tokens, token_masks)
    return model.sample_actions(prefix, noise), model.lm_logits(prefix.last_hidden)


def test_round_trip_is_bit_identical(ckpt, tiny):
    cfg, model = tiny
    loaded = load_pi05(ckpt)
    assert loaded.config == cfg
    theirs = dict(loaded.model.named_parameters())
    for name, param in model.named_parameters():
        assert theirs[name].dtype == torch.float32 and theirs[name].device.type == 'cpu'
        assert torch.equal(theirs[name], param), name
    assert set(theirs) == set(dict(model.named_parameters()))
    assert not loaded.model.training
    for ours, loaded_out in zip(run(model, cfg), run(loaded.model, cfg)):
        assert torch.equal(ours, loaded_out)
    assert loaded.tokenizer_path == ckpt / 'tokenizer.model'
    assert sorted(loaded.norm_stats) == ['physical-intelligence/libero']
    stats = loaded.norm_stats['physical-intelligence/libero']
    assert np.array_equal(stats['actions'].q99, norm_stats(7, 1).q99)


def test_file_uses_openpi_names(ckpt, tiny):
    cfg, model = tiny
    with safe_open(str(ckpt / 'model.safetensors'), framework='pt') as f:
        keys = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    assert LM_HEAD_KEY in keys and EMBED_KEY not in keys
    assert shapes == expected_layout(cfg)
    data = json.loads((ckpt / 'config.json').read_text())
    assert {'action_dim', 'action_horizon', 'paligemma_variant', 'action_expert_variant',
            'precision'} <= set(data)
    assert data['precision'] == 'float32' and data['action_dim'] == 32
    assert (ckpt / 'assets' / 'physical-intelligence' / 'libero' / 'norm_stats.json').is_file()


def rewrite(src, dst, edit):
    """Copy a checkpoint dir with model.safetensors tensors edited by `edit(dict)`."""
    dst.mkdir()
    (dst / 'config.json').write_text((src / 'config.json').read_text())
    tensors = safetensors.torch.load_file(str(src / 'model.safetensors'))
    edit(tensors)
    safetensors.torch.save_file(tensors, str(dst / 'model.safetensors'))
    return dst


def test_expert_lm_head_is_tolerated(tmp_path, tiny):
    cfg, model = tiny
    path = save_pi05(model, tmp_path / 'full', include_expert_lm_head=True)
    with safe_open(str(path / 'model.safetensors'), framework='pt') as f:
        assert EXPERT_LM_HEAD_KEY in f.keys()
    loaded = load_pi05(path)
    assert EXPERT_LM_HEAD_KEY not in dict(loaded.model.named_parameters())
    assert loaded.tokenizer_path is None and loaded.norm_stats == {}


def test_wrong_shape_names_the_key(tmp_path, ckpt):
    key = 'action_in_proj.weight'

    def edit(t):
        t[key] = torch.zeros(32, 3)
    path = rewrite(ckpt, tmp_path / 'bad', edit)
    with pytest.raises(CheckpointError,
                       match=re.escape(f'shape mismatch: {key}: expected [32, 32], '
                                       'found [32, 3]')):
        load_pi05(path)


def test_missing_and_extra_keys_all_listed(tmp_path, ckpt):
    gone = EXP + 'layers.1.mlp.up_proj.weight'

    def edit(t):
        del t[gone]
        del t[LM_HEAD_KEY]
        t[EMBED_KEY] = torch.zeros(1)
        t['state_proj.weight'] = torch.zeros(4, 2)
    path = rewrite(ckpt, tmp_path / 'bad', edit)
    with pytest.raises(CheckpointError) as info:
        load_pi05(path)
    msg = str(info.value)
    assert '4 problems' in msg
    assert f'missing: {gone} (expected shape [128, 32])' in msg
    assert f'missing: {LM_HEAD_KEY} (expected shape [512, 64])' in msg
    assert f'unexpected: {EMBED_KEY} (found shape [1])' in msg
    assert 'unexpected: state_proj.weight (found shape [4, 2])' in msg


def test_config_for_other_dims_is_rejected_by_shape(ckpt):
    with pytest.raises(CheckpointError, match='shape mismatch'):
        load_pi05(ckpt, config=get_preset('small'))


def test_config_override(ckpt, tiny):
    cfg, _ = tiny
    loaded = load_pi05(ckpt, config=cfg.replace(discrete_state_input=False))
    assert loaded.config.discrete_state_input is False


def test_openpi_config_json():
    openpi = {'action_dim': 32, 'action_horizon': 15, 'paligemma_variant': 'gemma_2b',
              'action_expert_variant': 'gemma_300m', 'precision': 'bfloat16'}
    cfg = config_from_json(openpi)
    assert cfg == get_preset('pi05').replace(action_horizon=15)
    assert cfg.max_token_len == 200 and cfg.discrete_state_input
    lora = config_from_json({**openpi, 'paligemma_variant': 'gemma_2b_lora'})
    assert lora.backbone == cfg.backbone
    dummy = config_from_json({**openpi, 'paligemma_variant': 'dummy',
                              'action_expert_variant': 'dummy', 'max_token_len': 48})
    assert (dummy.backbone.width, dummy.backbone.depth, dummy.max_token_len) == (64, 4, 48)
    with pytest.raises(CheckpointError, match="unknown paligemma_variant 'gemma_7b'"):
        config_from_json({**openpi, 'paligemma_variant': 'gemma_7b'})
    with pytest.raises(CheckpointError, match='only π0.5'):
        config_from_json({**openpi, 'pi05': False})
    with pytest.raises(CheckpointError, match='missing'):
        config_from_json({'action_dim': 32})
    ours = get_preset('tiny')
    with pytest.raises(CheckpointError, match='disagree'):
        config_from_json({'oxygen_ros_config': ours.to_dict(), 'action_horizon': 99})


def test_missing_files(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match='model.safetensors'):
        load_pi05(tmp_path)
    (tmp_path / 'model.safetensors').write_bytes((ckpt / 'model.safetensors').read_bytes())
    with pytest.raises(FileNotFoundError, match='config.json'):
        load_pi05(tmp_path)


def test_bfloat16_keeps_float32_islands(ckpt, tiny):
    cfg, model = tiny
    loaded = load_pi05(ckpt, dtype=torch.bfloat16)
    params = dict(loaded.model.named_parameters())
    f32 = {n for n, p in params.items() if p.dtype == torch.float32}
    assert set(loaded.float32_params) == f32
    for name in ('action_in_proj.weight', 'time_mlp_out.bias',
                 VIS + 'embeddings.patch_embedding.weight',
                 VIS + 'embeddings.position_embedding.weight',
                 LM + 'layers.0.input_layernorm.weight', LM + 'norm.weight',
                 EXP + 'layers.1.post_attention_layernorm.dense.weight'):
        assert name in f32, name
    for name in (LM + 'layers.0.self_attn.q_proj.weight', EMBED_KEY,
                 EXP + 'layers.0.mlp.down_proj.weight'):
        assert params[name].dtype == torch.bfloat16, name
    # Same dtypes as the model's own to_precision; islands keep their exact float32 values.
    reference = Pi05Model(cfg)
    reference.load_state_dict(model.state_dict())
    reference.to_precision(torch.bfloat16)
    original = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert params[name].dtype == param.dtype, name
        assert torch.equal(params[name], original[name].detach().to(param.dtype)), name
    actions, _ = run(loaded.model, cfg)
    assert torch.isfinite(actions).all()


def _mapped_file(address: int) -> str | None:
    """The file a memory mapping of this process at `address` maps (None: anonymous)."""
    with open('/proc/self/maps') as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(v, 16) for v in fields[0].split('-'))
            if start <= address < end:
                return fields[5] if len(fields) > 5 else None
    return None


def test_loading_keeps_weights_memory_mapped(ckpt, tiny):
    """Loading in the file's dtype copies nothing: every weight is a view of the mapped file,
    so a 6.7 GB pi05 checkpoint loads with the RSS of the pages actually touched."""
    loaded = load_pi05(ckpt)   # float32 file, float32 model
    weights = str((ckpt / 'model.safetensors').resolve())
    for name, param in loaded.model.named_parameters():
        assert _mapped_file(param.data_ptr()) == weights, name
    # a cast (bf16 from this float32 file) must copy: only then are weights anonymous memory
    cast = load_pi05(ckpt, dtype=torch.bfloat16).model
    q = cast.backbone.layers[0].self_attn.q_proj.weight
    assert _mapped_file(q.data_ptr()) != weights


def test_pages_no_weight_uses_are_given_back_and_used_ones_kept(tmp_path):
    """release_unused_pages (configure, after fusing and packing): the mapped pages of a
    replaced weight leave the RSS; a live weight's values stay; another file's mapping (no
    tensor of this model in it) is not touched."""
    from oxygen_ros.model.pages import release_unused_pages
    from oxygen_ros.runtime.procfs import status_kb

    shape = (4096, 4096)   # 32 MB each in bf16
    for name in ('ours', 'other'):
        safetensors.torch.save_file({'a': torch.randn(shape).to(torch.bfloat16),
                                     'b': torch.randn(shape).to(torch.bfloat16)},
                                    str(tmp_path / f'{name}.safetensors'))
    with safe_open(str(tmp_path / 'ours.safetensors'), framework='pt', device='cpu') as f:
        kept, replaced = f.get_tensor('a'), f.get_tensor('b')
    with safe_open(str(tmp_path / 'other.safetensors'), framework='pt', device='cpu') as f:
        other = f.get_tensor('a')
    module = torch.nn.Linear(1, 1)
    module.weight = torch.nn.Parameter(kept, requires_grad=False)
    sums = [float(t.float().sum()) for t in (kept, replaced, other)]   # every page touched
    del replaced
    before = status_kb('VmRSS')
    dropped = release_unused_pages(module)
    assert 31 * 2**20 <= dropped <= 33 * 2**20   # b's pages; not a's, not the other file's
    assert before - status_kb('VmRSS') >= 24 * 1024   # KiB: most of b's 32 MB left the RSS
    assert float(module.weight.float().sum()) == sums[0]
    assert float(other.float().sum()) == sums[2]
