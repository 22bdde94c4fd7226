"""Backbone linears on oneDNN-prepacked weights (model/packed.py): same results, never stale.

Packing is for bfloat16 on the CPU; these tests build bf16 models of the tiny preset. The
speed is the benchmark's (`oxygen-ros phases`); here: packed == plain passes, the compiled
step with the packed op == eager, no graph break, and a weight that changed after packing
(or a view at the same address) never meets a stale copy.
"""

import contextlib
import logging
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from oxygen_ros.engine import (FixedBudget, LanguagePolicy, make_engine, random_observation,
                               random_setup)
from oxygen_ros.engine import prepare
from oxygen_ros.engine.hardware import cpu_flags
from oxygen_ros.model import get_preset, KVTensors
from oxygen_ros.model import packed_native
from oxygen_ros.model.compiled import cxx_compiler, use_persistent_cache
from oxygen_ros.model.packed import (linear, PACKED, packing_unavailable_reason, plain_linear,
                                     use_native_kernel)
from oxygen_ros.model.pi05 import greedy_ids

TINY = get_preset('tiny')
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _needs_bf16_onednn():
    reason = packing_unavailable_reason('cpu', BF16)
    if reason:   # prepare does not pack there (test_prepare_packs_... checks the rule)
        pytest.skip(reason)


def bf16_model(pack: bool, seed: int = 2):
    model, frontend = random_setup(TINY, 'libero', seed=seed, dtype=BF16)
    model.fuse()
    if pack:
        model.pack_linears()
    return model, frontend


def inputs(frontend, frame: int = 0):
    obs = random_observation('libero', frame, seed=5, image_size=TINY.vision.image_size,
                             instruction='pick up')
    t = frontend.prepare(obs).tensors
    return t['images'], t['image_masks'], t['tokens'], t['token_masks']


@torch.no_grad()
def test_packed_backbone_passes_equal_plain():
    """Prefill K/V, teacher-forced decode logits and an extend pass: packed == plain.

    The same oneDNN kernels run on the blocked weight (bit-identical where measured); the
    tolerance is bf16's, for a CPU whose kernels block differently.
    """
    packed, frontend = bf16_model(True)
    plain, _ = bf16_model(False)
    assert packed.packed and not plain.packed
    stale = PACKED.stale_calls
    outputs = []
    for model in (packed, plain):
        kv = KVTensors.allocate(TINY, 2, TINY.prefix_len + 8, BF16)
        prefix = model.prefill(*inputs(frontend), kv=kv, slots=torch.tensor([1]))
        logits = []
        for j, token in enumerate([7, 9, 11, 3]):
            logits.append(model.decode_step(kv, prefix.slots, prefix.valid, prefix.n_valid,
                                            torch.tensor([j]), torch.tensor([token])))
        gen = KVTensors.allocate(TINY, 1, 9, BF16)
        extended = model.extend_step(kv, prefix.slots, prefix.valid, prefix.n_valid,
                                     torch.tensor([0]), torch.tensor([[5, 6, 8]]),
                                     torch.tensor([3]), attend_len=8, gen=gen,
                                     blocks=torch.tensor([0]))
        outputs.append((kv.k.clone(), torch.stack(logits), extended, gen.k.clone()))
    for got, want in zip(*outputs):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert PACKED.stale_calls == stale   # every packed call found its copy


@torch.no_grad()
def test_packed_engine_keeps_token_identity():
    """oxygen == isolated token for token on a packed bf16 model (the engines' claim)."""
    model, frontend = bf16_model(True, seed=4)
    tokens = {}
    for mode in ('oxygen', 'isolated'):
        engine = make_engine(mode, model, frontend, LanguagePolicy(max_new_tokens=4, eos_id=None),
                             FixedBudget(2))
        finished = {}
        for frame in range(3):
            obs = random_observation('libero', frame, seed=6, image_size=TINY.vision.image_size,
                                     instruction='open it')
            result = engine.step(obs)
            finished.update((f.origin_frame, f.token_ids) for f in result.finished)
        while engine.num_live_requests:
            engine.advance_language()
            finished.update((f.origin_frame, f.token_ids) for f in engine.last_result.finished)
        tokens[mode] = finished
    assert tokens['oxygen'] and tokens['oxygen'] == tokens['isolated']


