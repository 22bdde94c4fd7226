"""FairQueue: requests of several clients, taken round robin (one client cannot starve another)."""

from __future__ import annotations

import collections
import threading
from typing import Any


class FairQueue:
    """Per-client FIFO queues served in turn; bounded per client; thread-safe.

    put() refuses (returns False) when the client already has max_per_client waiting. get()
    takes the oldest request of the next client in turn, so with clients A (five waiting) and B
    (one waiting) B is served second, not sixth.
    """

    def __init__(self, max_per_client: int):
        if max_per_client < 1:
            raise ValueError(f'max_per_client {max_per_client}; expected >= 1')
        self.max_per_client = max_per_client
        self._cond = threading.Condition()
        self._waiting: dict[int, collections.deque] = {}     # client -> its requests
        self._turns: collections.deque[int] = collections.deque()   # clients with requests
        self._closed = False

    def put(self, client: int, item: Any) -> bool:
        """Queue `item` for `client`; False when that client's queue is full or closed."""
        with self._cond:
            if self._closed:
                return False
            waiting = self._waiting.setdefault(client, collections.deque())
            if len(waiting) >= self.max_per_client:
                return False
            if not waiting:
                self._turns.append(client)
            waiting.append(item)
            self._cond.notify()
            return True

    def get(self, timeout_s: float | None = None) -> Any | None:
        """Take the next item in turn; None when closed (or nothing came within timeout_s)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._turns or self._closed, timeout_s):
                return None
            if self._closed:
                return None
            client = self._turns.popleft()
            waiting = self._waiting[client]
            item = waiting.popleft()
            if waiting:
                self._turns.append(client)             # back of the line for its next one
            else:
                del self._waiting[client]
            return item

    def drop(self, client: int) -> list:
        """Remove and return everything `client` has waiting."""
        with self._cond:
            items = list(self._waiting.pop(client, ()))
            if items:
                self._turns.remove(client)
            return items

    def close(self) -> None:
        """Wake get() with None from now on; put() refuses."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return sum(len(w) for w in self._waiting.values())
