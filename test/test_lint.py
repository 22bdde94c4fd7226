"""ament-style lint: flake8 with ament_flake8's configuration, pep257 docstrings.

Both read their settings from setup.cfg ([flake8], [pydocstyle]), the same ones `make lint`
uses, so an editor, `make lint` and this test agree.
"""

from pathlib import Path
import subprocess
import sys

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / 'setup.cfg'
FLAKE8_PATHS = ['oxygen_ros', 'launch', 'test', 'setup.py']
PEP257_PATHS = ['oxygen_ros']


def run_tool(args):
    """Run a lint tool of this interpreter in the repository root; return (rc, output)."""
    result = subprocess.run([sys.executable, '-m'] + args, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return result.returncode, result.stdout


@pytest.mark.linter
def test_flake8():
    paths = [p for p in FLAKE8_PATHS if (REPO_ROOT / p).exists()]
    rc, output = run_tool(['flake8', '--config', str(CONFIG)] + paths)
    assert rc == 0, 'flake8 (ament configuration) found problems:\n' + output


@pytest.mark.linter
def test_pep257():
    rc, output = run_tool(['pydocstyle', '--config', str(CONFIG)] + PEP257_PATHS)
    assert rc == 0, 'pydocstyle (pep257 + ament ignores) found problems:\n' + output


def test_flake8_config_is_ament_config():
    # guard against someone loosening the shared configuration to make the test pass
    import configparser

    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    assert parser.getint('flake8', 'max-line-length') == 99
    ignored = set(parser.get('flake8', 'extend-ignore').replace('\n', '').split(','))
    ament_ignored = {'B902', 'C816', 'D100', 'D101', 'D102', 'D103', 'D104', 'D105', 'D106',
                     'D107', 'D203', 'D212', 'D404', 'I202'}
    assert ignored == ament_ignored
    assert not parser.has_option('flake8', 'ignore'), 'use extend-ignore, keep the defaults'
    assert parser.get('pydocstyle', 'convention') == 'pep257'
