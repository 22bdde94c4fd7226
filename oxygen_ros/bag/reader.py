"""Reading rosbag2 recordings (sqlite3 or MCAP) with rosbags, every failure a BagError."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable, Iterator

from rosbags.highlevel import AnyReader
from rosbags.interfaces import Connection
from rosbags.typesys.store import Typestore

from oxygen_ros.bag.errors import BagError
from oxygen_ros.bag.typestore import make_typestore

_HINT = ('; expected a complete rosbag2 directory (sqlite3 or MCAP). A recording that was '
         'killed may lack its index: try `ros2 bag reindex` (sqlite3) or `mcap recover` (MCAP)')


@dataclasses.dataclass(frozen=True)
class TopicSpec:
    """A topic the replay needs: the message types it accepts and what it is for."""

    topic: str
    types: tuple[str, ...]
    role: str                  # e.g. "camera 'image'", for error messages
    required: bool = True


class InputBag:
    """An open rosbag2 recording; use as a context manager.

    Definitions embedded in the bag win; types it does not define come from our typestore
    (old sqlite3 bags carry none).
    """

    def __init__(self, path: str | Path, typestore: Typestore | None = None):
        self.path = Path(path)
        self.default_types = typestore or make_typestore()
        self._reader: AnyReader | None = None

    def __enter__(self) -> InputBag:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        if not self.path.exists():
            raise BagError(f'bag {self.path}: no such file or directory; expected a rosbag2 '
                           'directory or an .mcap file')
        target = self.path
        if target.is_dir() and not (target / 'metadata.yaml').is_file():
            # A directory without metadata.yaml but with one MCAP file: MCAP is self-describing.
            mcaps = sorted(target.glob('*.mcap'))
            if len(mcaps) != 1:
                raise BagError(f'bag {self.path}: no metadata.yaml' + _HINT)
            target = mcaps[0]
        try:
            reader = AnyReader([target], default_typestore=self.default_types)
            reader.open()
        except BagError:
            raise
        except Exception as err:   # noqa: BLE001 - rosbags raises many kinds for bad files
            raise BagError(f'bag {self.path}: cannot open ({_reason(err)})' + _HINT) from None
        self._reader = reader
        if not reader.is2:
            self.close()
            raise BagError(f'bag {self.path}: a ROS 1 bag; expected a rosbag2 (sqlite3 or MCAP)')
        # Types the bag does not define (connections without definitions) come from ours.
        missing = {c.msgtype for c in reader.connections} - set(reader.typestore.fielddefs)
        known = {t: self.default_types.fielddefs[t] for t in missing
                 if t in self.default_types.fielddefs}
        if known:
            reader.typestore.register(known)

    def close(self) -> None:
        if self._reader is not None:
            reader, self._reader = self._reader, None
            reader.close()

    @property
    def reader(self) -> AnyReader:
        if self._reader is None:
            raise BagError(f'bag {self.path}: not open')
        return self._reader

    @property
    def start_ns(self) -> int:
        return self.reader.start_time

    @property
    def end_ns(self) -> int:
        """Timestamp of the last message (rosbags' end_time is one past it)."""
        return max(self.reader.end_time - 1, self.reader.start_time)

    @property
    def topics(self) -> dict[str, str]:
        """Topic -> message type (types joined with ' | ' when a topic has several)."""
        types: dict[str, set] = {}
        for conn in self.reader.connections:
            types.setdefault(conn.topic, set()).add(conn.msgtype)
        return {t: ' | '.join(sorted(v)) for t, v in sorted(types.items())}

    def message_count(self, topic: str) -> int:
        return sum(c.msgcount for c in self.reader.connections if c.topic == topic)

    def connections(self, spec: TopicSpec) -> list[Connection]:
        """Return the connections of spec.topic (BagError when missing or of another type)."""
        conns = [c for c in self.reader.connections if c.topic == spec.topic]
        expected = ' or '.join(spec.types)
        if not conns:
            if not spec.required:
                return []
            have = ', '.join(f'{t} ({m})' for t, m in self.topics.items()) or 'none'
            raise BagError(f'bag {self.path}: topic {spec.topic} ({spec.role}) missing; expected '
                           f'{expected} messages there. Topics in the bag: {have}', spec.topic)
        for conn in conns:
            if conn.msgtype not in spec.types:
                raise BagError(f'{spec.topic} ({spec.role}): message type {conn.msgtype}; '
                               f'expected {expected}', spec.topic)
            if conn.msgtype not in self.reader.typestore.fielddefs:
                raise BagError(f'{spec.topic}: no definition of message type {conn.msgtype} in '
                               'the bag or in the standard ROS 2 types', spec.topic)
        return conns

    def messages(self, connections: Iterable[Connection]
                 ) -> Iterator[tuple[Connection, int, bytes]]:
        """Yield (connection, log time ns, raw CDR) in time order; errors become BagError."""
        connections = list(connections)
        iterator = self.reader.messages(connections=connections) if connections else iter(())
        while True:
            try:
                item = next(iterator)
            except StopIteration:
                return
            except Exception as err:   # noqa: BLE001 - truncated chunks, bad compression, ...
                raise BagError(f'bag {self.path}: read failed mid-way ({_reason(err)})'
                               + _HINT) from None
            yield item

    def deserialize(self, raw: bytes, conn: Connection):
        """Decode one message (BagError naming the topic when the bytes do not match the type)."""
        try:
            return self.reader.typestore.deserialize_cdr(raw, conn.msgtype)
        except Exception as err:   # noqa: BLE001 - serde raises several kinds
            raise BagError(f'{conn.topic}: cannot decode a {conn.msgtype} message '
                           f'({_reason(err)}); expected valid CDR of that type', conn.topic
                           ) from None

    def definition(self, conn: Connection) -> tuple[str, str]:
        """Return (definition text, RIHS01 hash) of a connection's type, for copying it."""
        if conn.msgdef.data and conn.digest:
            return conn.msgdef.data, conn.digest
        store = self.reader.typestore
        try:
            return (store.generate_msgdef(conn.msgtype, ros_version=2)[0],
                    conn.digest or store.hash_rihs01(conn.msgtype))
        except Exception:   # noqa: BLE001 - unknown type (KeyError deep in rosbags)
            raise BagError(f'{conn.topic}: message type {conn.msgtype} has no definition in the '
                           'bag or in the standard ROS 2 types; expected a known type to copy '
                           'it (replay with copy=inputs to leave it out)', conn.topic) from None


def _reason(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text if len(text) < 300 else text[:300] + '...'
