"""Real-time chunking measured: `bench --parts rtc` and `replay --rtc-compare` (no timing
thresholds: on a shared machine timings are noise; what is checked is what they report)."""

import csv

import pytest

from oxygen_ros.bag import load_params
from oxygen_ros.bag.synthetic import write_demo_bag
from oxygen_ros.cli import main

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'
MODES = ['off', 'guided', 'prefix']

pytestmark = pytest.mark.usefixtures('one_torch_thread')


def read_csv(path):
    with open(path, newline='') as f:
        return {row['mode']: row for row in csv.DictReader(f)}


def test_bench_rtc_part_reports_every_mode_on_the_same_frames(tmp_path):
    out = tmp_path / 'bench'
    assert main(['bench', '--quick', '--parts', 'rtc', '--out', str(out), '--no-progress',
                 '--threads', '1']) == 0
    rows = read_csv(out / 'rtc.csv')
    assert list(rows) == MODES
    off, guided, prefix = (rows[m] for m in MODES)
    assert {r['delay_rows'] for r in rows.values()} == {'1'}     # quick: d = 1 for every mode
    assert int(off['boundaries']) > 0 and off['boundaries'] == guided['boundaries']
    assert float(prefix['frozen_rows_max_diff']) == 0.0          # the frozen rows, exactly
    assert float(off['frozen_rows_max_diff']) > 0
    assert float(guided['gap_mean']) < float(off['gap_mean'])    # it continues the old chunk
    assert all(r['tokens_identical_to_off'] == 'True' for r in rows.values())
    # The default policy behaves like a trained one: smooth chunks that differ from one noise
    # to the next (random weights: row step ≈ jump), and guided makes the boundary smooth.
    assert off['policy'].startswith('smooth policy: preset small')
    assert float(off['row_step_mean']) < 0.5 * float(off['jump_mean'])
    assert float(guided['jump_mean']) < 0.6 * float(off['jump_mean'])
    summary = (out / 'summary.md').read_text()
    assert '## Real-time chunking' in summary and 'boundary jump guided' in summary
    assert 'Policy: smooth policy' in summary
    assert (out / 'rtc_boundaries.png').read_bytes().startswith(PNG_MAGIC)


def test_bench_rtc_policy_is_checked_before_anything_runs(tmp_path, capsys):
    out = tmp_path / 'bench'
    for bad, says in ((['--rtc-policy', str(tmp_path / 'nothing')], 'checkpoint folder'),
                      (['--rtc-policy-preset', 'huge'], 'expected one of'),
                      (['--rtc-max-guidance-weight', '500'], 'must be in')):
        with pytest.raises(SystemExit, match=says):
            main(['bench', '--quick', '--parts', 'rtc', '--out', str(out), *bad])
    assert not out.exists()


def test_replay_rtc_compare_on_a_recorded_bag(tmp_path, capsys):
    """The bag half, on the smooth policy's checkpoint (the quick bench's: cached)."""
    from oxygen_ros.bench.run import BenchOptions
    from oxygen_ros.bench.smooth_policy import smooth_policy, SmoothPolicyOptions

    quick = BenchOptions.quick_defaults().rtc
    checkpoint = smooth_policy(SmoothPolicyOptions(preset=quick.policy_preset,
                                                   steps=quick.policy_steps))
    params = load_params(None, {'robot': 'libero', 'preset': 'tiny'})
    bag = write_demo_bag(tmp_path / 'demo', params, 2.0, image_hw=(48, 64))
    out = tmp_path / 'compare'
    rc = main(['replay', str(bag), '--out', str(out), '--rtc-compare', '--checkpoint',
               str(checkpoint), '--rate', 'max', '--quiet', '--threads', '1', '--rtc-delay',
               '1', '--tokens', '4', '--k', '2'])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = read_csv(out / 'rtc.csv')
    assert list(rows) == MODES and 'jump mean' in printed
    for mode in MODES:
        assert (out / mode / 'metadata.yaml').is_file()         # each mode's output bag
    assert float(rows['prefix']['frozen_rows_max_diff']) == 0.0
    assert rows['off']['chunks'] == rows['guided']['chunks'] == rows['prefix']['chunks']
    assert float(rows['guided']['gap_mean']) < float(rows['off']['gap_mean'])
    assert float(rows['guided']['jump_mean']) < 0.6 * float(rows['off']['jump_mean'])
    assert (out / 'rtc_boundaries.png').read_bytes().startswith(PNG_MAGIC)
    assert main(['replay', str(bag), '--out', str(out), '--rtc-compare', '--preset',
                 'tiny']) == 2                                    # the output exists


def test_episode_timing_falls_back_when_nothing_would_overlap():
    from oxygen_ros.bench.rtc import episode_timing, RtcBenchOptions

    P, H = 0.05, 10
    # 140 ms: d = 2, a frame every 3 rows (max(0.1 s, 0.14 s)): 7 committed rows past d
    assert episode_timing(RtcBenchOptions(), 0.14, P, H) == (2, pytest.approx(0.15), 'measured')
    # 400 ms on a slow CPU: d = 7 and 8 rows per frame leave nothing: the assumed timing
    assert episode_timing(RtcBenchOptions(), 0.40, P, H) == (2, pytest.approx(0.15), 'assumed')
    given = RtcBenchOptions(delay=1, period_rows=2)
    assert episode_timing(given, 0.40, P, H) == (1, pytest.approx(0.10), 'given')
