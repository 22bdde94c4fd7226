"""Frontend: Observation (numpy) -> model input tensors, model actions -> robot units, ids -> text.

One object per robot setup, built from the model config, a robot name, a tokenizer and norm
stats. It is the engine's only contact with the model-I/O helpers (robots, tokenizer,
normalize), so the scheduler never sees cameras, joints or strings.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.engine.types import Continuation, Observation, ObservationError
from oxygen_ros.model import rtc
from oxygen_ros.model.config import Pi05Config
from oxygen_ros.model.normalize import NormStats
from oxygen_ros.model.pi05 import Pi05Model
from oxygen_ros.model.robot_spec import get_robot, RobotSpec
from oxygen_ros.model.robots import collate, ModelInputs, RobotAdapter
from oxygen_ros.model.tokenizer import PaligemmaTokenizer, train_tiny_tokenizer


@dataclasses.dataclass
class PreparedObservation:
    """One observation in model form (batch of one row)."""

    inputs: ModelInputs                 # numpy row (kept: aloha's delta actions need its state)
    tensors: dict[str, torch.Tensor]    # prefill kwargs: images [1, C, 3, S, S], image_masks
    #                                     [1, C], tokens [1, Lt], token_masks [1, Lt]


class Frontend:
    """Converts between robot observations/actions and the model's tensors, and ids and text."""

    def __init__(self, adapter: RobotAdapter, device: str | torch.device = 'cpu'):
        self.adapter = adapter
        self.tokenizer: PaligemmaTokenizer = adapter.tokenizer
        self.device = torch.device(device)

    @classmethod
    def from_config(cls, config: Pi05Config, robot: str | RobotSpec,
                    tokenizer: PaligemmaTokenizer, norm_stats: dict[str, NormStats],
                    device: str | torch.device = 'cpu') -> Frontend:
        """Frontend for `robot` (a spec, a shipped robot's name or a YAML path), model sizes."""
        adapter = RobotAdapter.from_config(get_robot(robot), config, norm_stats, tokenizer)
        return cls(adapter, device)

    @property
    def robot(self) -> str:
        return self.adapter.spec.name

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    # ---- observation side --------------------------------------------------------------------

    def prepare(self, obs: Observation) -> PreparedObservation:
        """Validate and convert one observation (ObservationError with a reason when bad)."""
        try:
            prompt = obs.instruction if obs.action_prompt is None else obs.action_prompt
            inputs = self.adapter.prepare(obs.images, obs.state, prompt)
        except ValueError as err:   # the adapter's checks of cameras, state and prompt
            raise ObservationError(str(err)) from err
        return PreparedObservation(inputs, collate([inputs], self.device))

    def robot_actions(self, normalized: np.ndarray, prepared: PreparedObservation,
                      held: np.ndarray | None = None) -> np.ndarray:
        """Model actions float32 [H, A] (normalised) -> robot actions float32 [H, robot dim].

        held: robot rows [d, robot dim] the first rows are (RTC prefix mode: the committed
        rows bit for bit, not their round trip through the normalisation).
        """
        actions = self.adapter.postprocess(normalized, prepared.inputs)
        if held is not None:
            actions[:len(held)] = held
        return actions

    def row_plan(self, continuation: Continuation | None, prepared: PreparedObservation,
                 horizon: int) -> rtc.RowPlan | None:
        """Return what the denoise loop inpaints for `continuation` (None: nothing).

        The committed rows arrive in robot units; they go through the inverse of
        robot_actions for this observation (its state for delta actions), so the guidance
        target lives in the model's normalised space. Raises ValueError for a bad chunk.
        """
        if continuation is None or len(continuation.rows) == 0:
            return None
        target = self.adapter.model_actions(continuation.rows[:horizon], prepared.inputs)
        c = continuation
        return rtc.row_plan(c.mode, target, horizon, c.delay, c.overlap_end or horizon,
                            c.schedule, c.max_guidance_weight,
                            columns=self.adapter.spec.action_dim)

    # ---- text side ---------------------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text (no BOS, no padding), for prompt templates fed as forced tokens."""
        # PaligemmaTokenizer only exposes prompt-shaped encoding; plain text goes through its
        # SentencePiece processor directly.
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def next_delta(self, ids: list[int], shown: str, final: bool) -> tuple[str, str]:
        """(delta, text) after `shown`, the text of the stream's previous ids (see tokenizer)."""
        return self.tokenizer.next_delta(ids, shown, final=final)


