"""The C++ kernels of attention and activation: torch's results within bf16, where they run.

The attention kernel (model/attention_kernel.cpp) serves the folded heads of prefill and
denoise (and without AMX a decode step's) at a head dim of 32 in bf16 on a CPU with AVX512-BF16,
on AMX tiles where it has them (model/gemma.py `cpu_attention_applies`);
the AVX-512 GELU (model/activation_kernel.cpp) a prefill's and the vision tower's activations
in bf16 (gemma.py `gelu_tanh`); the gate/up product with the gated GELU in one pass
(model/packed_linear.cpp `gated_gelu`) a packed prefill's MLPs on AMX. Their speed is the
benchmark's (`oxygen-ros phases`); here: equal to torch's within bf16 rounding, masked keys
weigh nothing (whole blocks of them skipped), rows independent of each other, keys in two
blocks or a pool's entries read where they lie, the model's passes run them (counted) and give
torch's results, compiled without a graph break.
"""

import pytest
import torch
import torch.nn.functional as F

from oxygen_ros.engine import random_observation, random_setup
from oxygen_ros.engine.hardware import cpu_flags
from oxygen_ros.model import packed_native
from oxygen_ros.model.compiled import cxx_compiler, use_persistent_cache
from oxygen_ros.model import get_preset, KVTensors
from oxygen_ros.model.config import _small
from oxygen_ros.model.gemma import cpu_attention_applies, gelu_tanh
from oxygen_ros.model.packed import PACKED, use_native_kernel

BF16 = torch.bfloat16
# tiny's structure at pi05-cpu's head dim: 4 heads x 8 actions = 32 denoise rows a group
HEAD_DIM_32 = _small(width=64, expert_width=32, depth=2, heads=4, head_dim=32, vocab=512,
                     v_hidden=32, v_depth=2, v_heads=2, image_size=28, patch=7, max_tokens=24,
                     action_horizon=8, num_steps=3)


def library():
    """Build (once per machine, cached) and load the C++ kernels, as prepare does."""
    if cxx_compiler() is None:
        pytest.skip("no C++ compiler: the model keeps torch's attention and GELU")
    assert use_native_kernel(use_persistent_cache()) is None


def loaded(space: str, needs: str):
    """The ops of kernel `space` (oxygen_attention, oxygen_activation); skip without `needs`."""
    library()
    if not packed_native.ready(space):
        pytest.skip(f"no {needs} on this CPU: the model keeps torch's op "
                    '(test_each_kernel_is_offered_where_the_cpu_has_what_it_needs checks it)')
    return getattr(torch.ops, space)


def kernel():
    return loaded('oxygen_attention', 'AVX512-BF16')


def activation():
    return loaded('oxygen_activation', 'AVX512-BF16')


@pytest.mark.parametrize('space, flag', [('oxygen_attention', 'avx512_bf16'),
                                         ('oxygen_activation', 'avx512_bf16')])
def test_each_kernel_is_offered_where_the_cpu_has_what_it_needs(space, flag):
    library()
    ops = getattr(torch.ops, space)
    assert ops.available() == (flag in cpu_flags())
    assert packed_native.ready(space) == ops.available()


def test_attention_multiplies_on_amx_tiles_where_the_cpu_has_them_else_takes_any_rows():
    """On AMX tiles the kernel takes 32 rows a group or more (a decode step's 8 stay in
    SDPA); in vdpbf16ps any count, so a decode step's folded heads attend through it too."""
    kernel()
    amx = 'amx_bf16' in cpu_flags()
    assert torch.ops.oxygen_attention.on_amx() == amx == packed_native.attention_on_amx()
    decode_rows = torch.zeros(1, 1, 8, 32, dtype=BF16)      # 8 heads x 1 token, one K/V head
    denoise_rows = torch.zeros(1, 1, 80, 32, dtype=BF16)    # 8 heads x 10 actions
    assert cpu_attention_applies(denoise_rows)
    assert cpu_attention_applies(decode_rows) == (not amx)
    assert not cpu_attention_applies(decode_rows.float())   # bf16 only
    assert not cpu_attention_applies(torch.zeros(1, 1, 80, 256, dtype=BF16))   # pi05's dim


def test_the_one_pass_gate_up_is_offered_where_the_cpu_has_amx():
    library()
    assert packed_native.ready('gated_gelu') == ('amx_bf16' in cpu_flags())


