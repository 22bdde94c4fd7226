"""A pytest plugin: a test that hangs ends the run with every thread's stack, in minutes.

The suite once stopped for good inside Fast DDS (destroy_participant waiting on its own
discovery thread, a deadlock in C): CI would have waited out its 90 minutes and said nothing.
faulthandler's watchdog is a C thread, so it fires even when the hang holds the GIL (a timer
in Python would never run). It is armed around each test's setup, call and teardown (module
fixtures' teardown included: it runs inside the last test's protocol).
"""

import faulthandler
import os

import pytest

# The longest test takes ~1 minute on a 2-core machine (more on a fresh one, compiling its
# passes without a cache); OXYGEN_TEST_TIMEOUT_S overrides.
TEST_TIMEOUT_S = float(os.environ.get('OXYGEN_TEST_TIMEOUT_S', '900'))

_stderr = None   # the terminal's stderr; inside a test fd 2 is pytest's capture file


def pytest_configure(config):
    """Keep a handle on the real stderr (capture is paused while plugins configure)."""
    global _stderr
    _stderr = os.fdopen(os.dup(2), 'w')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Arm the watchdog for one test: past TEST_TIMEOUT_S, print the stacks and exit."""
    if _stderr is not None:   # the stacks name the test (its frames are in them)
        faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
