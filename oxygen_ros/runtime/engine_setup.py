"""Build the engine (model + frontend + scheduler) from Settings; what the node and the replay run.

Kept free of ROS so the tests and the bag replay build exactly the engine the node runs and
feed it the same observations.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
import time

import torch

from oxygen_ros.engine import (AdaptiveBudget, Budget, FixedBudget, FleetRobot, Frontend,
                               identity_norm_stats, LanguagePolicy, make_fleet, make_system,
                               random_observation, random_setup)
from oxygen_ros.engine.engine import pool_slot_bytes
from oxygen_ros.engine.hardware import choose_dtype
from oxygen_ros.engine.prepare import CompilePlan, prepare_model, runner_options, seal
from oxygen_ros.engine.workload import default_num_slots
from oxygen_ros.model.checkpoint import (CheckpointError, checkpoint_config, CONFIG_FILE,
                                         load_pi05)
from oxygen_ros.model.config import get_preset
from oxygen_ros.model.robots import get_robot
from oxygen_ros.model.tokenizer import PaligemmaTokenizer
from oxygen_ros.runtime.params import FleetSettings, Settings

logger = logging.getLogger(__name__)


class EngineSetupError(RuntimeError):
    """The engine could not be built; str(err) says what to fix."""


# Everything build_engine raises for a bad setting or file (its message names the culprit).
SETUP_ERRORS = (EngineSetupError, CheckpointError, FileNotFoundError, ValueError)


@dataclasses.dataclass
class Engine:
    """One engine instance and what the node reports about it."""

    system: object                 # engine Scheduler (one robot) or FleetEngine (several)
    frontend: Frontend | None      # the robot's (None for a fleet: each robot has its own)
    description: dict              # for diagnostics: source, preset, device, dtype, ...
    warnings: list[str]            # things that work but deserve a look (e.g. tiny tokenizer)


def inference_threads(torch_threads: int) -> int:
    """Torch threads for inference: the parameter, or 0 -> every core but one.

    Measured on a 2-core machine with the node driven by a camera process (bench --parts
    node, pi05-cpu): 2 threads gave inference 1.66x the engine alone with 100% deadline misses
    (an OpenMP team loses whole barriers whenever the executor, DDS or the cameras take one of
    its cores); 1 thread gave 1.01x and held the rate. One core stays for everything else.
    """
    if torch_threads:
        return torch_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def _dtype(name: str) -> torch.dtype:
    return {'float32': torch.float32, 'bfloat16': torch.bfloat16}[name]


def resolve_dtype(settings: Settings, config) -> tuple[torch.dtype, str]:
    """Return the compute dtype to build `config` in, and why: the parameter, or probed."""
    if settings.dtype != 'auto':
        return _dtype(settings.dtype), 'set by parameter dtype'
    return choose_dtype(config, settings.device)


def _model_config(settings: Settings):
    """Return the Pi05Config the settings load (checkpoint's config.json or the preset)."""
    if settings.checkpoint:
        path = Path(settings.checkpoint).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f'checkpoint folder {path} does not exist')
        try:
            config = checkpoint_config(path)
        except FileNotFoundError:
            raise
        except OSError as err:
            raise EngineSetupError(
                f'checkpoint {path}: cannot read {CONFIG_FILE}: {err}') from None
    else:
        config = get_preset(settings.preset)
    if settings.denoise_steps:
        config = config.replace(num_steps=settings.denoise_steps)
    return config


def _check_device(device: str) -> None:
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise EngineSetupError(f"device {device!r}: CUDA is not available to this torch "
                               f"({torch.__version__}); use device 'cpu'")


def policy_for(settings: Settings, eos_id: int) -> LanguagePolicy:
    """Build the language request policy the node's parameters describe."""
    return LanguagePolicy(max_new_tokens=settings.tokens_per_request,
                          every_n_frames=settings.request_every_n_frames, seed=settings.seed,
                          eos_id=eos_id, prompt_template=settings.language_prompt)