def held_rows(continuation: Continuation | None, plan: rtc.RowPlan | None) -> np.ndarray | None:
    """Return the committed rows a plan holds, robot units [d, A] (None: it holds none)."""
    if plan is None or not plan.hold:
        return None
    return continuation.rows[:plan.delay]


def identity_norm_stats(robot: str | RobotSpec) -> dict[str, NormStats]:
    """Norm stats that leave values in [-1, 1] unchanged (random-weight demos and tests)."""
    spec = get_robot(robot)

    def stats(dim: int) -> NormStats:
        return NormStats(mean=np.zeros(dim), std=np.ones(dim), q01=-np.ones(dim),
                         q99=np.ones(dim))
    return {'state': stats(spec.state_dim), 'actions': stats(spec.action_dim)}


def random_setup(config: Pi05Config, robot: str | RobotSpec = 'libero', seed: int = 0,
                 tokenizer_dir: str | os.PathLike | None = None,
                 device: str | torch.device = 'cpu', dtype: torch.dtype = torch.float32
                 ) -> tuple[Pi05Model, Frontend]:
    """Build a random-weight model and a frontend with a tiny trained tokenizer (no downloads).

    The tokenizer vocab is at most 1024 (a small corpus cannot fill more); the model's
    embedding rows of ids that are not text pieces are zero, so it only emits decodable text.
    """
    vocab = min(config.backbone.vocab_size, 1024)
    out_dir = Path(tokenizer_dir or Path.home() / '.cache' / 'oxygen_ros' / 'tokenizers')
    tok_path = train_tiny_tokenizer(out_dir, vocab)
    tokenizer = PaligemmaTokenizer(tok_path, max_len=config.max_token_len)
    # Built in its final dtype and device, parameter by parameter: no float32 copy first.
    model = Pi05Model.build(config, dtype, device)
    model = model.init_random(seed, text_ids=tokenizer.text_piece_ids()).eval()
    frontend = Frontend.from_config(config, robot, tokenizer, identity_norm_stats(robot), device)
    return model, frontend


def random_observation(robot: str | RobotSpec, frame_index: int, seed: int = 0,
                       image_size: int = 224,
                       instruction: str = 'pick up the red block') -> Observation:
    """Make a synthetic observation for `robot`, a pure function of (seed, frame_index)."""
    spec = get_robot(robot)
    rng = np.random.default_rng(np.random.SeedSequence([seed, frame_index, 7]))
    images = {cam: rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)
              for cam in spec.camera_names}
    state = rng.uniform(-1, 1, spec.state_dim).astype(np.float32)
    return Observation(images=images, state=state, instruction=instruction,
                       stamp=frame_index * 0.1, frame_index=frame_index)


def synthetic_frame(robot: str | RobotSpec, index: int, time_s: float, seed: int,
                    image_size: int) -> Observation:
    """Return frame `index` of a smooth synthetic episode observed at time_s (an Observation).

    Each camera shows a sum of a few random plane waves drifting slowly (a picture that pans),
    the state follows slow sines: consecutive frames differ a little, as on a robot.
    """
    spec = get_robot(robot)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:image_size, 0:image_size] / image_size
    images = {}
    for camera in spec.camera_names:
        waves = rng.uniform(-12, 12, (4, 2))                    # cycles per image, per wave
        phases = rng.uniform(0, 2 * np.pi, (4, 3))
        speed = rng.uniform(0.2, 0.6, 4)                        # radians per second
        picture = sum(np.sin(2 * np.pi * (kx * x + ky * y)[..., None] + phase + w * time_s)
                      for (kx, ky), phase, w in zip(waves, phases, speed))
        images[camera] = np.clip(127.5 + 30 * picture, 0, 255).astype(np.uint8)
    state = 0.8 * np.sin(0.5 * time_s + 0.4 * np.arange(spec.state_dim))
    return Observation(images=images, state=state.astype(np.float32),
                       instruction='pick up the black bowl', stamp=time_s, frame_index=index)