def native_kernel():
    """Build (once per machine, cached) and load the op's C++ kernel, as prepare does."""
    if cxx_compiler() is None:
        pytest.skip('no C++ compiler: prepare keeps the Python kernel (and runs eager)')
    assert use_native_kernel(use_persistent_cache()) is None
    return torch.ops.oxygen_packed_native


@pytest.mark.parametrize('native', [False, True])
@torch.no_grad()
def test_compiled_packed_decode_equals_eager_without_graph_breaks(native, monkeypatch):
    """The decode step calls the packed op inside one graph (no break), its C++ kernel where
    it is built, and, compiled by inductor with cpp_wrapper (the node's settings), gives
    eager's logits."""
    if native:
        native_kernel()
    else:   # the Python kernel, as where no compiler builds the C++ one
        monkeypatch.setattr(packed_native, 'loaded', lambda: False)
    model, frontend = bf16_model(True, seed=3)
    kv = KVTensors.allocate(TINY, 2, TINY.prefix_len + 8, BF16)
    prefix = model.prefill(*inputs(frontend), kv=kv, slots=torch.tensor([0]))
    cos, sin = model.rope_tables(kv.max_len, 'cpu')
    args = (kv.k, kv.v, kv.k, kv.v, cos, sin, prefix.slots, prefix.slots, prefix.valid,
            prefix.n_valid, torch.tensor([0]), torch.tensor([9]), 8, TINY.prefix_len)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model._decode_layers)(*args)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    code = explanation.graphs[0].code
    assert ('oxygen_packed_native.linear' in code) is native
    assert ('row_argmax' in code) == packed_native.ready('row_argmax')   # the greedy ids
    assert ('oxygen_packed.linear' in code) is not native
    eager = model._decode_layers(*args)
    _, config = prepare.compile_settings('cpu')
    model.compile_decode('default', None, config)
    stale = PACKED.stale_calls
    try:
        compiled = model._decode_fn(*args)   # rewrites the same K/V entry
    finally:
        model.compile_decode(None)
        torch._dynamo.reset()
    assert not model._decode_fn
    assert PACKED.stale_calls == stale
    torch.testing.assert_close(compiled[0].float(), eager[0].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(compiled[1], compiled[0].argmax(-1)), 'the greedy ids are the logits\''


@contextlib.contextmanager
def small_rows(ops, on: bool):
    """Run the C++ kernel's few-row products on its own kernel (on) or oneDNN's (off)."""
    before = ops.use_small_rows(on)
    try:
        yield
    finally:
        ops.use_small_rows(before)


def cpu_has_avx512_bf16() -> bool:
    return {'avx512f', 'avx512_bf16'} <= set(cpu_flags())


def cpu_has_amx_bf16() -> bool:
    return cpu_has_avx512_bf16() and 'amx_bf16' in cpu_flags()


@torch.no_grad()
def test_native_kernel_equals_python_and_never_uses_a_stale_copy():
    """The C++ kernel keeps the Python registry's contract: the same products (the same
    oneDNN call, its few-row kernel off), F.linear for a weight written since packing
    (counted), no match for a view at the packed address, and a dead weight's entry
    dropped."""
    ops = native_kernel()
    for rows, k, n in ((1, 32, 64), (10, 48, 96), (3, 64, 16), (40, 64, 32)):
        weight = torch.randn(n, k, dtype=BF16)
        PACKED.pack(weight)
        x = torch.randn(2, rows, k, dtype=BF16)
        with small_rows(ops, False):
            assert torch.equal(ops.linear(x, weight),
                               torch.ops.oxygen_packed.linear(x, weight))
        torch.testing.assert_close(ops.linear(x, weight), F.linear(x, weight), atol=2e-2,
                                   rtol=2e-2)
    stale = PACKED.stale_calls
    weight.add_(1)   # its version moves: the packed copy is stale
    assert torch.equal(ops.linear(x, weight), F.linear(x, weight))
    assert PACKED.stale_calls == stale + 1
    fused = torch.randn(48, 64, dtype=BF16)
    PACKED.pack(fused)
    rows = fused[:16]   # starts at the packed address: another matrix
    assert torch.equal(ops.linear(x, rows), F.linear(x, rows))
    assert PACKED.stale_calls == stale + 2
    entries = ops.entries()
    del fused, rows
    assert ops.entries() == entries - 1


def test_a_weight_dying_while_the_registry_is_busy_is_forgotten_without_a_deadlock():
    """A dead weight's finalizer can run inside a call `PACKED` makes under its lock (the
    garbage collector runs on any allocation; it once hung prepare inside the C++ kernel's
    `remember`): it must not wait for that lock, and it forgets only its own entry."""
    keep = torch.randn(32, 16, dtype=BF16)
    PACKED.pack(keep)
    done = []

    def inside_a_registry_call():
        with PACKED._lock:
            doomed = torch.randn(48, 16, dtype=BF16)
            PACKED.pack(doomed)
            del doomed             # its finalizer runs here, on this thread, under the lock
            done.append(True)

    thread = threading.Thread(target=inside_a_registry_call, daemon=True)
    thread.start()
    thread.join(30)
    assert done, 'the finalizer waited for the lock its own thread held'
    assert PACKED.lookup(keep) is not None


def test_the_few_row_kernel_is_offered_where_the_cpu_has_avx512_bf16_on_amx_where_it_has_amx():
    assert native_kernel().small_rows_available() == cpu_has_avx512_bf16()
    assert native_kernel().small_rows_on_amx() == cpu_has_amx_bf16()


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason='no AVX512-BF16: oneDNN serves every row '
                    'count (test_the_few_row_kernel_is_offered_... checks the rule)')
