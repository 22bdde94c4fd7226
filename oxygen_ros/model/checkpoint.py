"""π0.5 checkpoints: load into / save from Pi05Model (safetensors only, never pickle).

Two layouts load to the same model: openpi's (below) and LeRobot's `type: pi05` folder
(oxygen_ros.model.lerobot: the same names under a `model.` prefix, normalizer statistics in
processor files, the tokenizer named rather than shipped). load_pi05 tells them apart by
config.json ("type" is LeRobot's).

A checkpoint directory, as openpi's converter writes it:
  model.safetensors              parameters under openpi's names (see below)
  config.json                    paligemma_variant, action_expert_variant, action_horizon,
                                 action_dim, precision (+ our optional "oxygen_ros_config")
  assets/<asset_id>/norm_stats.json   asset ids may contain '/' (e.g. physical-intelligence/libero)
  tokenizer.model                optional: PaliGemma SentencePiece model

Names: our state_dict keys equal the file's except the tied embedding, which the file stores as
`paligemma_with_expert.paligemma.lm_head.weight` (safetensors keeps one name of a tied pair).
openpi files also carry an unused `paligemma_with_expert.gemma_expert.lm_head.weight`; it is
ignored and never read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
import shutil
from typing import Mapping

from safetensors import safe_open
import safetensors.torch
import torch

from . import lerobot
from .config import GEMMA_VARIANTS, Pi05Config, SIGLIP_SO400M
from .normalize import find_norm_stats, NormStats, save_norm_stats
from .pi05 import FLOAT32_PARAMS, param_dtype, Pi05Model

logger = logging.getLogger(__name__)

WEIGHTS_FILE = 'model.safetensors'
CONFIG_FILE = 'config.json'
TOKENIZER_FILE = 'tokenizer.model'
ASSETS_DIR = 'assets'

EMBED_KEY = 'paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight'
LM_HEAD_KEY = 'paligemma_with_expert.paligemma.lm_head.weight'
EXPERT_LM_HEAD_KEY = 'paligemma_with_expert.gemma_expert.lm_head.weight'
IGNORED_KEYS = (EXPERT_LM_HEAD_KEY,)

_FLOAT_DTYPES = ('F32', 'BF16', 'F16', 'F64')


class CheckpointError(ValueError):
    """The checkpoint does not match the model: lists every offending key."""


def to_file_key(name: str) -> str:
    """Map our parameter name to openpi's safetensors key."""
    return LM_HEAD_KEY if name == EMBED_KEY else name


def to_model_key(key: str) -> str:
    """Map an openpi safetensors key to our parameter name."""
    return EMBED_KEY if key == LM_HEAD_KEY else key


def expected_layout(config: Pi05Config) -> dict[str, tuple[int, ...]]:
    """File key -> shape of every tensor a checkpoint for `config` must hold (no weights built)."""
    with torch.device('meta'):
        model = Pi05Model(config)
    return {to_file_key(n): tuple(p.shape) for n, p in model.state_dict().items()}


# --- config.json --------------------------------------------------------------------------------
def _variant(name: str, field: str):
    # LoRA variants have the base dims; LoRA adapters are merged before PyTorch conversion.
    base = name[:-len('_lora')] if name.endswith('_lora') else name
    if base not in GEMMA_VARIANTS:
        raise CheckpointError(f'{CONFIG_FILE}: unknown {field} {name!r}; known: '
                              f'{sorted(GEMMA_VARIANTS)} (or give an "oxygen_ros_config")')
    return GEMMA_VARIANTS[base]


def config_from_json(data: Mapping) -> Pi05Config:
    """Build a Pi05Config from a checkpoint's config.json contents."""
    if data.get('pi05') is False:
        raise CheckpointError(f'{CONFIG_FILE}: "pi05": false — only π0.5 checkpoints are '
                              'supported (pi0 has a state projection and no adaRMSNorm)')
    if 'oxygen_ros_config' in data:
        try:
            config = Pi05Config.from_dict(data['oxygen_ros_config'])
        except ValueError as err:
            raise CheckpointError(f'{CONFIG_FILE}: oxygen_ros_config: {err}') from None
    else:
        missing = [k for k in ('paligemma_variant', 'action_expert_variant') if k not in data]
        if missing:
            raise CheckpointError(f'{CONFIG_FILE}: missing {missing} (and no oxygen_ros_config)')
        # openpi's PyTorch π0.5 always uses SigLIP So400m/14 and max_token_len 200.
        config = Pi05Config(backbone=_variant(data['paligemma_variant'], 'paligemma_variant'),
                            expert=_variant(data['action_expert_variant'],
                                            'action_expert_variant'),
                            vision=SIGLIP_SO400M)
    overrides = {k: data[k] for k in ('action_horizon', 'action_dim', 'max_token_len',
                                      'discrete_state_input') if k in data}
    if 'oxygen_ros_config' in data:
        clash = {k: (v, getattr(config, k)) for k, v in overrides.items()
                 if v != getattr(config, k)}
        if clash:
            raise CheckpointError(f'{CONFIG_FILE}: fields disagree with oxygen_ros_config '
                                  f'(file, oxygen_ros_config): {clash}')
        return config
    return config.replace(**overrides)


