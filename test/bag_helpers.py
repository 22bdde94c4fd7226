"""Reading a test's output bag (shared by the bag replay and dataset replay tests)."""

from pathlib import Path

from rosbags.highlevel import AnyReader


def read_bag(path):
    """Return (topic -> [(log time, message)], topic -> connection) of the bag at `path`.

    Messages are decoded with the definitions stored in the bag only.
    """
    messages = {}
    with AnyReader([Path(path)]) as reader:
        for conn, stamp, raw in reader.messages():
            messages.setdefault(conn.topic, []).append(
                (stamp, reader.deserialize(raw, conn.msgtype)))
        connections = {c.topic: c for c in reader.connections}
    return messages, connections