@torch.no_grad()
def test_few_row_kernel_rounds_like_onednn_and_keeps_rows_batch_invariant():
    """The few-row kernel: it runs (counted), each result within one bfloat16 step of the
    float32 product (as oneDNN's; on the AMX Xeon measured they were equal), an output width
    that is no multiple of 16 and a K of one pair handled, and each row of a batch equal bit
    for bit to that row alone (the order of its sums does not depend on the batch). With AMX,
    K = 128 and 64 run on its tiles, K = 66 and 2 (no whole tile) on vdpbf16ps."""
    ops = native_kernel()
    # 8 rows: all in its range (8 x 1024 x 128, a denoise step's gate/up, past 2^20 products:
    # on AMX tiles there, in vdpbf16ps without AMX, where oneDNN's few rows are slower)
    for n, k in ((320, 128), (100, 66), (7, 2), (1000, 64), (1024, 128)):
        weight = torch.randn(n, k, dtype=BF16)
        PACKED.pack(weight)
        x = torch.randn(8, k, dtype=BF16)
        want = x.float() @ weight.float().t()
        step = want.abs() * 2.0 ** -7 + 1e-6          # one bf16 step (8 significant bits)
        calls = ops.small_row_calls()
        got = ops.linear(x, weight)
        assert ops.small_row_calls() == calls + 1, 'the few-row kernel did not run'
        with small_rows(ops, False):
            onednn = ops.linear(x, weight)
        assert ops.small_row_calls() == calls + 1
        for result in (got, onednn):
            assert ((result.float() - want).abs() <= step).all(), (n, k)
        rows_alone = torch.cat([ops.linear(x[i:i + 1], weight) for i in range(8)])
        assert torch.equal(got, rows_alone), (n, k)
        # any leading dims and strides: the rows read by pointer (a strided x copied first)
        assert torch.equal(ops.linear(x.view(2, 4, k), weight), got.view(2, 4, n))
        strided = torch.randn(8, 2 * k, dtype=BF16)[:, ::2]
        assert torch.equal(ops.linear(strided, weight), ops.linear(strided.contiguous(), weight))
        assert ops.small_row_calls() == calls + 1 + 8 + 3   # got, rows alone, these three


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason='no AVX512-BF16: a plain weight\'s few '
                    'rows run F.linear')