def _variant_name(gemma) -> str:
    for name, variant in GEMMA_VARIANTS.items():
        if variant == gemma:
            return name
    return 'custom'


def config_to_json(config: Pi05Config, precision: str) -> dict:
    """Return openpi's config.json fields plus our full config (dims no variant has)."""
    return {
        'action_dim': config.action_dim,
        'action_horizon': config.action_horizon,
        'paligemma_variant': _variant_name(config.backbone),
        'action_expert_variant': _variant_name(config.expert),
        'precision': precision,
        'oxygen_ros_config': config.to_dict(),
    }


# --- load ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class LoadedPolicy:
    """A loaded checkpoint: model plus what sits next to the weights."""

    model: Pi05Model
    config: Pi05Config
    norm_stats: dict[str, dict[str, NormStats]]  # asset_id -> {'state': .., 'actions': ..}
    tokenizer_path: Path | None                  # <dir>/tokenizer.model when present
    path: Path
    float32_params: tuple[str, ...] = ()  # names kept float32 when loaded in a lower precision
    layout: str = 'openpi'                # 'openpi' or 'lerobot'
    tokenizer_note: str = ''              # where the tokenizer came from, or why there is none


def _shape_str(shape) -> str:
    return '[' + ', '.join(str(s) for s in shape) + ']'


def check_layout(found: Mapping[str, tuple], dtypes: Mapping[str, str],
                 expected: Mapping[str, tuple], where: str = WEIGHTS_FILE,
                 prefix: str = '') -> None:
    """Raise CheckpointError listing every missing, unexpected, mis-shaped or non-float key.

    prefix: the layout's key prefix (LeRobot's 'model.'); ignored keys carry it too.
    """
    problems = []
    for key, shape in expected.items():
        if key not in found:
            problems.append(f'missing: {key} (expected shape {_shape_str(shape)})')
        elif tuple(found[key]) != tuple(shape):
            problems.append(f'shape mismatch: {key}: expected {_shape_str(shape)}, '
                            f'found {_shape_str(found[key])}')
        elif dtypes.get(key, 'F32') not in _FLOAT_DTYPES:
            problems.append(f'dtype: {key}: expected a float dtype, found {dtypes[key]}')
    for key in found:
        if key not in expected and key not in {prefix + k for k in IGNORED_KEYS}:
            problems.append(f'unexpected: {key} (found shape {_shape_str(found[key])})')
    if problems:
        hint = ''
        if prefix and found and not any(k.startswith(prefix) for k in found):
            hint = f' (no key starts with {prefix!r}: is this an openpi-layout file?)'
        elif not prefix and any(k.startswith(lerobot.KEY_PREFIX) for k in found):
            hint = (f' (keys start with {lerobot.KEY_PREFIX!r}: a LeRobot file, whose '
                    'config.json needs "type": "pi05")')
        raise CheckpointError(f'{where} does not match the model config{hint} '
                              f'({len(problems)} problems):\n  ' + '\n  '.join(problems))


def read_config_json(path: Path) -> dict:
    """Return the contents of <path>/config.json (raises with the file's name)."""
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f'no {CONFIG_FILE} in {path} (or pass config=)')
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f'{config_file}: not valid JSON: {err}') from None
    if not isinstance(data, dict):
        raise CheckpointError(f'{config_file}: expected a JSON object')
    return data


def checkpoint_config(path: str | os.PathLike) -> Pi05Config:
    """Return the Pi05Config a checkpoint folder of either layout describes."""
    path = Path(path)
    data = read_config_json(path)
    if lerobot.is_lerobot_config(data):
        lerobot.check_type(data, str(path / CONFIG_FILE))
        data = lerobot.config_fields(data)
    return config_from_json(data)


