"""Writing rosbag2 (MCAP by default) that keep what was written, whatever stops the writer.

rosbags' Writer used as a context manager *aborts* on an exception: the MCAP file is left
without its summary and index and the directory without metadata.yaml, so nothing written is
readable. OutputBag always closes properly instead, so an interrupted replay or recording
keeps every message written before it stopped.
"""

from __future__ import annotations

from pathlib import Path
import shutil
from typing import Any, Sequence

from rosbags.interfaces import (Connection, Qos, QosDurability, QosHistory, QosLiveliness,
                                QosReliability, QosTime)
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys.store import Typestore

from oxygen_ros.bag.errors import BagError
from oxygen_ros.bag.typestore import make_typestore

STORAGES = {'mcap': StoragePlugin.MCAP, 'sqlite3': StoragePlugin.SQLITE3}
# Format 8 keeps offered QoS as a YAML string with numeric enums, which Humble's ros2 bag
# reads too (format 9, Jazzy's default, stores a list that Humble does not understand);
# Jazzy and later read 8 as well.
ROSBAG2_VERSION = 8


def qos_profile(reliable: bool = True, transient_local: bool = False, depth: int = 10) -> Qos:
    """Make an offered QoS profile to store with a topic (`ros2 bag play` uses it)."""
    never = QosTime(0x7FFFFFFF, 0xFFFFFFFF)   # rmw's "infinite" duration
    return Qos(history=QosHistory.KEEP_LAST, depth=depth,
               reliability=QosReliability.RELIABLE if reliable else QosReliability.BEST_EFFORT,
               durability=(QosDurability.TRANSIENT_LOCAL if transient_local
                           else QosDurability.VOLATILE),
               deadline=never, lifespan=never, liveliness=QosLiveliness.AUTOMATIC,
               liveliness_lease_duration=never, avoid_ros_namespace_conventions=False)


class OutputBag:
    """A rosbag2 being written; close() always leaves a complete, readable bag.

    Connections are registered on first use, each with its message definition text and RIHS01
    hash (so custom types decode anywhere); metadata.yaml is written on close.
    """

    def __init__(self, path: str | Path, typestore: Typestore | None = None,
                 storage: str = 'mcap', overwrite: bool = False):
        self.path = Path(path)
        self.typestore = typestore or make_typestore()
        if storage not in STORAGES:
            raise BagError(f'storage {storage!r}; expected one of {sorted(STORAGES)}')
        self.storage = storage
        self.overwrite = overwrite
        self.counts: dict[str, int] = {}
        self._writer: Writer | None = None
        self._connections: dict[str, Connection] = {}
        self._custom: dict[str, str] = {}

    def __enter__(self) -> OutputBag:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return self._writer is not None

    def open(self) -> None:
        if self.path.exists():
            if not self.overwrite:
                raise BagError(f'output {self.path} exists; expected a new path (or --overwrite)')
            if not _written_by_oxygen_ros(self.path):
                raise BagError(f'output {self.path} exists and is not a bag oxygen-ros wrote '
                               '(no oxygen_ros entry in its metadata.yaml); not overwriting it')
            shutil.rmtree(self.path) if self.path.is_dir() else self.path.unlink()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        writer = Writer(self.path, version=ROSBAG2_VERSION,
                        storage_plugin=STORAGES[self.storage])
        try:
            writer.open()
        except Exception as err:   # noqa: BLE001 - permissions, races with another writer
            raise BagError(f'output {self.path}: cannot create: {err}') from None
        self._writer = writer

    def set_custom_data(self, key: str, value: Any) -> None:
        """Store a string in metadata.yaml's custom_data (written on close)."""
        self._custom[key] = str(value)

    def connection(self, topic: str, msgtype: str, msgdef: str | None = None,
                   rihs01: str | None = None, qos: Sequence[Qos] = ()) -> Connection:
        """Return the connection of `topic`, registered on first use (one type per topic).

        msgdef/rihs01: definition text and hash (default: from the typestore); qos: offered
        QoS profiles recorded for `ros2 bag play`.
        """
        conn = self._connections.get(topic)
        if conn is None:
            if self._writer is None:
                raise BagError(f'output {self.path}: not open')
            if msgdef is None:
                conn = self._writer.add_connection(topic, msgtype, typestore=self.typestore,
                                                   offered_qos_profiles=list(qos))
            else:
                conn = self._writer.add_connection(topic, msgtype, msgdef=msgdef, rihs01=rihs01,
                                                   offered_qos_profiles=list(qos))
            self._connections[topic] = conn
            self.counts[topic] = 0
        elif conn.msgtype != msgtype:
            raise BagError(f'output {self.path}: topic {topic} is {conn.msgtype}; cannot also '
                           f'write {msgtype}', topic)
        return conn

    def write(self, topic: str, msgtype: str, time_ns: int, message,
              qos: Sequence[Qos] = ()) -> None:
        """Serialize a message object of our typestore and write it at time_ns."""
        data = self.typestore.serialize_cdr(message, msgtype)
        self.write_raw(topic, msgtype, time_ns, data, qos=qos)

    def write_raw(self, topic: str, msgtype: str, time_ns: int, data: bytes,
                  msgdef: str | None = None, rihs01: str | None = None,
                  qos: Sequence[Qos] = ()) -> None:
        """Write already serialized CDR (copying a recording: the bytes stay as they were)."""
        conn = self.connection(topic, msgtype, msgdef, rihs01, qos)
        self._writer.write(conn, int(time_ns), data)
        self.counts[topic] += 1

    def close(self) -> None:
        """Write the index, summary and metadata.yaml; safe to call twice."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        for key, value in self._custom.items():
            writer.set_custom_data(key, value)
        writer.close()


def _written_by_oxygen_ros(path: Path) -> bool:
    """Whether `path` is a rosbag2 folder whose metadata says this package wrote it.

    Only such a folder may be removed by --overwrite: a bare .mcap file, or a folder that only
    looks like a bag (another tool's recording, a folder of recordings), is never deleted.
    """
    import yaml

    if not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    if 'metadata.yaml' not in names or not all(
            n == 'metadata.yaml' or n.endswith(('.mcap', '.db3', '.zstd')) for n in names):
        return False
    try:
        meta = yaml.safe_load((path / 'metadata.yaml').read_text())
        custom = meta['rosbag2_bagfile_information'].get('custom_data') or {}
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return False
    return any(str(key).startswith('oxygen_ros.') for key in custom)
