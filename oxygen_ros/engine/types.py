"""Plain data crossing the engine boundary: numpy arrays, ints, strings; no tensors, no ROS."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from oxygen_ros.model.config import DEFAULT_MAX_GUIDANCE_WEIGHT

if TYPE_CHECKING:
    from oxygen_ros.kv.request import FinishReason


class ObservationError(ValueError):
    """An observation the robot's adapter cannot use; str() says what was wrong and expected.

    The only failure the runtime reports as a rejected observation (an input warning): any
    other error inside act() is reported as what it is.
    """


@dataclasses.dataclass
class Observation:
    """One control tick's inputs, already converted from robot messages."""

    images: dict[str, np.ndarray]   # camera name -> uint8 [H, W, 3]; absent camera = masked
    state: np.ndarray               # [state_dim] robot units (joint positions, gripper, ...)
    instruction: str                # task text, e.g. 'pick up the red block'
    stamp: float = 0.0              # camera time in seconds, passed through to the outputs
    frame_index: int | None = None  # None: the engine numbers frames 0, 1, 2, ...
    action_prompt: str | None = None  # the prefill's prompt (None: the instruction); π0.5's
    #                                   subtask (runtime/subtask.py); templates of language
    #                                   tasks still read the instruction


@dataclasses.dataclass
class Continuation:
    """The chunk the robot is executing, which the next chunk continues (real-time chunking).

    Row j of the new chunk plays when committed row j does; see oxygen_ros.model.rtc for what
    the modes do with the rows and docs/rtc.md for the timing.
    """

    rows: np.ndarray                # float [n, robot_action_dim] robot units: the committed
    #                                 rows that play at the new chunk's rows 0..n-1
    delay: int                      # d: rows 0..d-1 play before the new chunk arrives
    mode: str = 'guided'            # 'guided' (soft, ΠGDM) or 'prefix' (rows 0..d-1 held)
    overlap_end: int = 0            # rows >= this are free (0: every committed row guided)
    schedule: str = 'exp'           # weight decay over the overlap: 'linear' or 'exp'
    max_guidance_weight: float = DEFAULT_MAX_GUIDANCE_WEIGHT   # β, the guidance cap


@dataclasses.dataclass
class ActionOutput:
    """The action chunk of one frame, ready to publish."""

    frame_index: int                # frame this chunk was computed from
    actions: np.ndarray             # float32 [H, robot_action_dim], robot units
    normalized: np.ndarray          # float32 [H, model action_dim], model output before unnorm
    inference_time_s: float         # observation in -> actions out (prefill + denoise + glue)
    stamp: float = 0.0              # the observation's stamp
    start_row: int = 0              # first row to play: rows before it fall within the
    #                                 inference delay (real-time chunking; 0 without it)


@dataclasses.dataclass
class TokenDelta:
    """New tokens of one language request produced in one frame."""

    request_id: int                 # request these tokens belong to
    origin_frame: int               # frame whose KV cache the request continues
    token_ids: list[int]            # tokens new in this frame (may be empty when done)
    text: str                       # decoded text of exactly these tokens
    tokens_so_far: int              # generated tokens of the request including these
    done: bool                      # True on the request's last delta
    finish_reason: FinishReason | str = ''   # '' while running, else a FinishReason
    task: str = 'narration'         # language task of the request


@dataclasses.dataclass
class FinishedRequest:
    """A language request that ended in this frame, with everything it produced."""

    request_id: int                 # request id (same as in its deltas)
    origin_frame: int               # frame it started at
    token_ids: list[int]            # all generated tokens (EOS included when it stopped there)
    text: str                       # full decoded text
    finish_reason: FinishReason     # why it ended (.completed: eos or length)
    frames: int                     # frames it was alive (1 = finished in its first frame)
    error: str = ''                 # exception text ('error') or refusal reason ('refused')
    task: str = 'narration'         # language task of the request
    ticket: int | None = None       # the caller's id of an asked request (a question)


@dataclasses.dataclass
class Timings:
    """Where one frame's wall time went, in seconds."""

    prefill_s: float = 0.0          # all prefills of the frame (isolated does two)
    action_s: float = 0.0           # flow-matching denoise
    decode_s: float = 0.0           # decode steps + first-token LM head
    overhead_s: float = 0.0         # engine time outside model calls (total - model calls)
    total_s: float = 0.0            # act() + advance_language() wall time
    act_s: float = 0.0              # observation to actions (the action path alone)
    frontend_s: float = 0.0         # part of overhead_s: image/prompt conversion, action
    #                                 unnormalisation, detokenisation

    @property
    def model_s(self) -> float:
        return self.prefill_s + self.action_s + self.decode_s

    @property
    def manager_s(self) -> float:
        """Scheduling and KV bookkeeping: overhead_s without the frontend's conversions."""
        return max(self.overhead_s - self.frontend_s, 0.0)


@dataclasses.dataclass
class FrameResult:
    """Everything one frame produced, for the node, the benchmark and the tests."""

    frame_index: int                # frame this result belongs to (-1: language-only call)
    action: ActionOutput | None     # this frame's action chunk (None: language-only call)
    deltas: list[TokenDelta]        # token deltas of every request touched in this frame
    finished: list[FinishedRequest]  # requests that ended in this frame
    k: int                          # decode budget chosen for this frame (tokens per request)
    decode_steps: int               # batched decode_step calls actually run
    batch_sizes: list[int]          # rows in each of those decode steps
    active_requests: int            # requests still running after this frame
    timings: Timings                # wall-time split of the frame
    kv_usage: dict                  # KVPool.usage() snapshot at the end of the frame

    @property
    def decode_batch_size(self) -> int:
        """Largest decode batch of the frame (0 when no decode step ran)."""
        return max(self.batch_sizes, default=0)