def sdpa_reference(q, k, v, bias):
    mask = None if bias is None else bias.float()[:, None, None, :]
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)


@pytest.mark.parametrize('B, G, R, K, D', [(1, 1, 4440, 555, 32), (2, 1, 37, 40, 32),
                                           (1, 2, 80, 565, 32), (1, 1, 5, 17, 32),
                                           (2, 4, 256, 256, 48), (1, 2, 45, 70, 64)])
@torch.no_grad()
def test_kernel_equals_sdpa_within_bf16_and_keeps_rows_independent(B, G, R, K, D):
    """Rows and keys that are no multiple of a tile, batches and groups, masked keys, K/V
    read through the strides the model passes (a transposed [B, K, G, D] cache), the head
    dims of one tile (32: pi05-cpu's backbone) and of two (48: its vision tower, 64)."""
    ops = kernel()
    g = torch.Generator().manual_seed(R + K)
    q = (torch.randn(B, G, R, D, generator=g) * 2).to(BF16)
    k = torch.randn(B, K, G, D, generator=g).to(BF16).transpose(1, 2)
    v = torch.randn(B, K, G, D, generator=g).to(BF16).transpose(1, 2)
    valid = torch.rand(B, K, generator=g) > 0.25
    valid[:, 0] = True
    bias = torch.zeros(B, K).masked_fill(~valid, float('-inf'))
    want = sdpa_reference(q, k, v, bias)
    stock = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(BF16)[:, None, None])
    calls = ops.calls()
    got = ops.attention(q, k, v, bias)
    assert ops.calls() == calls + 1
    # as close to the float32 result as the stock bf16 kernel, up to one rounding more
    error, stock_error = ((t.float() - want).abs().max().item() for t in (got, stock))
    assert error <= 1.5 * stock_error + 2e-3, (error, stock_error)
    assert torch.equal(ops.attention(q, k, v, bias.to(BF16)), got), 'bf16 bias reads the same'
    assert torch.equal(ops.attention(q, k, v, valid), got), 'a bool mask is the same bias'
    strided = torch.stack([bias, torch.zeros_like(bias)], dim=-1).flatten(1)[:, ::2]
    assert torch.equal(ops.attention(q, k, v, strided), got), 'a bias read through its strides'
    assert torch.equal(ops.attention(q, k, v, bias.double()), got), 'another dtype, converted'
    assert torch.equal(ops.attention(q, k.contiguous(), v.contiguous(), bias), got)
    # a masked key weighs exactly nothing: changing its value changes no output bit
    v_changed = v.clone()
    v_changed.masked_fill_(~valid[:, None, :, None], 100.0)
    assert torch.equal(ops.attention(q, k, v_changed, bias), got)
    # each row alone gives its result in the batch, bit for bit
    assert torch.equal(ops.attention(q[:, :, :3].contiguous(), k, v, bias), got[:, :, :3])
    unmasked = ops.attention(q, k, v, None)
    assert (unmasked.float() - sdpa_reference(q, k, v, None)).abs().max() <= 2 * stock_error + 2e-3
    # the keys in two blocks, each read where it lies: split at a block of 16, bit for bit;
    # anywhere else (each block padded on its own), within the same rounding
    aligned = 16 * (K // 32)
    for at in (aligned, K // 2 + 1, K - 1):
        split = ops.attention(q, k[:, :, :at], v[:, :, :at], bias[:, :at],
                              k[:, :, at:], v[:, :, at:], bias[:, at:])
        if at % 16 == 0:
            assert torch.equal(split, got), at
        assert (split.float() - want).abs().max() <= 1.5 * stock_error + 2e-3, at
    parts = (k[:, :, :at], v[:, :, :at], bias[:, :at], k[:, :, at:], v[:, :, at:])
    assert torch.equal(ops.attention(q, *parts, None),
                       ops.attention(q, *parts, torch.zeros(B, K - at))), 'no key_bias2: all seen'
    # a bias that is no mask (finite values besides 0): added to the scores as they are
    ramp = torch.where(valid, -2 * torch.rand(B, K, generator=g), float('-inf'))
    ramped = ops.attention(q, k, v, ramp)
    assert (ramped.float() - sdpa_reference(q, k, v, ramp)).abs().max() <= 2 * stock_error + 2e-3


@torch.no_grad()
def test_blocks_of_masked_keys_are_skipped_without_changing_a_bit():
    """A decode step reads its slot's every position, valid or not (a missing camera's, the
    prompt's padding: runs of masked keys). Blocks of 16 masked keys are dropped before the
    products: the result is the kernel's over the keys with those blocks cut out, bit for bit,
    with batch rows that keep different counts of blocks."""
    ops = kernel()
    g = torch.Generator().manual_seed(7)
    B, R, K, D = 2, 8, 200, 32
    q = (torch.randn(B, 1, R, D, generator=g) * 2).to(BF16)
    k = torch.randn(B, 1, K, D, generator=g).to(BF16)
    v = torch.randn(B, 1, K, D, generator=g).to(BF16)
    valid = torch.rand(B, K, generator=g) > 0.3
    valid[:, 0] = True
    cut = [range(16, 64), range(96, 112)]            # whole blocks of row 0 (its 2nd-4th, 7th)
    for run in cut:
        valid[0, run.start:run.stop] = False
    valid[1, 192:] = False                           # row 1's last block (8 keys)
    got = ops.attention(q, k, v, valid)
    rest = [i for i in range(K) if not any(i in run for run in cut)]
    assert torch.equal(got[:1], ops.attention(q[:1], k[:1, :, rest], v[:1, :, rest],
                                              valid[:1, rest]))
    assert torch.equal(got[1:], ops.attention(q[1:], k[1:, :, :192], v[1:, :, :192],
                                              valid[1:, :192]))
    bias = torch.zeros(B, K).masked_fill(~valid, float('-inf'))
    assert (got.float() - sdpa_reference(q, k, v, bias)).abs().max() <= 2e-2
    # masked blocks' keys and values are never read: not even a NaN there reaches the result
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[0, :, 16:64] = float('nan')
    v_nan[0, :, 16:64] = float('nan')
    assert torch.equal(ops.attention(q, k_nan, v_nan, valid), got)


@torch.no_grad()
def test_rows_read_their_entries_of_a_pool_in_place():
    """A decode step's rows attend to their slots and blocks where they lie in the pool:
    index picks each row's entry of k, v [S, G, K, D]; the result is the gathered call's,
    bit for bit, in any order and with entries read twice."""
    ops = kernel()
    g = torch.Generator().manual_seed(3)
    S, B, R, K1, K2, D = 5, 3, 8, 100, 17, 32
    q = torch.randn(B, 1, R, D, generator=g).to(BF16)
    pool_k, pool_v = (torch.randn(S, K1, 1, D, generator=g).to(BF16).transpose(1, 2)
                      for _ in range(2))
    gen_k, gen_v = (torch.randn(S, K2, 1, D, generator=g).to(BF16).transpose(1, 2)
                    for _ in range(2))
    bias1 = torch.zeros(B, K1).masked_fill(torch.rand(B, K1, generator=g) > 0.7, float('-inf'))
    bias2 = torch.zeros(B, K2).masked_fill(torch.rand(B, K2, generator=g) > 0.5, float('-inf'))
    slots, blocks = torch.tensor([4, 1, 4]), torch.tensor([0, 2, 3])
    got = ops.attention(q, pool_k, pool_v, bias1, gen_k, gen_v, bias2, slots, blocks)
    gathered = ops.attention(q, pool_k[slots], pool_v[slots], bias1, gen_k[blocks],
                             gen_v[blocks], bias2)
    assert torch.equal(got, gathered)


def test_bad_inputs_are_refused_with_the_reason():
    ops = kernel()
    q = torch.randn(1, 1, 32, 16, dtype=BF16)
    with pytest.raises(RuntimeError, match='head dim must be 32, 48 or 64'):
        ops.attention(q, q, q, None)
    with pytest.raises(RuntimeError, match='head dim must be 32, 48 or 64'):
        ops.attention(torch.randn(1, 1, 32, 48, dtype=BF16), q, q, None)
    q = torch.randn(1, 1, 32, 32)
    with pytest.raises(RuntimeError, match='bfloat16'):
        ops.attention(q, q, q, None)
    q = q.to(BF16)
    with pytest.raises(RuntimeError, match='at least one key'):
        ops.attention(q, q[:, :, :0], q[:, :, :0], None)
    with pytest.raises(RuntimeError, match=r'key_bias must be \[B, K\]'):
        ops.attention(q, q, q, torch.zeros(1, 31))
    with pytest.raises(RuntimeError, match='k2 and v2 come together'):
        ops.attention(q, q, q, None, q)
    with pytest.raises(RuntimeError, match=r'k2, v2 must be \[S2, G, K2, D\]'):
        ops.attention(q, q, q, None, q[..., :16], q[..., :16])
    with pytest.raises(RuntimeError, match=r"k's index 3 \(row 0\) is outside its 1 entries"):
        ops.attention(q, q, q, None, index=torch.tensor([3]))
    with pytest.raises(RuntimeError, match=r"k's index must be long \[B\]"):
        ops.attention(q, q, q, None, index=torch.tensor([0.0]))
    with pytest.raises(RuntimeError, match='without an index its first dim must be B'):
        ops.attention(q, q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), None)
    with pytest.raises(RuntimeError, match=r'key_bias2 must be \[B, K\] = \[1, 32\]'):
        ops.attention(q, q, q, None, q, q, torch.zeros(1, 5))
    # the keys may all lie in the second block
    assert torch.equal(ops.attention(q, q[:, :, :0], q[:, :, :0], None, q, q),
                       ops.attention(q, q, q, None))


@torch.no_grad()
def test_prefill_and_denoise_attend_through_the_kernel_and_give_sdpa_actions():
    ops = kernel()
    model, frontend = random_setup(HEAD_DIM_32, 'libero', seed=3, dtype=BF16)
    obs = random_observation('libero', 0, seed=5, image_size=HEAD_DIM_32.vision.image_size,
                             instruction='pick up the bowl')
    t = frontend.prepare(obs).tensors
    frame = (t['images'], t['image_masks'], t['tokens'], t['token_masks'])
    noise = torch.randn(1, HEAD_DIM_32.action_horizon, HEAD_DIM_32.action_dim,
                        generator=torch.Generator().manual_seed(0))
    results = {}
    for on in (True, False):
        old = packed_native.use_kernel('oxygen_attention', on)
        try:
            calls = ops.calls()
            prefix = model.prefill(*frame)
            actions = model.sample_actions(prefix, noise)
            results[on] = (prefix.kv.k.float(), actions, ops.calls() - calls)
        finally:
            packed_native.use_kernel('oxygen_attention', old)
    depth, steps = HEAD_DIM_32.backbone.depth, HEAD_DIM_32.num_steps
    assert results[True][2] == depth + depth * steps, 'every prefill and denoise layer'
    assert results[False][2] == 0
    # K of the second layer depends on the first layer's attention
    torch.testing.assert_close(results[True][0], results[False][0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(results[True][1], results[False][1], atol=0.05, rtol=0.05)


@torch.no_grad()
def test_decode_steps_read_the_pool_in_place_through_the_kernel_and_give_sdpas_logits():
    """A decode step's rows attend through the kernel to their slots and blocks where they lie
    in the pool (slots not in a run: the index picks them), with SDPA's logits."""
    ops = kernel()
    cfg = HEAD_DIM_32
    model, frontend = random_setup(cfg, 'libero', seed=3, dtype=BF16)
    frames = [frontend.prepare(random_observation('libero', i, seed=5 + i,
                                                  image_size=cfg.vision.image_size,
                                                  instruction='pick up the bowl')).tensors
              for i in range(2)]
    inputs = [torch.cat([f[key] for f in frames])
              for key in ('images', 'image_masks', 'tokens', 'token_masks')]
    pool = KVTensors.allocate(cfg, num_slots=5, max_len=cfg.prefix_len + 8, dtype=BF16)
    prefix = model.prefill(*inputs, kv=pool, slots=torch.tensor([4, 1]))
    gen_len, tokens = torch.tensor([0, 0]), torch.tensor([7, 9])
    results = {}
    for on in (True, False):
        old = packed_native.use_kernel('oxygen_attention', on)
        try:
            calls = ops.calls()
            logits = model.decode_step(pool, prefix.slots, prefix.valid, prefix.n_valid,
                                       gen_len, tokens)
            results[on] = (logits, ops.calls() - calls)
        finally:
            packed_native.use_kernel('oxygen_attention', old)
    assert results[True][1] == cfg.backbone.depth and results[False][1] == 0
    torch.testing.assert_close(results[True][0], results[False][0], atol=0.05, rtol=0.05)


@torch.no_grad()
def test_compiled_prefill_calls_the_kernel_in_one_graph():
    kernel()
    model, frontend = random_setup(HEAD_DIM_32, 'libero', seed=3, dtype=BF16)
    obs = random_observation('libero', 0, seed=5, image_size=HEAD_DIM_32.vision.image_size)
    t = frontend.prepare(obs).tensors
    ops = traced_prefill_ops(model, (t['images'], t['image_masks'], t['tokens'],
                                     t['token_masks']))
    assert any('oxygen_attention.attention' in op for op in ops), 'SDPA was traced instead'


def traced_prefill_ops(model, frame) -> list[str]:
    """The ops of the prefill layers' graph as dynamo traces them for `frame` (one graph)."""
    captured = {}
    layers = model.prefill_layers

    def capture(*args, **kwargs):
        captured['args'], captured['kwargs'] = args, kwargs
        return layers(*args, **kwargs)

    model.prefill_layers = capture
    model.prefill(*frame)
    del model.prefill_layers
    torch._dynamo.reset()
    explain = torch._dynamo.explain(model.prefill_layers)
    explanation = explain(*captured['args'], **captured['kwargs'])
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    return [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes]


@torch.no_grad()
def test_gelu_equals_torch_within_a_rounding_gated_and_strided():
    ops = activation()
    g = torch.Generator().manual_seed(0)
    fused = (torch.randn(3, 37, 2 * 100, generator=g) * 3).to(BF16)   # H = 100: a tail of 4
    gate, up = fused.chunk(2, dim=-1)                     # strided rows, as Gemma's MLP has
    want = F.gelu(gate.float(), approximate='tanh') * up.float()
    calls = ops.calls()
    got = ops.gelu_tanh(gate, up)
    assert ops.calls() == calls + 1 and got.is_contiguous() and got.shape == gate.shape
    step = want.abs() * 2.0 ** -7 + 1e-6        # one bf16 step (rounded once, in float32)
    assert ((got.float() - want).abs() <= step).all()
    assert torch.equal(got, ops.gelu_tanh(gate.contiguous(), up.contiguous()))
    alone = ops.gelu_tanh(gate, None).float()
    assert ((alone - F.gelu(gate.float(), approximate='tanh')).abs()
            <= F.gelu(gate.float(), approximate='tanh').abs() * 2.0 ** -7 + 1e-6).all()
    x32 = torch.randn(5, 48, generator=g) * 4         # float32: the polynomial's own error
    torch.testing.assert_close(ops.gelu_tanh(x32, None), F.gelu(x32, approximate='tanh'),
                               rtol=1e-4, atol=1e-6)
    extremes = torch.tensor([-1e4, -30.0, 0.0, 30.0, 1e4], dtype=BF16)
    assert torch.isfinite(ops.gelu_tanh(extremes, None)).all()
    with pytest.raises(RuntimeError, match="up must have x's shape"):
        ops.gelu_tanh(gate, up[:, :5])
    with pytest.raises(RuntimeError, match='bfloat16 or float32'):
        ops.gelu_tanh(torch.ones(4, 4, dtype=torch.int32), None)


@torch.no_grad()
def test_a_prefill_and_the_vision_tower_run_the_gelu_and_give_torchs_result():
    """pi05-cpu's prefill (its [n, 1024] gates and [512, 768] vision activations, over the
    kernel's 16k-value threshold) runs the kernel; a decode step's few rows do not. Its
    attention (backbone and vision tower) runs through the attention kernel where the CPU
    has AVX512-BF16."""
    ops = activation()
    model, frontend = random_setup(get_preset('pi05-cpu'), 'libero', seed=3, dtype=BF16)
    obs = random_observation('libero', 0, seed=5, image_size=224, instruction='pick up')
    t = frontend.prepare(obs).tensors
    frame = (t['images'], t['image_masks'], t['tokens'], t['token_masks'])
    results = {}
    attention = packed_native.ready('oxygen_attention')
    attention_calls = torch.ops.oxygen_attention.calls if attention else None
    for on in (True, False):
        old = packed_native.use_kernel('oxygen_activation', on)
        try:
            calls = ops.calls()
            attended = attention_calls() if attention_calls else 0
            prefix = model.prefill(*frame)
            results[on] = (prefix.kv.k.float(), prefix.last_hidden.float(), ops.calls() - calls)
        finally:
            packed_native.use_kernel('oxygen_activation', old)
    cfg = model.config
    if attention_calls:   # the backbone's head dim 32 and the vision tower's 48 in the kernel
        assert attention_calls() - attended == cfg.backbone.depth + cfg.vision.depth
    assert results[True][2] == cfg.backbone.depth + cfg.vision.depth
    assert results[False][2] == 0
    torch.testing.assert_close(results[True][0], results[False][0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(results[True][1], results[False][1], atol=0.1, rtol=0.05)
    few = torch.randn(8, 1024, dtype=BF16)
    calls = ops.calls()
    gelu_tanh(few, few)
    assert ops.calls() == calls, 'a decode step keeps inductor\'s fused activation'
    # The first dim (a compiled pass's dynamic batch: decode rows, robots) does not count.
    rows = torch.randn(64, 1, 1024, dtype=BF16)
    gelu_tanh(rows, rows)
    assert ops.calls() == calls, 'a decode step of many rows too'
    tokens = torch.randn(1, 16, 1024, dtype=BF16)
    gelu_tanh(tokens, tokens)
    assert ops.calls() == calls + 1


@torch.no_grad()
def test_kernels_serve_threads_at_once():
    """A fleet's row threads run their graphs at once (without the GIL): each thread's
    results equal the same calls made alone (the scratch buffers and tile state are per
    thread)."""
    import threading

    attention = kernel()
    gelu = torch.ops.oxygen_activation if packed_native.ready('oxygen_activation') else None
    g = torch.Generator().manual_seed(7)
    cases = []
    for rows, keys in ((80, 565), (300, 555), (33, 40)):
        q = torch.randn(1, 1, rows, 32, generator=g).to(BF16)
        k = torch.randn(1, 1, keys, 32, generator=g).to(BF16)
        v = torch.randn(1, 1, keys, 32, generator=g).to(BF16)
        x = torch.randn(rows, 512, generator=g).to(BF16)
        cases.append((q, k, v, x))
    want = [(attention.attention(q, k, v, None), gelu.gelu_tanh(x, x) if gelu else None)
            for q, k, v, x in cases]
    wrong = []

    def row(i):
        q, k, v, x = cases[i % len(cases)]
        for _ in range(40):
            if not torch.equal(attention.attention(q, k, v, None), want[i % len(cases)][0]):
                wrong.append(('attention', i))
            if gelu and not torch.equal(gelu.gelu_tanh(x, x), want[i % len(cases)][1]):
                wrong.append(('gelu', i))

    threads = [threading.Thread(target=row, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not wrong, wrong[:5]


@torch.no_grad()
def test_kernels_split_their_work_across_torchs_threads():
    """The library runs its tasks on torch's threads (it is built with OpenMP: without it
    at::parallel_for's region compiled away and every kernel ran on one thread at any
    torch.get_num_threads()), and two threads give one thread's results bit for bit: the
    attention's workers read the caller's arranged keys, each kernel splits rows or columns
    only."""
    attention = kernel()
    ops = torch.ops.oxygen_packed_native
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 1, 300, 32, generator=g).to(BF16)     # 2 x 10 row blocks: 20 tasks
    k = torch.randn(2, 1, 555, 32, generator=g).to(BF16)
    v = torch.randn(2, 1, 555, 32, generator=g).to(BF16)
    x = torch.randn(300, 512, generator=g).to(BF16)
    weight = torch.randn(4096, 256, generator=g).to(BF16)    # 2 MB: past one task's grain
    rows = torch.randn(3, 256, generator=g).to(BF16)
    PACKED.pack(weight)

    def results():
        out = [attention.attention(q, k, v, None), ops.plain_rows(rows, weight),
               ops.linear(rows, weight)]
        if packed_native.ready('oxygen_activation'):
            out.append(torch.ops.oxygen_activation.gelu_tanh(x, x))
        return out

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert ops.parallel_threads() == 1
        alone = results()
        torch.set_num_threads(2)
        assert ops.parallel_threads() == 2, 'the kernels run on one thread: built without OpenMP'
        for one, two in zip(alone, results()):
            assert torch.equal(one, two)
    finally:
        torch.set_num_threads(threads)


def gated():
    """The packed linear's op namespace where its gate/up with the gated GELU runs (AMX)."""
    library()
    if not packed_native.ready('gated_gelu'):
        pytest.skip('no AMX-BF16 on this CPU: the MLP keeps the packed linear and the GELU '
                    'apart (test_each_kernel_is_offered_where_the_cpu_has_what_it_needs)')
    return torch.ops.oxygen_packed_native


@pytest.mark.parametrize('M, K, H', [(555, 256, 1024), (37, 64, 48), (17, 32, 16),
                                     (16, 96, 32), (5, 64, 32)])
@torch.no_grad()
def test_gate_up_with_the_gated_gelu_in_one_pass_is_float32s_within_bf16(M, K, H):
    """gelu(x Wg^T) * (x Wu^T) from one pass over the fused weight: row counts of one tile, two
    and a part, K of one tile and several. Its sums never round to bf16 before the GELU, so
    it is nearer float32 than the product and the GELU apart; rows are computed alone."""
    ops = gated()
    g = torch.Generator().manual_seed(M + K)
    weight = (torch.randn(2 * H, K, generator=g) * K ** -0.5).to(BF16)
    x = torch.randn(1, M, K, generator=g).to(BF16)
    PACKED.pack(weight)
    calls = ops.gated_calls()
    got = ops.gated_gelu(x, weight)
    assert ops.gated_calls() == calls + 1 and got.shape == (1, M, H) and got.dtype == BF16
    both = x.float() @ weight.float().t()
    want = F.gelu(both[..., :H], approximate='tanh') * both[..., H:]
    apart = F.gelu(ops.linear(x, weight).float()[..., :H], approximate='tanh') * ops.linear(
        x, weight).float()[..., H:]
    error = (got.float() - want).abs()
    assert (error <= want.abs() * 2.0 ** -7 + 2e-3).all(), error.max()   # one bf16 step
    assert error.max() <= (apart.to(BF16).float() - want).abs().max()
    assert torch.equal(ops.gated_gelu(x[:, :3].contiguous(), weight), got[:, :3])


@torch.no_grad()
def test_a_weight_without_its_packed_copies_takes_two_passes_with_the_same_result():
    """A weight never packed (or changed since): the op warns once, multiplies the plain
    weight and applies the GELU apart, in float32; nothing stale is read."""
    ops = gated()
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(64, 32, generator=g) * 0.2).to(BF16)
    x = torch.randn(40, 32, generator=g).to(BF16)
    calls, stale = ops.gated_calls(), ops.stale_calls()
    got = ops.gated_gelu(x, weight)
    assert ops.gated_calls() == calls and ops.stale_calls() == stale + 1
    both = x.float() @ weight.float().t()
    want = F.gelu(both[:, :32], approximate='tanh') * both[:, 32:]
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match=r'weight must be \[2H, K\]'):
        ops.gated_gelu(x, weight[:, :16])


@torch.no_grad()
def test_a_packed_prefill_runs_gate_up_and_gelu_in_one_pass():
    """pi05-cpu's prefill (packed, as prepare leaves it) runs each backbone layer's MLP through
    the one-pass kernel and gives the two-pass result within bf16; a decode step's few rows
    keep the packed linear and inductor's activation."""
    ops = gated()
    model, frontend = random_setup(get_preset('pi05-cpu'), 'libero', seed=3, dtype=BF16)
    model.fuse().pack_linears()
    obs = random_observation('libero', 0, seed=5, image_size=224, instruction='pick up')
    t = frontend.prepare(obs).tensors
    frame = (t['images'], t['image_masks'], t['tokens'], t['token_masks'])
    results = {}
    for on in (True, False):
        old = packed_native.use_kernel('gated_gelu', on)
        try:
            calls = ops.gated_calls()
            prefix = model.prefill(*frame)
            results[on] = (prefix.kv.k.float(), prefix.last_hidden.float(),
                           ops.gated_calls() - calls)
        finally:
            packed_native.use_kernel('gated_gelu', old)
    assert results[True][2] == model.config.backbone.depth and results[False][2] == 0
    torch.testing.assert_close(results[True][0], results[False][0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(results[True][1], results[False][1], atol=0.1, rtol=0.05)
    calls = ops.gated_calls()
    mlp = model.backbone.layers[0].mlp
    mlp(torch.randn(1, 8, model.config.backbone.width, dtype=BF16))
    assert ops.gated_calls() == calls, 'a decode step keeps the packed linear'
    # traced, the op is one more node of the prefill's one graph (its choice asks no op)
    traced = traced_prefill_ops(model, frame)
    assert sum('oxygen_packed_native.gated_gelu' in op for op in traced) == \
        model.config.backbone.depth