@torch.no_grad()
def test_plain_weight_kernel_reads_in_place_within_bf16_and_keeps_rows_batch_invariant():
    """The few-row kernel on a plain weight (pi05's tied LM head, packed in place): within one
    bf16 step of the float32 product, an odd count of 32-wide chunks handled, each row of a
    batch (two passes past eight rows) equal bit for bit to that row alone, two threads equal
    one; plain_linear sends it at most eight rows and F.linear more; bad inputs refused with
    the reason."""
    ops = native_kernel()
    assert packed_native.ready('plain_rows')
    threads = torch.get_num_threads()
    for n, k in ((1000, 64), (257, 2048), (33, 96)):
        weight = torch.randn(n, k, dtype=BF16)
        x = torch.randn(9, k, dtype=BF16)
        want = x.float() @ weight.float().t()
        got = ops.plain_rows(x, weight)
        step = want.abs() * 2.0 ** -7 + 1e-3 * want.abs().max()   # sums of k in fp32, rounded
        assert ((got.float() - want).abs() <= step).all(), (n, k)
        rows_alone = torch.cat([ops.plain_rows(x[i:i + 1], weight) for i in range(9)])
        assert torch.equal(got, rows_alone), (n, k)
        assert torch.equal(ops.plain_rows(x[:8].view(2, 4, k), weight), got[:8].view(2, 4, n))
        assert torch.equal(ops.plain_rows(x.t().contiguous().t(), weight), got)
        try:
            torch.set_num_threads(1)
            assert torch.equal(ops.plain_rows(x, weight), got)
            torch.set_num_threads(2)
            assert torch.equal(ops.plain_rows(x, weight), got)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(plain_linear(x[:8], weight), got[:8])
        assert torch.equal(plain_linear(x, weight), F.linear(x, weight))
    with pytest.raises(RuntimeError, match='multiple of 32'):
        ops.plain_rows(torch.randn(1, 48, dtype=BF16), torch.randn(8, 48, dtype=BF16))
    with pytest.raises(RuntimeError, match='must be bfloat16'):
        ops.plain_rows(torch.randn(1, 64), torch.randn(8, 64))
    assert plain_linear(torch.randn(1, 48, dtype=BF16), torch.randn(8, 48, dtype=BF16)
                        ).shape == (1, 8)   # F.linear


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason='no AVX512-BF16: oneDNN serves the few '
                    'rows of a copy packed in place')
