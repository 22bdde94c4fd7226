"""OutputProcessor: request states -> token deltas and finished requests, with their text."""

from __future__ import annotations

from oxygen_ros.engine.frontend import Frontend
from oxygen_ros.engine.types import FinishedRequest, TokenDelta
from oxygen_ros.kv import RequestState


class OutputProcessor:
    """Detokenizes what the scheduler's requests produced since they were last reported."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    def report(self, touched: list[RequestState], ended: list[RequestState],
               last_frame_index: int) -> tuple[list[TokenDelta], list[FinishedRequest]]:
        """Deltas of every touched request with news, and one record per ended request.

        touched: requests the frame worked on or ended, by id; ended: those that ended;
        last_frame_index: the newest frame, for the number of frames a request was alive.
        """
        deltas = []
        for req in touched:
            n_old = req.num_reported
            new = req.take_new_tokens()
            if not new and not req.finished:
                continue
            text = self.frontend.decode_delta(req.token_ids, n_old, final=req.finished)
            deltas.append(TokenDelta(req.request_id, req.origin_frame, new, text,
                                     len(req.token_ids), req.finished, req.finish_reason))
        finished = [FinishedRequest(req.request_id, req.origin_frame, list(req.token_ids),
                                    self.frontend.decode(req.token_ids), req.finish_reason,
                                    last_frame_index - req.origin_frame + 1, req.error)
                    for req in ended]
        return deltas, finished
