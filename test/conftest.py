"""Test-session setup: keep DDS on this machine, give each run its own domain."""

import importlib.metadata
import os

import pytest

# A hung test ends the run with its stack (test/hang_watchdog.py): its hooks, imported here.
from hang_watchdog import pytest_configure, pytest_runtest_protocol  # noqa: F401


def _rclpy_major_version():
    """Return rclpy's major version without importing it (None when unknown)."""
    try:
        return int(importlib.metadata.version('rclpy').split('.')[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


# Why at import time: these variables are read when rclpy creates its first context, and any
# test module may import rclpy. Without them Fast DDS multicasts discovery out of the
# machine's network interface (forbidden here) and parallel runs would see each other's topics.
# Subprocesses started by tests inherit them.
os.environ['ROS_AUTOMATIC_DISCOVERY_RANGE'] = 'LOCALHOST'
os.environ['ROS_STATIC_PEERS'] = ''
# OXYGEN_ROS_DOMAIN_ID pins the domain (e.g. two checkouts testing at once on one machine).
os.environ['ROS_DOMAIN_ID'] = (os.environ.get('OXYGEN_ROS_DOMAIN_ID')
                               or str(1 + os.getpid() % 100))
_rclpy_major = _rclpy_major_version()
if os.environ.get('ROS_DISTRO') == 'humble' or (_rclpy_major is not None and _rclpy_major < 4):
    # Humble (rclpy 3.x) predates ROS_AUTOMATIC_DISCOVERY_RANGE; newer distros warn on this one.
    os.environ['ROS_LOCALHOST_ONLY'] = '1'


def pytest_report_header(config):
    """Show the DDS settings of this run in pytest's header."""
    return 'ROS_DOMAIN_ID=%s ROS_AUTOMATIC_DISCOVERY_RANGE=%s' % (
        os.environ['ROS_DOMAIN_ID'], os.environ['ROS_AUTOMATIC_DISCOVERY_RANGE'])


@pytest.fixture
def rclpy_context():
    """Yield an initialised rclpy Context of its own; shut it down afterwards.

    rclpy is imported here, not at module level, so tests that do not touch ROS never load it.
    Uses only API that exists since rclpy 3 (Humble): no `with rclpy.init()`.
    """
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    try:
        yield context
    finally:
        if context.ok():
            rclpy.shutdown(context=context)


@pytest.fixture(scope='module')
def one_torch_thread():
    """Run a module's tiny models on one torch thread (more only add contention here)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