@torch.no_grad()
def test_few_rows_read_onednns_copy_in_place_within_bf16_where_its_layout_is_known():
    """A weight packed in place (full pi05's backbone) has only oneDNN's copy: where that
    copy's layout is the one blocked_rows knows (checked against the plain values, every
    element, at pack time), 1-4 rows read it where it lies, within one bf16 step of float32,
    each row equal alone and batched, two threads equal one; 5 rows, a bias, or a layout that
    does not match go to oneDNN; bad inputs are refused with the reason."""
    ops = native_kernel()
    assert packed_native.ready('blocked_rows')
    threads = torch.get_num_threads()
    for n, k in ((128, 64), (320, 96), (2048, 256)):
        weight = torch.randn(n, k, dtype=BF16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        # the check compares values (every element, or three pairs a block): the same copy
        # against other values says no
        for full in (True, False):
            assert not ops.blocked_layout_matches(weight.flip(0).contiguous(), packed, full)
        if not ops.blocked_layout_matches(weight, packed):
            continue   # oneDNN chose another layout here: packed.linear keeps oneDNN's product
        assert ops.blocked_layout_matches(weight, packed, False)
        x = torch.randn(4, k, dtype=BF16)
        want = x.float() @ weight.float().t()
        got = ops.blocked_rows(x, packed, n)
        step = want.abs() * 2.0 ** -7 + 1e-3 * want.abs().max()   # sums of k in fp32, rounded
        assert ((got.float() - want).abs() <= step).all(), (n, k)
        assert torch.equal(torch.cat([ops.blocked_rows(x[i:i + 1], packed, n) for i in range(4)]),
                           got), (n, k)
        assert torch.equal(ops.blocked_rows(x.view(2, 2, k), packed, n), got.view(2, 2, n))
        try:
            torch.set_num_threads(1)
            assert torch.equal(ops.blocked_rows(x, packed, n), got)
            torch.set_num_threads(2)
            assert torch.equal(ops.blocked_rows(x, packed, n), got)
        finally:
            torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match='takes 1 to 4 rows'):
        ops.blocked_rows(torch.randn(5, 64, dtype=BF16), packed, 2048)
    with pytest.raises(RuntimeError, match='must be bfloat16'):
        ops.blocked_rows(torch.randn(1, 256), packed, 2048)

    # through packed.linear: a layer packed in place
    layer = torch.nn.Linear(256, 2048, bias=False).to(BF16)
    plain = layer.weight.detach().clone()
    PACKED.pack_in_place(layer, 'weight')
    entry = PACKED.entry(layer.weight)
    assert entry.blocked_rows == ops.blocked_layout_matches(plain, entry.packed)
    # a second weight of that shape: its copy checked at three pairs a block
    second = torch.nn.Linear(256, 2048, bias=False).to(BF16)
    PACKED.pack_in_place(second, 'weight')
    assert PACKED.entry(second.weight).blocked_rows == entry.blocked_rows
    for rows in (1, 4, 5):
        x = torch.randn(rows, 256, dtype=BF16)
        got = linear(x, layer.weight, True)
        onednn = torch.ops.mkldnn._linear_pointwise(x, entry.packed, None, 'none', [], '')
        if entry.blocked_rows and rows <= 4:
            assert torch.equal(got, ops.blocked_rows(x, entry.packed, 2048))
        else:
            assert torch.equal(got, onednn)
    bias = torch.randn(2048, dtype=BF16)
    x = torch.randn(1, 256, dtype=BF16)
    assert torch.equal(linear(x, layer.weight, True, bias),
                       torch.ops.mkldnn._linear_pointwise(x, entry.packed, bias, 'none', [], ''))


@torch.no_grad()
def test_greedy_ids_are_torchs_argmax_with_ties_infinities_and_nan():
    """The decode step's greedy ids (C++ row_argmax where the CPU has AVX-512): torch.argmax's
    answer for any width, ties (the first index, within a lane and across lanes), rows of
    -inf, +inf, NaN (the first NaN, as torch) and strided rows; bad input refused."""
    ops = native_kernel()
    if not packed_native.ready('row_argmax'):
        pytest.skip('no AVX-512: the decode step keeps torch.argmax')
    gen = torch.Generator().manual_seed(0)
    for B, V in ((1, 16384), (8, 16384), (3, 17), (2, 1), (4, 100)):
        x = torch.randn(B, V, generator=gen)
        assert torch.equal(ops.row_argmax(x), x.argmax(-1)), (B, V)
    x = torch.zeros(6, 40)
    x[0, [5, 21, 37]] = 3.0          # across lanes and chunks
    x[1, [3, 19]] = 2.0              # one lane, two chunks
    x[2] = float('-inf')
    x[3, 30] = float('inf')
    x[4, [9, 33]] = float('nan')
    x[5, 39] = 1.0                   # in the tail past the last whole 16
    assert torch.equal(ops.row_argmax(x), x.argmax(-1))
    assert torch.equal(greedy_ids(x), x.argmax(-1))
    strided = torch.randn(4, 64, generator=gen)[:, ::2]
    assert torch.equal(ops.row_argmax(strided), strided.argmax(-1))
    with pytest.raises(RuntimeError, match='float32'):
        ops.row_argmax(torch.randn(2, 8, dtype=BF16))


@pytest.mark.skipif(not cpu_has_amx_bf16(), reason='no AMX-BF16: vdpbf16ps serves the few '
                    'rows (test_the_few_row_kernel_is_offered_... checks the rule)')