def load_pi05(path: str | os.PathLike, config: Pi05Config | None = None,
              device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> LoadedPolicy:
    """Load a π0.5 PyTorch checkpoint directory: openpi's layout or LeRobot's `pi05` folder.

    config: overrides config.json (e.g. to set discrete_state_input, which openpi's config.json
    does not record). device: default CPU. dtype: default float32; with bfloat16 the float32
    islands of Pi05Model.to_precision stay float32 (listed in `float32_params`).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f'checkpoint folder {path} does not exist')
    has_config = (path / CONFIG_FILE).is_file()
    data = read_config_json(path) if has_config else {}
    if lerobot.is_lerobot_config(data):
        return _load_lerobot(path, data, config, device, dtype)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f'no {WEIGHTS_FILE} in {path}')
    if config is None:
        config = config_from_json(read_config_json(path))   # raises when there is none
    model, kept = _load_weights(weights, config, device, dtype)
    tokenizer = path / TOKENIZER_FILE
    has_tokenizer = tokenizer.is_file()
    return LoadedPolicy(model=model, config=config,
                        norm_stats=find_norm_stats(path / ASSETS_DIR),
                        tokenizer_path=tokenizer if has_tokenizer else None,
                        path=path, float32_params=kept,
                        tokenizer_note=(f'{tokenizer}' if has_tokenizer else
                                        f'no {TOKENIZER_FILE} in {path}'))


def _load_lerobot(path: Path, data: dict, config: Pi05Config | None, device, dtype
                  ) -> LoadedPolicy:
    """Load LeRobot's π0.5 folder: same tensors as openpi's under the `model.` prefix."""
    where = f'LeRobot π0.5 checkpoint {path}'
    lerobot.check_type(data, str(path / CONFIG_FILE))
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f'{where}: missing {WEIGHTS_FILE} (the model weights)')
    norm_stats = lerobot.load_norm_stats(path)      # before the weights: fail fast and cheap
    config = config or config_from_json(lerobot.config_fields(data))
    model, kept = _load_weights(weights, config, device, dtype, prefix=lerobot.KEY_PREFIX)
    name = lerobot.tokenizer_name(path)
    tokenizer, note = path / TOKENIZER_FILE, ''
    if tokenizer.is_file():
        note = str(tokenizer)
    else:
        tokenizer = lerobot.find_cached_tokenizer(name)
        caches = ', '.join(str(c) for c in lerobot.hub_cache_dirs())
        note = (f'{tokenizer} (tokenizer {name!r} from the Hugging Face hub cache)' if tokenizer
                else f'tokenizer {name!r} (named by {lerobot.PREPROCESSOR_FILE}): no '
                     f'{TOKENIZER_FILE} in {path} nor in the hub cache ({caches})')
    return LoadedPolicy(model=model, config=config, norm_stats={lerobot.ASSET_ID: norm_stats},
                        tokenizer_path=tokenizer, path=path, float32_params=kept,
                        layout='lerobot', tokenizer_note=note)


def _load_weights(weights: Path, config: Pi05Config, device, dtype, prefix: str = ''
                  ) -> tuple[Pi05Model, tuple[str, ...]]:
    """Build the model for `config` and fill it from `weights` (file keys = prefix + openpi's).

    Every key and shape is checked from the header before any tensor data is read.
    """
    device = torch.device(device or 'cpu')
    dtype = dtype or torch.float32
    with torch.device('meta'):
        model = Pi05Model(config)
    expected = {prefix + to_file_key(n): tuple(p.shape) for n, p in model.state_dict().items()}
    state = {}
    with safe_open(str(weights), framework='pt', device='cpu') as f:
        found, dtypes = {}, {}
        for key in f.keys():
            sl = f.get_slice(key)
            found[key], dtypes[key] = tuple(sl.get_shape()), sl.get_dtype()
        # LeRobot's writer may keep the tied embedding under either of its two names (openpi's
        # converter always uses lm_head, so there the other name stays an error).
        stored = {key: key for key in expected}
        embed, head = prefix + EMBED_KEY, prefix + LM_HEAD_KEY
        if prefix and embed in found:
            if head not in found:
                found[head], dtypes[head] = found[embed], dtypes[embed]
                stored[head] = embed
            del found[embed]
        check_layout(found, dtypes, expected, where=str(weights), prefix=prefix)
        for key in expected:
            name = to_model_key(key[len(prefix):])
            tensor = f.get_tensor(stored[key])
            state[name] = tensor.to(device=device, dtype=param_dtype(name, dtype))
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    kept = tuple(n for n, p in model.named_parameters() if p.dtype != dtype)
    if kept:
        logger.info('loaded %s in %s; %d parameters kept in float32: %s', weights, dtype,
                    len(kept), ', '.join(sorted(set(FLOAT32_PARAMS))))
    return model, kept


# --- save ---------------------------------------------------------------------------------------
def save_pi05(model: Pi05Model, path: str | os.PathLike,
              norm_stats: Mapping[str, NormStats] | None = None, asset_id: str = 'oxygen_ros',
              tokenizer_path: str | os.PathLike | None = None,
              include_expert_lm_head: bool = False) -> Path:
    """Write `model` as an openpi checkpoint directory; return its path.

    norm_stats ({'state': .., 'actions': ..}) go to assets/<asset_id>/norm_stats.json;
    tokenizer_path is copied to tokenizer.model. include_expert_lm_head writes openpi's unused
    expert lm_head (zeros [vocab, expert width]) to exercise loaders on the full openpi layout.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors = {to_file_key(n): t.detach().to('cpu').contiguous()
               for n, t in model.state_dict().items()}
    if include_expert_lm_head:
        expert = config.expert
        tensors[EXPERT_LM_HEAD_KEY] = torch.zeros(expert.vocab_size, expert.width,
                                                  dtype=model.compute_dtype)
    safetensors.torch.save_file(tensors, str(path / WEIGHTS_FILE))
    precision = str(model.compute_dtype).removeprefix('torch.')
    (path / CONFIG_FILE).write_text(json.dumps(config_to_json(config, precision), indent=2))
    if norm_stats is not None:
        save_norm_stats(path / ASSETS_DIR / asset_id, dict(norm_stats))
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, path / TOKENIZER_FILE)
    return path
