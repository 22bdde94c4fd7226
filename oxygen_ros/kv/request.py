"""RequestState σ: one language request continuing the KV cache of the frame it started at.

A request reads the prefix slot of its frame (shared with the frame's other requests, one per
language task) and writes its own generation block (storage index, not RoPE position):

    prefix slot:       [0 .............. P)     prefix of frame t (n_valid real), read only
    generation block:  [0 ...... F)[F ........... F+G-1)
                        forced       generated tokens fed back
                        (template)   (the last one is never fed)

F = len(forced), G = tokens generated so far. `gen_len` = K/V entries written to the block
= the index the next decode step writes at. A template of F >= 2 tokens is fed in ONE extend
pass (a chunked prefill of the block: `pending_prompt`, `accept_extend`), whose last logits
give the first generated token; so every request takes N token steps, template or not.
RoPE positions continue from n_valid, so padding in the prefix costs no positions. n_valid is
per-slot prefix state and lives with the K/V in the runner's KVStore; a request is counters
and token ids only.
"""

from __future__ import annotations

import dataclasses
import enum


class FinishReason(enum.StrEnum):
    """Why a request ended; a str, so it prints, compares and serialises as its value."""

    EOS = 'eos'            # emitted the stop token
    LENGTH = 'length'      # generated its N tokens
    EVICTED = 'evicted'    # preempted: its slot was taken for the action path (tokens so far
    #                        are valid); admission plans so that this does not happen
    ERROR = 'error'        # a model call on its rows failed
    REFUSED = 'refused'    # never started (queue full, or the pool could not hold it to its end)

    @property
    def completed(self) -> bool:
        """True when the request produced its whole text (eos or length)."""
        return self in (FinishReason.EOS, FinishReason.LENGTH)


FINISH_REASONS = tuple(FinishReason)


@dataclasses.dataclass
class RequestState:
    """Mutable state of one language request; the scheduler owns it, the pool owns its slot."""

    request_id: int                 # unique, increasing in start order
    slot: int | None                # prefix slot it reads (None once released / refused)
    origin_frame: int               # frame whose prefix this request continues
    max_new_tokens: int             # N: stop with 'length' after this many generated tokens
    deadline: int = 0               # scheduler frame count by whose end it must be done (the
    #                                 pool's next frames need its slot; see engine/scheduler.py)
    eos_id: int | None = None       # stop with 'eos' after emitting this token (None: never)
    forced: list[int] = dataclasses.field(default_factory=list)   # prompt template ids to feed
    token_ids: list[int] = dataclasses.field(default_factory=list)  # generated so far
    gen_len: int = 0                # K/V entries written after the prefix
    finished: bool = False
    finish_reason: FinishReason | str = ''   # '' while running
    num_reported: int = 0           # tokens already handed out in deltas
    error: str = ''                 # exception text ('error') or refusal reason ('refused')
    block: int | None = None        # generation block its K/V go to (None: none held)
    task: str = 'narration'         # language task that started it
    priority: int = 0               # its task's priority (higher: admitted first, yields last)
    ticket: int | None = None       # the caller's id of an asked request (Scheduler.ask)

    @property
    def tokens_left(self) -> int:
        return 0 if self.finished else self.max_new_tokens - len(self.token_ids)

    @property
    def steps_left(self) -> int:
        """Token steps until done: one per token still to generate.

        The first token comes from one step whatever the template: the prefix's logits, the
        extend pass over the whole template (F >= 2), or the decode step feeding its one
        token; so a request takes N steps in all.
        """
        return self.tokens_left

    @property
    def pending_prompt(self) -> list[int]:
        """Template tokens an extend pass feeds next (empty: none, or one a decode step feeds)."""
        if self.finished or len(self.forced) - self.gen_len < 2:
            return []
        return self.forced[self.gen_len:]

    @property
    def kv_entries_needed(self) -> int:
        """Most K/V entries this request can write: forced + N - 1 (last token never fed)."""
        return len(self.forced) + max(self.max_new_tokens - 1, 0)

    @property
    def started(self) -> bool:
        """True once its first step (prefix token or extend pass) ran: decode steps feed it."""
        return not (self.needs_prefix_token or self.pending_prompt)

    @property
    def needs_prefix_token(self) -> bool:
        """True when the next token comes from the prefix logits, not from a decode step."""
        return not self.forced and not self.token_ids and not self.finished

    def age(self, frame_index: int) -> int:
        """Frames since this request started."""
        return frame_index - self.origin_frame

    def next_input_token(self) -> int:
        """Token to feed at the next decode step: a forced one, else the last generated one."""
        assert not self.finished and not self.needs_prefix_token, 'nothing to feed'
        if self.gen_len < len(self.forced):
            return self.forced[self.gen_len]
        return self.token_ids[-1]

    def accept_prefix_token(self, token_id: int) -> None:
        """Record the first token, argmax of the prefix logits (no K/V written)."""
        assert self.needs_prefix_token
        self._emit(token_id)

    def accept_extend(self, token_id: int) -> None:
        """Record an extend pass: the pending template's K/V written; `token_id` comes first."""
        assert self.pending_prompt, 'no template to extend'
        self.gen_len = len(self.forced)
        self._emit(token_id)

    def accept_decode_step(self, token_id: int) -> None:
        """Record one decode step: its input's K/V was written, `token_id` is argmax of logits.

        While forced tokens remain to be fed, the logits are not a generated token and
        `token_id` is ignored.
        """
        assert not self.finished
        self.gen_len += 1
        if self.gen_len >= len(self.forced):
            self._emit(token_id)

    def _emit(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))
        if self.eos_id is not None and token_id == self.eos_id:
            self.finish(FinishReason.EOS)
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason | str, error: str = '') -> None:
        """Mark finished; the scheduler releases the slot (the pool is not touched here)."""
        reason = FinishReason(reason)     # raises ValueError for an unknown reason
        if self.finished:
            return
        self.finished = True
        self.finish_reason = reason
        self.error = error

    def take_new_tokens(self) -> list[int]:
        """Return the generated tokens not reported yet, and mark them reported."""
        new = self.token_ids[self.num_reported:]
        self.num_reported = len(self.token_ids)
        return new
