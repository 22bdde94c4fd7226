"""Per-system frame logs and the metrics computed from them; the token-identity check.

Definitions (the paper's where it has one):
  action frequency      H / mean frame latency; a frame = act() + advance_language()
  obs-to-action latency act() time: observation in -> actions out (prefill + denoise + glue)
  tokens/s              tokens emitted in the measured frames / their summed frame time
  completion time       a request's end-of-frame time minus its origin frame's start time,
                        on the system's own timeline (frames back to back)
  deadline miss         a measured frame longer than the control period
  manager overhead      sum(Timings.manager_s) / sum(Timings.total_s): the engine's time
                        outside model calls less the frontend's conversions (image resize,
                        prompt, action unnormalisation, detokenising), which every system
                        does alike and which `frontend_ms` reports
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..engine.types import FinishedRequest, FrameResult
from ..kv import FinishReason


@dataclasses.dataclass
class FrameSample:
    """One measured frame of one system."""

    total_s: float
    act_s: float
    prefill_s: float
    denoise_s: float
    decode_s: float
    overhead_s: float       # outside model calls: frontend_s + manager_s
    frontend_s: float       # the frontend's conversions (Timings.frontend_s)
    manager_s: float        # scheduling and KV bookkeeping (Timings.manager_s)
    tokens: int             # tokens emitted in this frame (all requests)
    k: int                  # decode budget of the frame
    decode_steps: int
    max_batch: int          # largest decode batch of the frame
    cpu_s: float            # process CPU time during the frame (nan when not measured)


@dataclasses.dataclass
class RequestRecord:
    """A finished language request, keyed by its origin frame in SystemLog.requests."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason   # completed (eos/length): the whole text; evicted: a prefix
    finish_frame: int       # frame in which it ended; -1 when it ended while draining


class SystemLog:
    """Everything one system produced in one group."""

    def __init__(self):
        self.samples: list[FrameSample] = []               # measured frames only
        self.requests: dict[int, RequestRecord] = {}       # origin frame -> finished request
        self.actions: dict[int, np.ndarray] = {}           # frame -> normalised actions [H, A]
        self.frame_start_s: dict[int, float] = {}          # own timeline, frames back to back
        self.frame_end_s: dict[int, float] = {}
        self.measured_frames: list[int] = []
        self.refused = 0                                   # requests refused (queue/pool full)
        self.kv_peak_bytes = 0                             # pool peak (slots in use × bytes)
        self.kv_total_bytes = 0                            # pool allocation
        self._clock_s = 0.0

    def record(self, frame_index: int, result: FrameResult, cpu_s: float,
               measured: bool) -> None:
        """Add one frame's result (warm-up frames too: requests and timeline need them)."""
        t = result.timings
        self.frame_start_s[frame_index] = self._clock_s
        self._clock_s += t.total_s
        self.frame_end_s[frame_index] = self._clock_s
        if result.action is not None:
            self.actions[frame_index] = np.asarray(result.action.normalized, dtype=np.float32)
        self.record_finished(result.finished, frame_index)
        usage = result.kv_usage or {}
        # Prefix slots and generation blocks: the whole KV cache.
        peak = usage.get('peak_bytes', 0) + usage.get('block_peak_bytes', 0)
        total = usage.get('bytes_total', 0) + usage.get('block_bytes_total', 0)
        self.kv_peak_bytes = max(self.kv_peak_bytes, int(peak))
        self.kv_total_bytes = max(self.kv_total_bytes, int(total))
        if not measured:
            return
        self.measured_frames.append(frame_index)
        self.samples.append(FrameSample(
            total_s=t.total_s, act_s=t.act_s, prefill_s=t.prefill_s, denoise_s=t.action_s,
            decode_s=t.decode_s, overhead_s=t.overhead_s, frontend_s=t.frontend_s,
            manager_s=t.manager_s,
            tokens=sum(len(d.token_ids) for d in result.deltas), k=result.k,
            decode_steps=result.decode_steps, max_batch=max(result.batch_sizes, default=0),
            cpu_s=cpu_s))

    def record_finished(self, finished: list[FinishedRequest], frame_index: int) -> None:
        for req in finished:
            reason = FinishReason(req.finish_reason)
            if reason is FinishReason.REFUSED:
                self.refused += 1
                continue   # never started: no tokens, no origin-frame cache
            self.requests[req.origin_frame] = RequestRecord(tuple(req.token_ids), reason,
                                                            frame_index)

    def completion_times(self) -> list[float]:
        """Seconds from origin-frame start to end of the finishing frame, measured window."""
        window = set(self.measured_frames)
        return [self.frame_end_s[r.finish_frame] - self.frame_start_s[origin]
                for origin, r in self.requests.items()
                if r.finish_frame in window and r.finish_reason.completed
                and origin in self.frame_start_s]

    def count(self, reason: str) -> int:
        return sum(r.finish_reason == reason for r in self.requests.values())