@torch.no_grad()
def test_amx_few_row_kernel_takes_up_to_32_rows_at_any_width_and_thread_count():
    """On AMX tiles: 1..32 rows (one row tile, then two), widths that leave a partial group of
    column blocks or a lone block, each result within one bf16 step of the float32 product,
    rows equal alone and batched, two threads (columns split) equal one; 33 rows: oneDNN."""
    ops = native_kernel()
    threads = torch.get_num_threads()
    for n, k in ((16, 32), (47, 96), (80, 64), (8192, 32)):
        weight = torch.randn(n, k, dtype=BF16)
        PACKED.pack(weight)
        for rows in (1, 5, 16, 17, 32):
            x = torch.randn(rows, k, dtype=BF16)
            want = x.float() @ weight.float().t()
            calls = ops.small_row_calls()
            got = ops.linear(x, weight)
            assert ops.small_row_calls() == calls + 1, (n, k, rows)
            assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -7 + 1e-6).all(), (n, rows)
            assert torch.equal(got, torch.cat([ops.linear(x[i:i + 1], weight)
                                               for i in range(rows)])), (n, k, rows)
            torch.set_num_threads(2)
            try:
                assert torch.equal(ops.linear(x, weight), got), (n, k, rows)
            finally:
                torch.set_num_threads(threads)
    calls = ops.small_row_calls()
    ops.linear(torch.randn(33, 32, dtype=BF16), weight)
    assert ops.small_row_calls() == calls


