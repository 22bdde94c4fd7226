"""The naive parallel baseline: two processes, same tokens and actions as isolated."""

import numpy as np

from oxygen_ros.bench.systems import make_system
from oxygen_ros.engine import LanguagePolicy, random_observation, random_setup, System
from oxygen_ros.model import get_preset

CFG = get_preset('tiny').replace(max_token_len=64)


def obs(frame):
    return random_observation('libero', frame, seed=1, image_size=CFG.vision.image_size,
                              instruction=('pick up the red block', 'push')[frame % 2])


def test_parallel_matches_isolated(tmp_path):
    model, frontend = random_setup(CFG, 'libero', seed=2, tokenizer_dir=tmp_path)
    policy = LanguagePolicy(max_new_tokens=5, eos_id=None)
    isolated = make_system('isolated', model, frontend, policy)
    reference = [isolated.step(obs(f)) for f in range(3)]
    addresses = {name: t.data_ptr() for name, t in model.state_dict().items()}
    with make_system('parallel', model, frontend, policy) as parallel:
        # The workers got copies: the model's weights stay where they were (their packed
        # copies are found by address; moved into shared memory, every other system of the
        # benchmark's process ran unpacked).
        assert {name: t.data_ptr() for name, t in model.state_dict().items()} == addresses
        assert isinstance(parallel, System) and isinstance(isolated, System)
        idle = parallel.advance_language()                   # no frame sent: an empty result
        assert idle.frame_index == -1 and not idle.deltas and parallel.num_live_requests == 0
        results = [parallel.step(obs(f)) for f in range(3)]
        procs = list(parallel._procs.values())
        assert all(p.is_alive() for p in procs)
    assert not any(p.is_alive() for p in procs)              # closed cleanly
    for got, want in zip(results, reference):
        assert got.frame_index == want.frame_index
        np.testing.assert_allclose(got.action.actions, want.action.actions, atol=1e-5, rtol=0)
        assert [f.token_ids for f in got.finished] == [f.token_ids for f in want.finished]
        assert [d.text for d in got.deltas] == [d.text for d in want.deltas]
        t = got.timings
        assert t.prefill_s > 0 and t.decode_s > 0 and 0 <= t.overhead_s < t.total_s
        assert got.kv_usage['slots_total'] == 1 + 2         # action: frame slot; language: 2


def test_parallel_workers_prepare_and_compile_as_the_parent(tmp_path):
    """A bf16 model compiled and packed by prepare_model (the benchmark's on a CPU with bf16):
    the workers prepare theirs with the same setting, the same passes compiled (warmed up on
    the parent's frames, from the compile cache it filled), so their tokens are the isolated
    system's. Eager workers beside a compiled parent rounded differently and once emitted
    other tokens in `oxygen-ros bench`."""
    import pytest
    import torch

    from oxygen_ros.engine.prepare import prepare_model
    from oxygen_ros.model.compiled import unavailable_reason
    from oxygen_ros.model.packed import packing_unavailable_reason

    why = packing_unavailable_reason('cpu', torch.bfloat16) or unavailable_reason('cpu')
    if why:
        pytest.skip(why)
    model, frontend = random_setup(CFG, 'libero', seed=3, tokenizer_dir=tmp_path,
                                   dtype=torch.bfloat16)
    plan = prepare_model(model, 'cpu', 'on')
    assert plan.any and model.packed
    policy = LanguagePolicy(max_new_tokens=5, eos_id=None)
    isolated = make_system('isolated', model, frontend, policy)
    reference = [isolated.step(obs(f)) for f in range(3)]
    options = {'compile_setting': 'on', 'warm_frames': [frontend.prepare(obs(0)).tensors]}
    with make_system('parallel', model, frontend, policy, parallel=options) as parallel:
        results = [parallel.step(obs(f)) for f in range(3)]
        prepared = plan.describe()   # passes compiled, weights packed (and where, how much)
        assert 'prepacked weights' in prepared
        assert parallel.worker_prepared == {'action': prepared, 'language': prepared}
    assert [[f.token_ids for f in r.finished] for r in results] == [
        [f.token_ids for f in r.finished] for r in reference]
    assert any(r.finished for r in reference)
    model.compile_prefill(None).compile_actions(None).compile_decode(None).compile_extend(None)