def slots_needed(every_n_frames: int, tokens_per_request: int, k: int | None) -> int:
    """KV slots the engine sizes itself with for this request rate, N and k (None: adaptive)."""
    policy = LanguagePolicy(max_new_tokens=tokens_per_request, every_n_frames=every_n_frames)
    return default_num_slots(policy, k or 1)


def _random_weights(settings: Settings, device: str, dtype: torch.dtype, config):
    model, frontend = random_setup(config, settings.robot, seed=settings.seed, device=device,
                                   dtype=dtype)
    warnings = []
    tokenizer = frontend.tokenizer
    if settings.tokenizer:
        tokenizer = PaligemmaTokenizer(settings.tokenizer, max_len=config.max_token_len)
    else:
        warnings.append('random weights with the tiny offline tokenizer: narration is noise')

    def make_frontend(robot: str) -> Frontend:
        return Frontend.from_config(config, robot, tokenizer, identity_norm_stats(robot),
                                    device)
    return model, make_frontend, {'source': f'random weights (preset {settings.preset}, '
                                            f'seed {settings.seed})'}, warnings


def _checkpoint(settings: Settings, device: str, dtype: torch.dtype, config):
    path = Path(settings.checkpoint).expanduser()
    # config.json's own config unless something in it was overridden (denoise steps)
    loaded = load_pi05(path, config=config if settings.denoise_steps else None, device=device,
                       dtype=dtype)
    stats = loaded.norm_stats

    def norm_stats_of(robot: str):
        spec = get_robot(robot)
        if spec.asset_id in stats:
            return spec.asset_id, stats[spec.asset_id]
        if len(stats) == 1:
            return next(iter(stats.items()))
        raise EngineSetupError(
            f'checkpoint {path}: no norm stats for robot {robot!r} (looked for '
            f'assets/{spec.asset_id}/norm_stats.json; found {sorted(stats) or "none"})')
    asset, _ = norm_stats_of(settings.robot)   # the node's robot must have them: fail now
    warnings = []
    if settings.tokenizer:
        tokenizer_path = Path(settings.tokenizer).expanduser()
    elif loaded.tokenizer_path is not None:
        tokenizer_path = loaded.tokenizer_path
    else:
        raise EngineSetupError(f'checkpoint {path}: {loaded.tokenizer_note}, and parameter '
                               "'tokenizer' is empty: give the PaliGemma SentencePiece model "
                               '(tokenizer.model)')
    tokenizer = PaligemmaTokenizer(tokenizer_path, max_len=loaded.config.max_token_len)

    def make_frontend(robot: str) -> Frontend:
        return Frontend.from_config(loaded.config, robot, tokenizer, norm_stats_of(robot)[1],
                                    device)
    return loaded.model, make_frontend, {'source': f'{loaded.layout} checkpoint {path}',
                                         'norm_stats': asset,
                                         'tokenizer': str(tokenizer_path)}, warnings


def available_memory_bytes(device: str) -> int | None:
    """Memory a new allocation on `device` can use now (None when unknown)."""
    if device.startswith('cuda'):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open('/proc/meminfo') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_pool_fits(settings: Settings, config, policy: LanguagePolicy,
                    dtype: torch.dtype) -> None:
    """Refuse an explicit kv_capacity whose pool would take more than half the free memory.

    A parameter set over DDS (kv_capacity=1024 of a large model) must fail configure with a
    reason, not take the robot computer out of memory.
    """
    if not settings.kv_capacity:
        return
    per_slot = pool_slot_bytes(config, policy, dtype)
    need = settings.kv_capacity * per_slot
    free = available_memory_bytes(settings.device)
    if free is not None and need > free // 2:
        raise EngineSetupError(
            f'kv_capacity {settings.kv_capacity} needs {need / 2**30:.2f} GiB of KV cache, more '
            f'than half the free memory of {settings.device} ({free / 2**30:.2f} GiB): use '
            f'kv_capacity 0 (sized from N and k) or at most {max(free // 2 // per_slot, 1)}')


