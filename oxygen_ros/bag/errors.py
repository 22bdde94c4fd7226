"""The one exception the bag layer raises for bad input: it says where and what was expected."""

from __future__ import annotations


class BagError(Exception):
    """A bag or its contents cannot be used; the message names the topic and the expectation.

    topic: the offending topic ('' when the problem is the bag as a whole).
    """

    def __init__(self, message: str, topic: str = ''):
        super().__init__(message)
        self.topic = topic