@torch.no_grad()
def test_native_kernel_serves_row_threads_while_weights_are_packed_and_dropped():
    """A fleet's row threads call the kernel at once (its graphs run without the GIL) while
    other weights come and go in the registry: every product is the packed one, none stale."""
    ops = native_kernel()
    weights = [torch.randn(64, 32, dtype=BF16) for _ in range(2)]
    for weight in weights:
        PACKED.pack(weight)
    x = torch.randn(4, 32, dtype=BF16)
    want = [ops.linear(x, weight) for weight in weights]   # before any other thread runs
    stale = PACKED.stale_calls
    wrong = []

    def row(i):
        for _ in range(300):
            if not torch.equal(ops.linear(x, weights[i]), want[i]):
                wrong.append(i)

    threads = [threading.Thread(target=row, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for _ in range(100):   # others packed and dropped meanwhile
        other = torch.randn(16, 32, dtype=BF16)
        PACKED.pack(other)
        del other
    for thread in threads:
        thread.join()
    assert not wrong and PACKED.stale_calls == stale


def test_a_failed_native_build_says_why_and_leaves_nothing(tmp_path):
    """A compiler that fails: the reason names it, no half-written library stays behind."""
    target = tmp_path / 'oxygen_packed' / 'kernel.so'
    why = packed_native._build('false', target)
    assert why.startswith('false failed')
    assert not target.exists() and not list(target.parent.iterdir())
    (tmp_path / 'file').write_text('')   # a cache path that cannot be a folder
    assert 'cannot write' in packed_native._build('false', tmp_path / 'file' / 'kernel.so')


@torch.no_grad()
def test_a_weight_changed_after_packing_runs_plain(caplog):
    """An in-place write after packing moves the weight's version: the op runs F.linear on
    the new values (logged once), never the stale copy."""
    weight = torch.randn(64, 32, dtype=BF16)
    PACKED.pack(weight)
    x = torch.randn(3, 32, dtype=BF16)
    torch.testing.assert_close(linear(x, weight, True), F.linear(x, weight), atol=1e-2,
                               rtol=1e-2)
    assert PACKED.lookup(weight) is not None
    weight.mul_(-1)
    assert PACKED.lookup(weight) is None
    before, logged = PACKED.stale_calls, PACKED.python_stale_calls
    with caplog.at_level(logging.WARNING, logger='oxygen_ros.model.packed'):
        out = linear(x, weight, True)
    assert torch.equal(out, F.linear(x, weight))
    assert PACKED.stale_calls == before + 1
    assert not logged or not caplog.records   # the warning is logged once per process
    if not logged:
        assert 'ran unpacked' in caplog.text


def test_views_at_the_packed_address_and_dead_weights_never_match():
    """q_proj's weight starts where the fused q/k/v starts: not the packed matrix. A weight
    that is gone leaves no entry, so a new tensor at its address finds nothing."""
    model, _ = bf16_model(True)
    attn = model.backbone.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert PACKED.lookup(attn.qkv_weight) is not None
    assert PACKED.lookup(attn.q_proj.weight) is None
    weight = torch.randn(16, 16, dtype=BF16)
    PACKED.pack(weight)
    entries = len(PACKED)
    del weight
    assert len(PACKED) == entries - 1


def test_unfuse_and_precision_changes_unpack():
    """Replacing the weights (to_precision, unfuse) turns packing off: no stale lookups."""
    model, _ = bf16_model(True)
    model.to_precision(torch.float32)
    assert not model.packed and not model._lm_head_packed
    assert not any(layer.self_attn.packed or layer.mlp.packed for layer in model.backbone.layers)
    with pytest.raises(RuntimeError, match='fuse'):
        model.unfuse().pack_linears()


@pytest.mark.parametrize('dtype, setting, packs', [(BF16, 'on', True), (BF16, 'off', False),
                                                   (torch.float32, 'on', False)])
def test_prepare_packs_bf16_backbones_it_compiles(dtype, setting, packs):
    """prepare packs where the backbone's passes compile on the CPU in bf16, and says so."""
    model, _ = random_setup(TINY, 'libero', seed=1, dtype=dtype)
    plan = prepare.prepare_model(model, 'cpu', setting)
    assert model.packed is packs
    assert (plan.packed_bytes > 0) is packs
    assert ('prepacked weights' in plan.describe()) is packs
    if packs:   # the backbone's linears and the tied LM head, bf16, (C++ kernel) the expert's
        assert plan.native_kernel and plan.packed_expert     # and the vision tower's
        assert 'C++ kernel' in plan.describe()
        layers = [*model.backbone.layers, *model.expert.layers]
        weights = [model.backbone.embed_tokens.weight] + [w for layer in layers for w in (
            layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight,
            layer.mlp.gate_up_weight, layer.mlp.down_proj.weight)]
        vision = [w for layer in model.vision.vision_model.encoder.layers for w in (
            layer.self_attn.qkv_weight, layer.self_attn.out_proj.weight, layer.mlp.fc1.weight,
            layer.mlp.fc2.weight)]
        expected = sum(w.numel() * 2 for w in weights + vision)
        if torch.ops.oxygen_packed_native.small_rows_available():   # + its few-row copies,
            # not for the vision tower (only a frame's many rows multiply its weights)
            expected += sum(-(-w.shape[0] // 16) * 16 * w.shape[1] * 2 for w in weights)
        assert plan.packed_bytes == expected
    model.compile_prefill(None).compile_actions(None).compile_decode(None).compile_extend(None)


def test_packing_is_only_offered_for_bf16_on_the_cpu():
    assert packing_unavailable_reason('cpu', torch.float32).startswith('packing is for bf')
    assert 'CPU' in packing_unavailable_reason('cuda', BF16)
    np.testing.assert_equal(packing_unavailable_reason('cpu', BF16), None)


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers that hold data (not on the meta device)."""
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    return sum(tensors.values())


@torch.no_grad()
def test_packed_in_place_passes_equal_plain_and_release_the_plain_weights():
    """In place (pi05's eager path): prefill, the denoise loop and decode equal plain, and
    the vision tower's, backbone's and expert's layer weights no longer hold memory of their
    own."""
    model, frontend = bf16_model(False)
    plain, _ = bf16_model(False)
    before = weight_bytes(model)
    packed = model.pack_linears(in_place=True)
    assert model.packed and not model._lm_head_packed   # the LM head is the embedding too
    layers = [*model.backbone.layers, *model.expert.layers]
    assert all(w.is_meta for layer in layers for w in (
        layer.self_attn.qkv_weight, layer.self_attn.q_proj.weight, layer.self_attn.o_proj.weight,
        layer.mlp.gate_up_weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight))
    assert all(w.is_meta for layer in model.vision.vision_model.encoder.layers for w in (
        layer.self_attn.qkv_weight, layer.self_attn.k_proj.weight, layer.self_attn.out_proj.weight,
        layer.mlp.fc1.weight, layer.mlp.fc2.weight))
    assert weight_bytes(model) == before - packed
    noise = torch.randn(1, TINY.action_horizon, TINY.action_dim, generator=torch.Generator()
                        .manual_seed(1))
    outputs = []
    for m in (model, plain):
        kv = KVTensors.allocate(TINY, 1, TINY.prefix_len + 8, BF16)
        prefix = m.prefill(*inputs(frontend), kv=kv, slots=torch.tensor([0]))
        actions = m.sample_actions(prefix, noise)
        logits = m.decode_step(kv, prefix.slots, prefix.valid, prefix.n_valid,
                               torch.tensor([0]), torch.tensor([7]))
        outputs.append((kv.k.clone(), actions, logits))
    for got, want in zip(*outputs):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    # Preparing the same model again (a second engine on it) keeps the packed weights.
    assert model.fuse().pack_linears(in_place=True) == packed
    with pytest.raises(RuntimeError, match='packed in place'):
        model.to_precision(torch.float32)


def test_in_place_weights_take_a_gradient_and_never_go_stale():
    """Guided real-time chunking differentiates through the expert: the packed product has
    no gradient, so that call runs on the unpacked values (the same gradient as plain). A
    write into a released weight leaves nothing to compute with: a clear error, not stale
    values."""
    model, _ = bf16_model(False)
    plain, _ = bf16_model(False)
    model.pack_linears(in_place=True)
    grads = []
    for m in (model, plain):
        x = torch.randn(2, TINY.expert.width, dtype=BF16, generator=torch.Generator()
                        .manual_seed(2)).requires_grad_()
        mlp = m.expert.layers[0].mlp
        mlp(x).float().square().sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0].float(), grads[1].float(), atol=3e-2, rtol=3e-2)
    down = model.expert.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        down.copy_(torch.zeros(down.shape, dtype=BF16, device='meta'))   # moves its version
    with pytest.raises(RuntimeError, match='released into its packed copy'):
        model.expert.layers[0].mlp(torch.randn(1, TINY.expert.width, dtype=BF16))


def test_prepare_packs_in_place_above_the_compile_range(monkeypatch):
    """A bf16 model too big to compile on the CPU (pi05; here the bound is lowered) runs eager
    on weights packed in place, and the plan says so."""
    monkeypatch.setattr(prepare, 'MAX_CPU_COMPILE_PARAMS', 1000)
    model, _ = random_setup(TINY, 'libero', seed=1, dtype=BF16)
    plan = prepare.prepare_model(model, 'cpu', 'auto')
    assert not plan.any and plan.packed_in_place and model._packed_in_place
    assert 'weights prepacked in place' in plan.describe()
    # its eager passes run the library's GELU (full pi05's gates); its linears stay eager's
    if cxx_compiler() is not None:
        assert plan.native_kernel and 'packed linear' not in plan.describe()
        assert ('AVX-512 GELU' in plan.describe()) == packed_native.ready('oxygen_activation')
        # the tied LM head stays plain (the embedding) and is read in place by its kernel
        plain_head = packed_native.ready('plain_rows')
        assert ('plain-weight LM head' in plan.describe()) == plain_head
        # the backbone's and expert's copies a decode step's rows read in C++, where oneDNN
        # laid them out as blocked_rows reads (test_few_rows_read_onednns_copy_... checks it)
        readable = PACKED.blocked_rows_copies(model.parameters())
        assert plan.blocked_rows_copies == readable
        assert ('few rows on the packed copies' in plan.describe()) == (readable > 0)
        if not packed_native.ready('blocked_rows'):
            assert readable == 0
        if plain_head:
            hidden = torch.randn(1, TINY.backbone.width, dtype=BF16)
            embed = model.backbone.embed_tokens.weight
            assert torch.equal(model.lm_logits(hidden), torch.ops.oxygen_packed_native
                               .plain_rows(hidden, embed).float())
    off, _ = random_setup(TINY, 'libero', seed=1, dtype=BF16)
    assert not prepare.prepare_model(off, 'cpu', 'off').packed_bytes and not off.packed