def warm_up(model, frontend: Frontend, settings: Settings) -> None:
    """Run one throwaway frame (own 2-slot scheduler) so the first real tick is not slow.

    The first torch calls allocate and pick kernels (CUDA: initialise the context); doing it
    here keeps it out of the control loop and leaves the node's scheduler untouched, so frame
    and request numbering start at 0.
    """
    policy = LanguagePolicy(max_new_tokens=2, every_n_frames=1, eos_id=frontend.eos_id)
    system = make_system('oxygen', model, frontend, policy, k=2, num_slots=2, seed=settings.seed)
    obs = random_observation(settings.robot, 0, settings.seed,
                             image_size=model.config.vision.image_size)
    system.step(obs)
    system.step(random_observation(settings.robot, 1, settings.seed,
                                   image_size=model.config.vision.image_size))


def warm_up_frame(frontend: Frontend, settings: Settings, image_size: int) -> dict:
    """Prepare a synthetic frame of the settings' robot (its cameras, a prompt): tensors."""
    obs = random_observation(settings.robot, 0, settings.seed, image_size=image_size)
    return frontend.prepare(obs).tensors


def load_model(settings: Settings):
    """Load weights (checkpoint or random preset) once.

    Returns (model, make_frontend(robot), description, warnings); make_frontend builds a robot
    type's frontend over that model.

    Raises EngineSetupError (or CheckpointError / FileNotFoundError) naming the culprit.
    """
    _check_device(settings.device)
    # Process-wide: threads that start torch work later (the control thread) use it too.
    torch.set_num_threads(inference_threads(settings.torch_threads))
    try:
        config = _model_config(settings)
        dtype, why = resolve_dtype(settings, config)
        logger.info('dtype %s: %s', str(dtype).removeprefix('torch.'), why)
        if settings.checkpoint:
            loaded = _checkpoint(settings, settings.device, dtype, config)
        else:
            loaded = _random_weights(settings, settings.device, dtype, config)
        loaded[2]['dtype_reason'] = why
        return loaded
    except (CheckpointError, FileNotFoundError, EngineSetupError):
        raise
    except (ValueError, OSError, RuntimeError) as err:
        # Loader errors (bad safetensors header, tokenizer/vocab mismatch, ...) carry their own
        # reason; say which step failed.
        raise EngineSetupError(f'loading the model failed: {err}') from err


def _kv_dtype(settings: Settings, model) -> torch.dtype:
    return model.compute_dtype if settings.kv_dtype == 'auto' else _dtype(settings.kv_dtype)


def _describe(description: dict, settings: Settings, model, kv_slots: int,
              first: dict, last: dict, plan: CompilePlan, started: float) -> dict:
    config = model.config
    description.update(first)
    description.update({
        'device': settings.device, 'dtype': str(model.compute_dtype).removeprefix('torch.'),
        'kv_dtype': str(_kv_dtype(settings, model)).removeprefix('torch.'),
        'torch_threads': torch.get_num_threads(), 'compile': plan.describe(),
        'compile_s': round(plan.seconds, 2),
        'configure_s': round(time.perf_counter() - started, 2),
        'prefix_len': config.prefix_len, 'horizon': config.action_horizon,
        'denoise_steps': config.num_steps, **last, 'kv_slots': kv_slots,
    })
    logger.info('engine ready in %.1f s (%s, %s; %s)', description['configure_s'],
                description['dtype'], settings.device, description['compile'])
    return description


