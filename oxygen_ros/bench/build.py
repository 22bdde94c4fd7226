"""Peak resident memory of building a model and of loading its checkpoint, each in a fresh process.

Run as `python -m oxygen_ros.bench.build --what random|load ...`; prints one JSON line:
  weights_mb      bytes of the model's parameters in the target dtype (float32 islands kept)
  runtime_mb      resident memory after importing torch and the package, before the model
  peak_rss_mb     the process's resident high-water mark (VmHWM) after the step
  above_runtime_mb  peak_rss_mb - runtime_mb: what building / loading cost
  peak_over_weights above_runtime_mb / weights_mb (target: <= 1.3)
'random' builds the preset's random weights as `phases`, `bench` and the demo do
(random_setup). 'load' loads a checkpoint folder with load_pi05 (memory-mapped: the file's
pages count only where touched), then prepares it as configure does (engine/prepare.py: fuse
the projections, pack the bf16 linears; nothing compiles yet); the row reports the peak after
each. `write_checkpoint` writes a checkpoint of a preset's layout,
streamed tensor by tensor (zeros: the values do not matter to memory), so even pi05's 6.6 GB
never sit in memory.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from ..runtime.procfs import status_kb
from .memory import package_env, probe_main

SAFETENSORS_DTYPES = {'float32': 'F32', 'bfloat16': 'BF16'}
CHUNK_BYTES = 64 << 20


def write_checkpoint(path: Path, preset: str, dtype: str) -> int:
    """Write an openpi checkpoint folder of `preset`'s layout in `dtype`; return its bytes."""
    import torch

    from ..model import get_preset
    from ..model.checkpoint import (config_to_json, CONFIG_FILE, expected_layout, to_model_key,
                                    WEIGHTS_FILE)
    from ..model.pi05 import param_dtype

    config = get_preset(preset)
    layout = expected_layout(config)
    header, offset = {}, 0
    for key, shape in layout.items():
        stored = param_dtype(to_model_key(key), getattr(torch, dtype))
        nbytes = math.prod(shape) * stored.itemsize
        header[key] = {'dtype': SAFETENSORS_DTYPES[str(stored).removeprefix('torch.')],
                       'shape': list(shape), 'data_offsets': [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(',', ':')).encode()
    text += b' ' * (-len(text) % 8)   # the data starts 8-byte aligned
    path.mkdir(parents=True, exist_ok=True)
    zeros = bytes(CHUNK_BYTES)
    with open(path / WEIGHTS_FILE, 'wb') as f:
        f.write(struct.pack('<Q', len(text)) + text)
        left = offset
        while left:
            left -= f.write(zeros[:min(left, CHUNK_BYTES)])
    (path / CONFIG_FILE).write_text(json.dumps(config_to_json(config, dtype), indent=2))
    return offset


def _weights_mb(model) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def probe(args: argparse.Namespace) -> dict:
    """Build or load in this process; return the memory figures (MiB)."""
    import torch

    from ..engine import random_setup
    from ..engine.prepare import prepare_model
    from ..model import get_preset
    from ..model.checkpoint import load_pi05

    torch.set_num_threads(args.threads)
    torch.zeros(1) @ torch.zeros(1)   # lazy initialisation belongs to the runtime
    runtime_kb = status_kb('VmRSS')
    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    row = {'what': args.what, 'preset': args.preset, 'dtype': args.dtype}
    if args.what == 'random':
        model, _ = random_setup(get_preset(args.preset), 'libero', dtype=dtype)
    else:
        model = load_pi05(args.path, dtype=dtype).model
        row['load_peak_rss_mb'] = status_kb('VmHWM') / 1024
        prepare_model(model, 'cpu', 'auto')
    row['seconds'] = time.perf_counter() - start
    peak_kb = status_kb('VmHWM')
    weights_mb = _weights_mb(model)
    row.update(weights_mb=weights_mb, runtime_mb=runtime_kb / 1024, peak_rss_mb=peak_kb / 1024,
               above_runtime_mb=(peak_kb - runtime_kb) / 1024,
               peak_over_weights=(peak_kb - runtime_kb) / 1024 / weights_mb)
    if 'load_peak_rss_mb' in row:
        row['load_over_weights'] = (row['load_peak_rss_mb'] - row['runtime_mb']) / weights_mb
    return row


def _run(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, '-m', 'oxygen_ros.bench.build'] + args,
                          env=package_env(), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f'build probe {args} failed:\n{done.stderr[-3000:]}')
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_build_part(preset: str, dtype: str, progress: bool = True) -> list[dict]:
    """Peak RSS of building random weights and of loading a checkpoint of `preset`.

    The checkpoint is written to a temporary folder (pi05: 6.6 GB in bfloat16) and removed.
    """
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (
        lambda line: None)
    say(f'build: random {preset} weights in {dtype} (fresh process)')
    rows = [_run(['--what', 'random', '--preset', preset, '--dtype', dtype])]
    folder = Path(tempfile.mkdtemp(prefix='oxygen_ros_build_'))
    try:
        say(f'build: writing a {preset} checkpoint to {folder}')
        size = write_checkpoint(folder, preset, dtype)
        say(f'build: loading it ({size / 2**30:.1f} GiB, fresh process)')
        row = _run(['--what', 'load', '--preset', preset, '--dtype', dtype,
                    '--path', str(folder)])
        row['checkpoint_mb'] = size / 2**20
        rows.append(row)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--what', choices=['random', 'load'], required=True)
    parser.add_argument('--preset', default='pi05')
    parser.add_argument('--dtype', default='bfloat16', choices=sorted(SAFETENSORS_DTYPES))
    parser.add_argument('--path', default='', help="checkpoint folder ('load')")
    parser.add_argument('--threads', type=int, default=2)
    return parser


def main(argv: list[str] | None = None) -> int:
    return probe_main(probe, build_parser(), argv)


if __name__ == '__main__':
    sys.exit(main())
