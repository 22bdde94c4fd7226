"""OutputProcessor: request states -> token deltas and finished requests, with their text."""

from __future__ import annotations

from oxygen_ros.engine.frontend import Frontend
from oxygen_ros.engine.types import FinishedRequest, TokenDelta
from oxygen_ros.kv import RequestState


class OutputProcessor:
    """Detokenizes what the scheduler's requests produced since they were last reported."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        # request id -> the text shown so far (stable: no half characters), so each step
        # decodes a request's ids once, not once for the old text and once for the new
        self._shown: dict[int, str] = {}

    def report(self, touched: list[RequestState], ended: list[RequestState],
               last_frame_index: int) -> tuple[list[TokenDelta], list[FinishedRequest]]:
        """Deltas of every touched request with news, and one record per ended request.

        touched: requests the frame worked on or ended, by id; ended: those that ended;
        last_frame_index: the newest frame, for the number of frames a request was alive.
        """
        deltas = []
        final_text = {}
        for req in touched:
            new = req.take_new_tokens()
            if not new and not req.finished:
                continue
            shown = self._shown.get(req.request_id, '')
            text, now_shown = self.frontend.next_delta(req.token_ids, shown, final=req.finished)
            if req.finished:
                self._shown.pop(req.request_id, None)
                final_text[req.request_id] = now_shown     # == decode(token_ids)
            else:
                self._shown[req.request_id] = now_shown
            deltas.append(TokenDelta(req.request_id, req.origin_frame, new, text,
                                     len(req.token_ids), req.finished, req.finish_reason,
                                     req.task))
        finished = []
        for req in ended:
            self._shown.pop(req.request_id, None)
            finished.append(self.finished(req, last_frame_index, final_text.get(req.request_id)))
        return deltas, finished

    def finished(self, req: RequestState, last_frame_index: int,
                 text: str | None = None) -> FinishedRequest:
        """Return the record of an ended request (text: its decoded ids, when known already)."""
        return FinishedRequest(
            req.request_id, req.origin_frame, list(req.token_ids),
            text if text is not None else self.frontend.decode(req.token_ids),
            req.finish_reason, last_frame_index - req.origin_frame + 1, req.error, req.task,
            req.ticket)