def build_engine(settings: Settings, warmup: bool = True) -> Engine:
    """Load weights (checkpoint or random preset) and build the scheduler the node drives.

    Raises EngineSetupError (or CheckpointError / FileNotFoundError / ValueError from the
    loaders) with a message that names the file or parameter at fault.
    """
    started = time.perf_counter()
    model, make_frontend, description, warnings = load_model(settings)
    try:
        frontend = make_frontend(settings.robot)
    except ValueError as err:
        raise EngineSetupError(f'loading the model failed: {err}') from err
    policy = policy_for(settings, frontend.eos_id)
    kv_dtype = _kv_dtype(settings, model)
    check_pool_fits(settings, model.config, policy, kv_dtype)
    plan = prepare_model(model, settings.device, settings.compile)
    compile_start = time.perf_counter()
    if warmup:
        warm_up(model, frontend, settings)
    k = settings.decode_budget
    system = make_system('oxygen' if k is not None else 'oxygen-adaptive', model, frontend,
                         policy, k=k or 1, frame_period_s=settings.period_s,
                         num_slots=settings.kv_capacity or None, seed=settings.seed,
                         runner_options={'kv_dtype': kv_dtype,
                                         **runner_options(plan, settings.device)})
    if warmup:
        system.runner.warm_up_compiled(frames=[warm_up_frame(
            frontend, settings, model.config.vision.image_size)])
        seal(model, plan, compile_start)
    _describe(description, settings, model, system.pool.num_slots, {'robot': settings.robot},
              {'tokens_per_request': settings.tokens_per_request}, plan, started)
    return Engine(system, frontend, description, warnings)


def budget_for(settings: Settings) -> Budget:
    """Return the decode budget a robot's settings ask for: fixed k, or adaptive to its period."""
    k = settings.decode_budget
    if k is not None:
        return FixedBudget(k)
    return AdaptiveBudget(settings.period_s, k_max=settings.tokens_per_request)


def build_fleet(fleet: FleetSettings, warmup: bool = True) -> Engine:
    """Load the model once and build the FleetEngine serving every robot of `fleet`.

    Each robot gets its own frontend (its robot type), language policy, decode budget, noise
    seed and KV quota (its kv_capacity; 0 = sized from its N, k and request rate). Prefill
    runs one row per call on the CPU (a compute-bound CPU gains nothing from rows of one
    prefill, and each row costs activations), all rows in one call on an accelerator.
    Raises as build_engine does; a robot's problem names the robot.
    """
    node = fleet.node
    started = time.perf_counter()
    model, make_frontend, description, warnings = load_model(node)
    frontends, robots = {}, []
    kv_dtype = _kv_dtype(node, model)
    for name, settings in fleet.robots.items():
        try:
            if settings.robot not in frontends:
                frontends[settings.robot] = make_frontend(settings.robot)
        except (ValueError, EngineSetupError) as err:
            raise EngineSetupError(f'robot {name}: {err}') from err
        frontend = frontends[settings.robot]
        policy = policy_for(settings, frontend.eos_id)
        try:
            check_pool_fits(settings, model.config, policy, kv_dtype)
        except EngineSetupError as err:
            raise EngineSetupError(f'{name}.{err}') from None
        robots.append(FleetRobot(name, frontend, policy, budget_for(settings),
                                 kv_quota=settings.kv_capacity or None, seed=settings.seed))
    plan = prepare_model(model, node.device, node.compile)
    compile_start = time.perf_counter()
    if warmup:
        first = next(iter(fleet.robots.values()))
        warm_up(model, frontends[first.robot], first)
    system = make_fleet(model, robots, kv_dtype=kv_dtype,
                        max_prefill_rows=1 if node.device == 'cpu' else None,
                        **runner_options(plan, node.device))
    if warmup:
        # Robots due in the same tick denoise together: batches of 1 and of several rows.
        system.runner.warm_up_compiled(
            action_rows=(1, 2), frames=[warm_up_frame(frontends[s.robot], s,
                                                      model.config.vision.image_size)
                                        for s in fleet.robots.values()])
        seal(model, plan, compile_start)
    _describe(description, node, model, system.pool.num_slots, {'robots': ', '.join(
        f'{name} ({s.robot})' for name, s in fleet.robots.items())}, {}, plan, started)
    return Engine(system, None, description, warnings)