@dataclasses.dataclass
class TokenCheck:
    """Result of comparing one system's request tokens with the reference (isolated)."""

    compared: int                   # requests present in both and comparable
    mismatched: list[int]           # origin frames whose tokens differ

    @property
    def identical(self) -> bool | None:
        """True/False; None when there was nothing to compare."""
        return None if self.compared == 0 else not self.mismatched


def compare_tokens(reference: dict[int, RequestRecord],
                   candidate: dict[int, RequestRecord]) -> TokenCheck:
    """Compare every request both systems finished, keyed by origin frame.

    Complete requests must match token for token; an evicted request's tokens must be a prefix
    of the reference's (it was cut short, never altered).
    """
    compared, mismatched = 0, []
    for origin, cand in sorted(candidate.items()):
        ref = reference.get(origin)
        if ref is None or not ref.finish_reason.completed:
            continue
        if cand.finish_reason.completed:
            same = cand.token_ids == ref.token_ids
        elif cand.finish_reason is FinishReason.EVICTED:
            same = cand.token_ids == ref.token_ids[:len(cand.token_ids)]
        else:
            continue
        compared += 1
        if not same:
            mismatched.append(origin)
    return TokenCheck(compared, mismatched)


def max_action_diff(reference: dict[int, np.ndarray], candidate: dict[int, np.ndarray]) -> float:
    """Largest |difference| of normalised actions over the frames both computed."""
    common = sorted(set(reference) & set(candidate))
    if not common:
        return math.nan
    return max(float(np.max(np.abs(reference[f] - candidate[f]))) for f in common)


def percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(log: SystemLog, horizon: int, deadline_s: float) -> dict[str, float]:
    """Metrics of one system's measured frames (times in ms, rates per second)."""
    s = log.samples
    if not s:
        raise ValueError('no measured frames')
    total = np.array([x.total_s for x in s])
    act = np.array([x.act_s for x in s])
    cpu = np.array([x.cpu_s for x in s])
    completion = log.completion_times()
    mean_of = {name: float(np.mean([getattr(x, name) for x in s]))
               for name in ('prefill_s', 'denoise_s', 'decode_s', 'overhead_s', 'frontend_s',
                            'manager_s')}
    return {
        'action_hz': horizon / float(total.mean()),
        'action_hz_p50': horizon / float(np.median(total)),
        'frame_ms_mean': 1e3 * float(total.mean()),
        'frame_ms_p50': 1e3 * percentile(total, 50),
        'frame_ms_p99': 1e3 * percentile(total, 99),
        'act_ms_mean': 1e3 * float(act.mean()),
        'act_ms_p50': 1e3 * percentile(act, 50),
        'act_ms_p99': 1e3 * percentile(act, 99),
        'prefill_ms': 1e3 * mean_of['prefill_s'],
        'denoise_ms': 1e3 * mean_of['denoise_s'],
        'decode_ms': 1e3 * mean_of['decode_s'],
        'overhead_ms': 1e3 * mean_of['overhead_s'],
        'overhead_pct': 100 * sum(x.overhead_s for x in s) / float(total.sum()),
        'frontend_ms': 1e3 * mean_of['frontend_s'],
        'manager_ms': 1e3 * mean_of['manager_s'],
        'manager_pct': 100 * sum(x.manager_s for x in s) / float(total.sum()),
        'tokens_per_s': sum(x.tokens for x in s) / float(total.sum()),
        'tokens_per_s_p50': float(np.mean([x.tokens for x in s])) / float(np.median(total)),
        'mean_k': float(np.mean([x.k for x in s])),
        'mean_max_batch': float(np.mean([x.max_batch for x in s])),
        'requests_done': len(completion),
        'completion_s_p50': percentile(completion, 50),
        'completion_s_p99': percentile(completion, 99),
        'deadline_ms': 1e3 * deadline_s,
        'deadline_miss_pct': 100 * float(np.mean(total > deadline_s)),
        'evicted': log.count('evicted'),
        'refused': log.refused,
        'errors': log.count('error'),
        'kv_pool_mb': log.kv_total_bytes / 2**20,
        'kv_peak_mb': log.kv_peak_bytes / 2**20,
        # CPU seconds per wall second of the process; far below the thread count means the
        # machine was busy with something else during the frames.
        'cpu_util': float(np.nanmean(cpu / total)) if np.isfinite(cpu).any() else math.nan,
    }
