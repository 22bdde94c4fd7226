"""The suite's watchdog (hang_watchdog.py): a test that hangs ends the run with its stack."""

import os
from pathlib import Path
import subprocess
import sys
import time

HUNG_TEST = '''
import ctypes


def test_hangs_in_c_holding_the_gil():
    ctypes.PyDLL(None).sleep(600)   # PyDLL keeps the GIL through the call, as a C hang may
'''


def test_a_test_hung_in_c_with_the_gil_ends_the_run_with_its_stack(tmp_path):
    (tmp_path / 'test_hung.py').write_text(HUNG_TEST)
    env = dict(os.environ, OXYGEN_TEST_TIMEOUT_S='2',
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                        os.environ.get('PYTHONPATH')])))
    start = time.monotonic()
    run = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'hang_watchdog',
                          '-p', 'no:cacheprovider', 'test_hung.py'], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert 'Timeout (0:00:02)!' in run.stderr, run.stderr[-2000:]
    assert 'test_hangs_in_c_holding_the_gil' in run.stderr   # the stack names the test
    assert time.monotonic() - start < 60
