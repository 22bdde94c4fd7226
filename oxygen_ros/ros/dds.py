"""The process around oxygen_node: DDS discovery, the I/O executor, spin, fast exit.

Discovery stays on this machine unless the environment says otherwise; the executor serves
I/O only (ros/node.py says why); run_node spins until Ctrl-C and ends the process at once.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
import sys
import time
import traceback
from typing import Callable

import rclpy
from rclpy.executors import SingleThreadedExecutor

try:
    from rclpy.executors import ExternalShutdownException
except ImportError:   # pragma: no cover - older rclpy raise KeyboardInterrupt only
    ExternalShutdownException = KeyboardInterrupt


def make_executor(context=None) -> SingleThreadedExecutor:
    """Return the executor oxygen_node runs in: single-threaded, I/O only (ros/node.py)."""
    return SingleThreadedExecutor(context=context)


DISCOVERY_VARIABLES = ('ROS_AUTOMATIC_DISCOVERY_RANGE', 'ROS_LOCALHOST_ONLY', 'ROS_STATIC_PEERS')


def default_discovery_to_localhost(environ=os.environ) -> str:
    """Keep DDS discovery on this machine unless the environment chose otherwise.

    ROS's own default is the whole subnet (domain 0): any peer there could replace the task,
    feed cameras or reconfigure the node. A robot that must be reached from other machines
    says so with ROS_AUTOMATIC_DISCOVERY_RANGE=SUBNET (docs/node.md, "DDS and security"). Returns
    what was decided, for the startup log. Must run before rclpy.init().
    """
    chosen = {k: environ[k] for k in DISCOVERY_VARIABLES if environ.get(k)}
    if chosen:
        return ', '.join(f'{k}={v}' for k, v in chosen.items()) + ' (from the environment)'
    if environ.get('ROS_DISTRO') == 'humble':   # predates ROS_AUTOMATIC_DISCOVERY_RANGE
        environ['ROS_LOCALHOST_ONLY'] = '1'
        return 'ROS_LOCALHOST_ONLY=1 (oxygen_node default)'
    environ['ROS_AUTOMATIC_DISCOVERY_RANGE'] = 'LOCALHOST'
    return 'ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (oxygen_node default)'


SHM_DIR = Path('/dev/shm')


def owned_segments(pid: int | None = None, shm_dir: Path = SHM_DIR) -> list[Path]:
    """List the Fast DDS segments process `pid` (default this one) owns, `_el` files too.

    The owner holds a file lock on a segment's `_el` file (/proc/locks). Port segments, which
    every participant of the domain shares, are never counted. [] without /proc/locks.
    """
    pid = os.getpid() if pid is None else pid
    try:
        locks = Path('/proc/locks').read_text().splitlines()
        owned = {fields[5].rsplit(':', 1)[-1] for fields in map(str.split, locks)
                 if len(fields) > 5 and fields[4] == str(pid)}
        candidates = [p for p in shm_dir.glob('fastdds_*_el') if 'port' not in p.name]
        return [path for lock in candidates if str(lock.stat().st_ino) in owned
                for path in (lock.with_name(lock.name[:-len('_el')]), lock)]
    except OSError:
        return []


def release_shared_memory(pid: int | None = None, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the Fast DDS shared-memory segment this process owns; return the names removed.

    Fast DDS removes a participant's segment (/dev/shm/fastdds_<id>, ~0.5 MB, more under a
    camera profile) in C++ teardown, which a fast exit (os._exit) skips: every restart left
    one behind. Only the owner's (owned_segments) go, never another process's segment this
    one mapped to read. Call once the ROS context is destroyed.
    """
    removed = []
    for path in owned_segments(pid, shm_dir):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            continue
        removed.append(path.name)
    return removed


def _shutting_down(grace_s: float = 1.0) -> bool:
    """Whether the ROS context is going down (Ctrl-C), waiting up to grace_s for it.

    rclpy shuts the context down from its own signal thread, so the executor can raise (a take
    or a wait on a context being invalidated) a moment before rclpy.ok() turns False. An
    error that is not followed by a shutdown is a real one.
    """
    deadline = time.monotonic() + grace_s
    try:
        while rclpy.ok():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
    except KeyboardInterrupt:
        pass
    return True


def _tear_down(node, executor) -> int:
    """Destroy the node, the executor and the ROS context; return 1 if a step failed, else 0.

    Every step runs even when one before it failed, so the fast exit after it still finds the
    context destroyed and the segment its own; a failure is printed with its traceback.
    """
    steps = (('destroy the node', lambda: node is not None and node.destroy_node()),
             ('shut the executor down', executor.shutdown),
             ('shut rclpy down', lambda: rclpy.ok() and rclpy.shutdown()),
             # leave the DDS graph now (rclpy 4+ has Context.destroy)
             ('destroy the context', lambda: getattr(rclpy.get_default_context(), 'destroy',
                                                     lambda: None)()))
    code = 0
    for what, step in steps:
        try:
            step()
        except KeyboardInterrupt:
            return code   # a second Ctrl-C: the user wants out now
        except Exception:   # noqa: BLE001 - reported; the next steps still run
            code = 1
            print(f'oxygen_node: failed to {what} on the way out:', file=sys.stderr)
            traceback.print_exc()
    return code


def run_node(make_node: Callable[[], object], args=None, *, fast_exit: bool = True) -> int:
    """Spin the node make_node() builds in the I/O executor until Ctrl-C; return the exit code.

    Discovery defaults to this machine (default_discovery_to_localhost), before rclpy.init().
    fast_exit: once the node and the ROS context are released, end the process at once. The
    interpreter's own teardown of torch takes over a second (measured 1.2 s here) and has
    nothing left to release but this process's Fast DDS segment (release_shared_memory);
    without it Ctrl-C ends the node well within a second.
    """
    discovery = default_discovery_to_localhost()
    rclpy.init(args=args)
    node = None
    code = 0
    executor = make_executor()
    try:
        node = make_node()
        node.get_logger().info(f'DDS discovery: {discovery}, ROS_DOMAIN_ID='
                               f'{os.environ.get("ROS_DOMAIN_ID", "0 (default)")}')
        executor.add_node(node)
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except Exception:   # noqa: BLE001 - decided below
        if not _shutting_down():
            code = 1
            print('oxygen_node: stopped by an error:', file=sys.stderr)
            traceback.print_exc()
    finally:
        code = max(code, _tear_down(node, executor))
    if fast_exit:
        release_shared_memory()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
