"""Numerical oracles for the π0.5 model: cached == uncached, batched == alone, masks inert."""

import math

import pytest
import torch
import torch.nn.functional as F

from oxygen_ros.model import get_preset, KVTensors, Pi05Model
from oxygen_ros.model.gemma import (attention, attention_two_blocks, gated_residual, host_run,
                                    key_bias, rope, take_rows)
from oxygen_ros.model.pi05 import attend_bucket, DENOISE_GRAPHS, time_embedding

ATOL = 2e-5


@pytest.fixture(scope='module')
def model():
    torch.manual_seed(0)
    return Pi05Model(get_preset('tiny')).init_random(seed=3).eval()


def make_inputs(cfg, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = cfg.vision.image_size
    images = torch.rand(B, cfg.num_cameras, 3, S, S, generator=g) * 2 - 1
    image_masks = torch.ones(B, cfg.num_cameras, dtype=torch.bool)
    image_masks[0, 2] = False            # libero-like: third camera masked
    if B > 1:
        image_masks[1, 1] = False
    tokens = torch.randint(3, cfg.backbone.vocab_size, (B, cfg.max_token_len), generator=g)
    lengths = [5, 11, 17, 2, 20][:B]
    token_masks = torch.arange(cfg.max_token_len)[None] < torch.tensor(lengths)[:, None]
    return images, image_masks, tokens, token_masks


def joint_forward(model, images, image_masks, tokens, token_masks, x_t, t):
    """Uncached reference: prefix and suffix in ONE pass with the block-causal mask.

    This is how openpi trains (both towers per layer, Q/K/V concatenated for one softmax);
    the prefix never attends to the suffix. Returns the velocity [B, H, A].
    """
    cfg = model.config
    prefix, valid = model.embed_prefix(images, image_masks, tokens, token_masks)
    B, P, _ = prefix.shape
    Hn = x_t.shape[1]
    cond = F.silu(model.time_mlp_out(F.silu(model.time_mlp_in(
        time_embedding(t, cfg.expert.width)))))
    suffix = model.action_in_proj(x_t)
    all_valid = torch.cat([valid, torch.ones(B, Hn, dtype=torch.bool)], 1)      # [B, P+H]
    pos = all_valid.long().cumsum(-1) - 1
    is_suffix = torch.arange(P + Hn) >= P
    # query i may see key j if j valid and (j in prefix or i in suffix)
    mask = all_valid[:, None, :] & (~is_suffix[None, None, :] | is_suffix[None, :, None])
    for blayer, elayer in zip(model.backbone.layers, model.expert.layers):
        hp, _ = blayer.input_layernorm(prefix)
        hs, gs = elayer.input_layernorm(suffix, cond)
        qp, kp, vp = blayer.self_attn.qkv(hp)
        qs, ks, vs = elayer.self_attn.qkv(hs)
        q = rope(torch.cat([qp, qs], 1), pos)
        k = rope(torch.cat([kp, ks], 1), pos)
        v = torch.cat([vp, vs], 1)
        out = attention(q, k, v, mask)
        prefix = prefix + blayer.self_attn.o_proj(out[:, :P])
        suffix = gated_residual(suffix, elayer.self_attn.o_proj(out[:, P:]), gs)
        hp, _ = blayer.post_attention_layernorm(prefix)
        prefix = prefix + blayer.mlp(hp)
        hs, gs = elayer.post_attention_layernorm(suffix, cond)
        suffix = gated_residual(suffix, elayer.mlp(hs), gs)
    suffix, _ = model.expert.norm(suffix, cond)
    return model.action_out_proj(suffix)


@torch.no_grad()
def test_sample_actions_equals_uncached_joint_forward(model):
    cfg = model.config
    inputs = make_inputs(cfg)
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim, generator=torch.Generator()
                        .manual_seed(1))
    prefix = model.prefill(*inputs)
    cached = model.sample_actions(prefix, noise)
    x_t = noise.clone()
    for step in range(cfg.num_steps):
        t = torch.full((3,), 1.0 - step / cfg.num_steps)
        x_t = x_t - joint_forward(model, *inputs, x_t, t) / cfg.num_steps
    torch.testing.assert_close(cached, x_t, atol=ATOL, rtol=1e-4)
    assert cached.abs().mean() > 0.1  # a real signal, not a collapse to zeros


@torch.no_grad()
@torch.no_grad()
def test_prefix_holds_each_shown_camera_and_zeros_for_the_others(model):
    """A run of cameras from the first is read as a view, any other set by index: each shown
    camera's rows are its own features, a masked one's zeros, whichever is masked."""
    cfg = model.config
    images, _, tokens, token_masks = make_inputs(cfg, B=1)
    Ti = cfg.tokens_per_image
    alone = [model.encode_images(images[0, c:c + 1])[0] for c in range(cfg.num_cameras)]
    for shown in ([True, True, False], [False, True, True], [True, False, True],
                  [False, False, False], [True, True, True]):
        x, valid = model.embed_prefix(images, torch.tensor([shown]), tokens, token_masks)
        for c, on in enumerate(shown):
            rows = x[0, c * Ti:(c + 1) * Ti]
            assert bool(valid[0, c * Ti:(c + 1) * Ti].all()) == on
            if on:
                torch.testing.assert_close(rows, alone[c], atol=1e-5, rtol=1e-5)
            else:
                assert not rows.any(), (shown, c)


def test_sample_actions_leaves_cache_untouched(model):
    prefix = model.prefill(*make_inputs(model.config), extra_len=4)
    k, v = prefix.kv.k.clone(), prefix.kv.v.clone()
    model.sample_actions(prefix, torch.randn(3, model.config.action_horizon, 32))
    assert torch.equal(prefix.kv.k, k) and torch.equal(prefix.kv.v, v)


@torch.no_grad()
def test_denoise_modulations_are_cached_until_a_weight_they_come_from_changes():
    """The loop's adaRMS modulations are computed once per weights: the same tensor frame
    after frame, equal to computing them; a write into (or a new) weight they come from, or
    another step count, computes them again, and the actions follow."""
    model = Pi05Model(get_preset('tiny')).init_random(seed=5).eval()
    cfg, steps = model.config, model.config.num_steps
    prefix = model.prefill(*make_inputs(cfg, B=2, seed=3))
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim)
    context = model.action_context(prefix, cfg.action_horizon, 'cpu')

    def fresh(n=steps):
        return model.expert_modulations(model.flow_times(n))

    def computed(n=steps):
        return torch.stack(fresh(n))

    def cached(n=steps):
        return torch.stack(model.denoise_modulations(n, 'cpu'))

    mods = model.denoise_modulations(steps, 'cpu')
    assert model.denoise_modulations(steps, 'cpu') is mods
    assert torch.equal(cached(), computed())
    assert cached().shape == (2 * cfg.expert.depth + 1, steps, 3 * cfg.expert.width)
    assert torch.equal(model.sample_actions(prefix, noise),
                       model.denoise_loop(*context, noise, steps, fresh()))
    assert torch.equal(cached(steps - 1), computed(steps - 1))
    before = model.sample_actions(prefix, noise)
    model.expert.layers[-1].post_attention_layernorm.dense.weight.mul_(1.5)   # in place
    again = model.denoise_modulations(steps, 'cpu')
    assert again is not mods and torch.equal(cached(), computed())
    after = model.sample_actions(prefix, noise)
    assert not torch.equal(after, before)
    assert torch.equal(after, model.denoise_loop(*context, noise, steps, fresh()))
    model.time_mlp_in.weight = torch.nn.Parameter(model.time_mlp_in.weight * 0.5)   # replaced
    assert torch.equal(cached(), computed())
    assert torch.equal(model.sample_actions(prefix, noise),
                       model.denoise_loop(*context, noise, steps, fresh()))


def recompute_logits(model, images, image_masks, tokens, token_masks, generated):
    """Uncached reference: logits for the next token after `generated`, recomputing everything.

    Generated tokens are appended after the (padded) prefix with causal attention among
    themselves, positions continuing from the number of valid prefix tokens.
    """
    x, valid = model.embed_prefix(images, image_masks, tokens, token_masks)     # [1, P, W]
    P, n = x.shape[1], len(generated)
    if n:
        gen = model.backbone.embed_tokens(torch.tensor([generated]))
        x = torch.cat([x, gen * math.sqrt(model.config.backbone.width)], 1)
    all_valid = torch.cat([valid, torch.ones(1, n, dtype=torch.bool)], 1)
    pos = all_valid.long().cumsum(-1) - 1
    idx = torch.arange(P + n)
    causal = (idx[None, :] <= idx[:, None]) | (idx[None, :] < P)               # [T, T]
    mask = all_valid[:, None, :] & causal[None]
    for layer in model.backbone.layers:
        h, _ = layer.input_layernorm(x)
        q, k, v = layer.self_attn.qkv(h)
        x = x + layer.self_attn.o_proj(attention(rope(q, pos), rope(k, pos), v, mask))
        h, _ = layer.post_attention_layernorm(x)
        x = x + layer.mlp(h)
    last = (P + n - 1) if n else int(torch.nonzero(valid[0])[-1])
    h, _ = model.backbone.norm(x[:, last:last + 1])
    return model.lm_logits(h[:, 0])[0]


@torch.no_grad()
def test_cached_decode_equals_recompute(model):
    inputs = make_inputs(model.config, B=1, seed=4)
    prefix = model.prefill(*inputs, extra_len=8)
    generated = []
    logits = model.lm_logits(prefix.last_hidden)[0]
    for j in range(6):
        torch.testing.assert_close(logits, recompute_logits(model, *inputs, generated),
                                   atol=1e-4, rtol=1e-4)
        token = int(logits.argmax())
        generated.append(token)
        logits = model.decode_step(prefix.kv, prefix.slots, prefix.valid, prefix.n_valid,
                                   torch.tensor([j]), torch.tensor([token]))[0]
    assert generated == model.generate(prefix, 6, eos_id=None)[0]
    # greedy: the step's own argmax, the logits' (entry 4 written again with the same K/V)
    step = (prefix.kv, prefix.slots, prefix.valid, prefix.n_valid, torch.tensor([4]),
            torch.tensor([generated[4]]))
    best = model.decode_step(*step, greedy=True)
    assert best.dtype == torch.long and best.tolist() == [generated[5]]
    assert torch.equal(best, model.decode_step(*step).argmax(-1))


@torch.no_grad()
def test_ragged_batched_decode_equals_each_row_alone(model):
    """Rows with different prompt lengths, masks and generated lengths share one decode call."""
    cfg = model.config
    B = 4
    inputs = make_inputs(cfg, B=B, seed=7)
    batch = model.prefill(*inputs, extra_len=10)
    # Each row alone: its own storage, its own greedy tokens and logits per step.
    alone = []
    for b in range(B):
        single = model.prefill(*(x[b:b + 1] for x in inputs), extra_len=10)
        alone.append((single, model.generate(single, 8, eos_id=None)[0]))
    # Advance rows to different generated lengths first (ragged), then decode all together.
    offsets = [0, 3, 5, 1]
    for b, off in enumerate(offsets):
        for j in range(off):
            model.decode_step(batch.kv, batch.slots[b:b + 1], batch.valid[b:b + 1],
                              batch.n_valid[b:b + 1], torch.tensor([j]),
                              torch.tensor([alone[b][1][j]]))
    gen_len = torch.tensor(offsets)
    tokens = torch.tensor([alone[b][1][off] for b, off in enumerate(offsets)])
    logits = model.decode_step(batch.kv, batch.slots, batch.valid, batch.n_valid, gen_len,
                               tokens)
    for b, off in enumerate(offsets):
        single, toks = alone[b]
        ref = model.decode_step(single.kv, single.slots, single.valid, single.n_valid,
                                torch.tensor([off]), torch.tensor([toks[off]]))[0]
        torch.testing.assert_close(logits[b], ref, atol=1e-4, rtol=1e-4)
        assert int(logits[b].argmax()) == toks[off + 1]


@torch.no_grad()
def test_generate_batched_stops_each_row_at_eos(model):
    cfg = model.config
    inputs = make_inputs(cfg, B=3, seed=9)
    free = model.generate(model.prefill(*inputs, extra_len=8), 8, eos_id=None)
    eos = free[1][2]  # a token that row 1 emits at step 2
    out = model.generate(model.prefill(*inputs, extra_len=8), 8, eos_id=eos)
    for row_free, row in zip(free, out):
        stop = row_free.index(eos) + 1 if eos in row_free else 8
        assert row == row_free[:stop]
    assert len(out[1]) <= 3


@torch.no_grad()
def test_decode_into_non_contiguous_pool_slots(model):
    """Prefill into arbitrary slots of a shared pool equals private storage."""
    cfg = model.config
    inputs = make_inputs(cfg, B=2, seed=11)
    from oxygen_ros.model import KVTensors
    pool = KVTensors.allocate(cfg, num_slots=5, max_len=cfg.prefix_len + 6)
    shared = model.prefill(*inputs, kv=pool, slots=torch.tensor([4, 1]))
    private = model.prefill(*inputs, extra_len=6)
    assert model.generate(shared, 6, eos_id=None) == model.generate(private, 6, eos_id=None)
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim)
    torch.testing.assert_close(model.sample_actions(shared, noise),
                               model.sample_actions(private, noise), atol=ATOL, rtol=0)
    untouched = [0, 2, 3]
    assert pool.k[:, untouched].abs().sum() == 0


@torch.no_grad()
def test_masked_camera_and_padding_are_inert(model):
    """Content behind masks changes nothing; a masked camera equals a model without it."""
    cfg = model.config
    images, image_masks, tokens, token_masks = make_inputs(cfg, B=3, seed=5)
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim)
    base = model.prefill(images, image_masks, tokens, token_masks, extra_len=4)
    images2, tokens2 = images.clone(), tokens.clone()
    images2[~image_masks] = torch.rand_like(images2[~image_masks])
    tokens2[~token_masks] = 7
    other = model.prefill(images2, image_masks, tokens2, token_masks, extra_len=4)
    assert torch.equal(model.sample_actions(base, noise), model.sample_actions(other, noise))
    assert model.generate(base, 4) == model.generate(other, 4)

    # Positions skip masked slots: a 2-camera, shorter-prompt model with the same weights
    # sees the same sequence as row 0 (third camera masked, 5 prompt tokens).
    small_cfg = cfg.replace(num_cameras=2, max_token_len=8)
    small = Pi05Model(small_cfg).eval()
    small.load_state_dict(model.state_dict())
    p_small = small.prefill(images[:1, :2], image_masks[:1, :2], tokens[:1, :8],
                            token_masks[:1, :8], extra_len=4)
    torch.testing.assert_close(p_small.last_hidden, base.last_hidden[:1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(small.sample_actions(p_small, noise[:1]),
                               model.sample_actions(base.row(0), noise[:1]), atol=ATOL,
                               rtol=1e-4)
    assert small.generate(p_small, 4) == model.generate(base.row(0), 4)


@torch.no_grad()
def test_bfloat16_path_keeps_float32_islands(model):
    cfg = model.config
    bf = Pi05Model(cfg).eval()
    bf.load_state_dict(model.state_dict())
    bf.to_precision(torch.bfloat16)
    params = dict(bf.named_parameters())
    assert params['paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings'
                  '.patch_embedding.weight'].dtype == torch.float32
    assert params['paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.dense'
                  '.weight'].dtype == torch.float32
    assert params['action_out_proj.weight'].dtype == torch.float32
    assert params['paligemma_with_expert.paligemma.model.language_model.layers.0.mlp.up_proj'
                  '.weight'].dtype == torch.bfloat16
    inputs = make_inputs(cfg, seed=2)
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim)
    prefix = bf.prefill(*inputs, extra_len=2)
    assert prefix.kv.k.dtype == torch.bfloat16
    actions = bf.sample_actions(prefix, noise)
    ref = model.sample_actions(model.prefill(*inputs), noise)
    assert actions.dtype == torch.float32
    # bf16 is lossy; it must still track float32 closely.
    assert (actions - ref).abs().mean() < 0.1 * ref.abs().mean()


def test_prefill_rejects_wrong_shapes(model):
    cfg = model.config
    images, image_masks, tokens, token_masks = make_inputs(cfg)
    with pytest.raises(ValueError, match='cameras'):
        model.prefill(images[:, :2], image_masks[:, :2], tokens, token_masks)
    with pytest.raises(ValueError, match='slots'):
        from oxygen_ros.model import KVTensors
        pool = KVTensors.allocate(cfg, 2, cfg.prefix_len - 1)
        model.prefill(images, image_masks, tokens, token_masks, kv=pool,
                      slots=torch.tensor([0, 1, 0]))


@torch.no_grad()
def test_prefill_computes_valid_positions_only(model):
    """Masked cameras skip the vision tower; the layers see packed valid tokens; the slot's
    other positions hold zeros; equal-length rows batched equal each row alone."""
    cfg = model.config
    images, image_masks, tokens, token_masks = make_inputs(cfg, B=3, seed=6)
    image_masks[:] = torch.tensor([True, True, False])
    token_masks[:] = torch.arange(cfg.max_token_len)[None] < 9      # equal rows: no mask
    seen = {}

    def record(name, value):   # a forward hook must return None (or it replaces the output)
        seen[name] = value

    hooks = [model.vision.vision_model.register_forward_hook(
                 lambda m, args, out: record('vision', args[0].shape[0])),
             model.backbone.layers[0].register_forward_hook(
                 lambda m, args, out: record('layer', tuple(args[0].shape)))]
    try:
        batched = model.prefill(images, image_masks, tokens, token_masks, extra_len=2)
    finally:
        for hook in hooks:
            hook.remove()
    n = 2 * cfg.tokens_per_image + 9
    assert seen == {'vision': 6, 'layer': (3, n, cfg.backbone.width)}
    assert batched.n_valid.tolist() == [n] * 3
    invalid = ~batched.valid                                             # [B, P]
    assert not batched.kv.k[:, :, :cfg.prefix_len][:, invalid].any()
    assert batched.kv.k[:, :, :cfg.prefix_len][:, batched.valid].abs().sum() > 0
    for b in range(3):
        alone = model.prefill(images[b:b + 1], image_masks[b:b + 1], tokens[b:b + 1],
                              token_masks[b:b + 1], extra_len=2)
        torch.testing.assert_close(alone.kv.k[:, 0], batched.kv.k[:, b], atol=ATOL, rtol=0)
        torch.testing.assert_close(alone.last_hidden[0], batched.last_hidden[b], atol=ATOL,
                                   rtol=1e-4)


# ---- static-shape decode, in-place action path, one layer body ------------------------------

def test_attend_bucket():
    needed = (1, 8, 9, 16, 17, 40, 64)
    assert [attend_bucket(n, 64) for n in needed] == [8, 8, 16, 16, 32, 64, 64]
    assert attend_bucket(20, 24) == 24          # capped at T - P


@torch.no_grad()
def test_attention_paths_agree():
    """Folded heads, GQA SDPA and the two-block form (strided prefix view) give one result."""
    g = torch.Generator().manual_seed(0)
    B, Q, N, G, D, K1, K2 = 2, 3, 4, 2, 8, 11, 3
    q = torch.randn(B, Q, N, D, generator=g)
    store = torch.randn(5, K1 + 4, G, D, generator=g)        # [S, T, G, D]
    k1, v1 = store[1:3, :K1], store[2:4, :K1]                 # strided views, as in the pool
    k2, v2 = torch.randn(2, B, K2, G, D, generator=g)
    mask1 = torch.rand(B, K1, generator=g) > 0.4
    mask1[:, 0] = True
    k, v = torch.cat([k1, k2], 1), torch.cat([v1, v2], 1)
    mask = torch.cat([mask1, torch.ones(B, K2, dtype=torch.bool)], 1)           # [B, K]
    per_query = attention(q, k, v, mask[:, None].expand(B, Q, -1))             # GQA SDPA
    folded = attention(q, k, v, mask[:, None])                                 # folded heads
    two = attention_two_blocks(q, k1, v1, key_bias(mask1, q.dtype), k2, v2)
    torch.testing.assert_close(folded, per_query, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(two, per_query, atol=1e-6, rtol=1e-5)
    # a masked second block (a decode row's generation block: entries written so far)
    mask2 = torch.tensor([[True, False, False], [True, True, False]])
    masked = attention(q, k, v, torch.cat([mask1, mask2], 1)[:, None])
    two = attention_two_blocks(q, k1, v1, key_bias(mask1, q.dtype), k2, v2,
                               key_bias(mask2, q.dtype))
    torch.testing.assert_close(two, masked, atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_action_path_reads_prefix_in_place(model):
    """A run of host slot ids is read as a view of the pool; scattered ids give the same."""
    cfg = model.config
    P = cfg.prefix_len
    inputs = make_inputs(cfg, B=2, seed=12)
    pool = KVTensors.allocate(cfg, num_slots=5, max_len=P + 4)
    run = model.prefill(*inputs, kv=pool, slots=torch.tensor([1, 2]))
    view = take_rows(pool.k[0, :, :P], run.slots)
    assert view.data_ptr() == pool.k[0, 1].data_ptr()
    assert host_run(torch.tensor([3, 1])) is None
    pool2 = KVTensors.allocate(cfg, num_slots=5, max_len=P + 4)
    scattered = model.prefill(*inputs, kv=pool2, slots=torch.tensor([4, 0]))
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim)
    torch.testing.assert_close(model.sample_actions(run, noise),
                               model.sample_actions(scattered, noise), atol=0, rtol=0)


def _ragged_pool(model, num_slots=6):
    """Three requests in scattered slots [4, 1, 2], advanced to gen_len [0, 3, 5]."""
    cfg = model.config
    inputs = make_inputs(cfg, B=3, seed=13)
    pool = KVTensors.allocate(cfg, num_slots=num_slots, max_len=cfg.prefix_len + 12)
    prefix = model.prefill(*inputs, kv=pool, slots=torch.tensor([4, 1, 2]))
    gen_len = [0, 3, 5]
    for b, n in enumerate(gen_len):
        row = prefix.row(b)
        for j, token in enumerate(model.generate(row, n + 1, eos_id=None)[0][:n]):
            model.decode_step(pool, row.slots, row.valid, row.n_valid, torch.tensor([j]),
                              torch.tensor([token]))
    return prefix, torch.tensor(gen_len), torch.tensor([11, 12, 13])


@torch.no_grad()
def test_static_decode_with_padding_rows_equals_dynamic(model):
    """attend_len buckets and padding rows change nothing for the real rows.

    Padding rows as the engine makes them: on a null slot no real row uses, and on a real
    row's slot writing that slot's last (scratch) entry, which no real row attends.
    """
    P = model.config.prefix_len
    prefix, gen_len, tokens = _ragged_pool(model)
    kv = prefix.kv
    T = kv.max_len
    saved = (kv.k.clone(), kv.v.clone())
    dynamic = model.decode_step(kv, prefix.slots, prefix.valid, prefix.n_valid, gen_len, tokens)
    after = (kv.k.clone(), kv.v.clone())
    null, scratch = 5, T - P - 1
    slots = torch.cat([prefix.slots, torch.tensor([null, null, 4])])
    valid = torch.cat([prefix.valid, prefix.valid.new_zeros(2, P), prefix.valid[:1]])
    n_valid = torch.cat([prefix.n_valid, torch.tensor([0, 0, int(prefix.n_valid[0])])])
    gen = torch.cat([gen_len, torch.tensor([0, 0, scratch])])
    toks = torch.cat([tokens, torch.tensor([0, 0, 0])])
    for attend_len in (attend_bucket(int(gen_len.max()) + 1, T - P), T - P):
        kv.k.copy_(saved[0])
        kv.v.copy_(saved[1])
        static = model.decode_step(kv, slots, valid, n_valid, gen, toks, attend_len=attend_len)
        assert static.shape == (6, model.config.backbone.vocab_size)
        torch.testing.assert_close(static[:3], dynamic, atol=1e-5, rtol=1e-5)
        # Every real entry as the unpadded step left it (batch size changes matmul blocking,
        # hence float rounding, not more); padding wrote only the null slot and a scratch entry.
        real = [s for s in range(kv.k.shape[1]) if s != null]
        for new, ref in ((kv.k, after[0]), (kv.v, after[1])):
            torch.testing.assert_close(new[:, real, :T - 1], ref[:, real, :T - 1], atol=1e-5,
                                       rtol=1e-5)
    with pytest.raises(ValueError, match='generated entries'):
        model.decode_step(kv, slots, valid, n_valid, gen, toks, attend_len=T - P + 1)


# Graph breaks of the compiled passes, pinned: each must trace to exactly one graph. A change
# that adds a host read or an untraceable call inside one fails here (and would cost a host
# sync, or a CUDA graph, per step).
# (graphs, graph breaks)
GRAPHS = {'denoise loop': (1, 0), 'decode step': (1, 0)}


def _explain(fn, *args):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    return explanation.graph_count, explanation.graph_break_count


@torch.no_grad()
def test_decode_step_graph_breaks_pinned(model):
    """With attend_len the step reads no tensor value on the host: one graph, no break.

    Both layouts: generated tokens after the prefix in its slot, and in generation blocks of
    their own (the engine's: kv/store.py), several rows on one prefix slot.
    """
    prefix, gen_len, tokens = _ragged_pool(model)
    kv = prefix.kv
    P = model.config.prefix_len
    blocks = KVTensors.allocate(model.config, num_slots=4, max_len=9)
    cos, sin = model.rope_tables(kv.max_len, 'cpu')
    for rows in (slice(0, 1), slice(None)):   # B = 1 and B = 3: the two graphs of a runner
        slots = prefix.slots[rows]
        shared = slots[:1].expand(slots.shape[0])   # every row on the first row's prefix
        layouts = ((kv, slots, slots, P), (blocks, shared, torch.tensor([3, 0, 2])[rows], 0))
        for gen, prefix_slots, block_ids, gen_offset in layouts:
            args = (kv.k, kv.v, gen.k, gen.v, cos, sin, prefix_slots, block_ids,
                    prefix.valid[rows], prefix.n_valid[rows], gen_len[rows], tokens[rows], 8,
                    gen_offset)
            assert _explain(model._decode_layers, *args) == GRAPHS['decode step'], rows
    ref = model.decode_step(kv, prefix.slots, prefix.valid, prefix.n_valid, gen_len, tokens,
                            attend_len=8)
    try:
        model.compile_decode(mode=None, backend='eager', fullgraph=True)
        out = model.decode_step(kv, prefix.slots, prefix.valid, prefix.n_valid, gen_len,
                                tokens, attend_len=8)   # rewrites the same K/V entries
    finally:
        model.compile_decode(mode=None)
    assert model._decode_fn is None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize('graph', DENOISE_GRAPHS)
def test_denoise_loop_graph_breaks_pinned(model, graph):
    """compile_actions: the whole loop, every step, traces to one graph without a break, its
    steps unrolled or as nested regions; both equal eager."""
    prefix = model.prefill(*make_inputs(model.config, B=2, seed=14), extra_len=2)
    noise = torch.randn(2, model.config.action_horizon, model.config.action_dim)
    inputs = model.action_context(prefix, model.config.action_horizon, 'cpu')
    step = model.denoise_step_region if graph == 'regions' else None
    steps = model.config.num_steps
    assert _explain(model.denoise_loop, *inputs, noise, steps,
                    model.denoise_modulations(steps, 'cpu'), step) == GRAPHS['denoise loop']
    ref = model.sample_actions(prefix, noise)
    try:
        model.compile_actions(mode=None, graph=graph, backend='eager', fullgraph=True)
        out = model.sample_actions(prefix, noise)
    finally:
        model.compile_actions(mode=None)
    assert model._denoise_fn is None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_one_layer_body_serves_all_passes(model):
    """prefill, sample_actions and decode_step all run GemmaLayer.forward."""
    calls = []
    hooks = [model.backbone.layers[0].register_forward_hook(lambda *a: calls.append('bb')),
             model.expert.layers[0].register_forward_hook(lambda *a: calls.append('ex'))]
    try:
        prefix = model.prefill(*make_inputs(model.config, B=1), extra_len=2)
        model.sample_actions(prefix, torch.randn(1, model.config.action_horizon, 32))
        model.decode_step(prefix.kv, prefix.slots, prefix.valid, prefix.n_valid,
                          torch.tensor([0]), torch.tensor([5]))
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == ['bb'] + ['ex'] * model.config.num_steps + ['bb']


def _feed_one_by_one(model, prefix, b, gen, block, fed, start=0):
    """Feed tokens `fed` to row b one decode step each (entries start..); last logits [V]."""
    for j, token in enumerate(fed):
        logits = model.decode_step(prefix.kv, prefix.slots[b:b + 1], prefix.valid[b:b + 1],
                                   prefix.n_valid[b:b + 1], torch.tensor([start + j]),
                                   torch.tensor([token]), gen=gen, blocks=torch.tensor([block]))
    return logits[0]


@torch.no_grad()
def test_extend_equals_one_by_one_and_uncached(model):
    """A template fed in one extend pass == fed one token per decode step == recomputed.

    Same logits, same K/V entries, and the same greedy tokens when decoding goes on after it.
    """
    cfg = model.config
    inputs = make_inputs(cfg, B=1, seed=13)
    prefix = model.prefill(*inputs)
    prompt = torch.randint(3, cfg.backbone.vocab_size, (9,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    stepped, extended = KVTensors.allocate(cfg, 2, 16), KVTensors.allocate(cfg, 2, 16)
    ref = _feed_one_by_one(model, prefix, 0, stepped, 1, prompt)
    logits = model.extend_step(prefix.kv, prefix.slots, prefix.valid, prefix.n_valid,
                               torch.tensor([0]), torch.tensor([prompt]), torch.tensor([9]),
                               gen=extended, blocks=torch.tensor([1]))[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, recompute_logits(model, *inputs, prompt), atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(extended.k[:, 1, :9], stepped.k[:, 1, :9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(extended.v[:, 1, :9], stepped.v[:, 1, :9], atol=1e-5, rtol=1e-5)
    assert extended.k[:, 0].abs().sum() == 0   # another block: untouched
    # Greedy decoding after each: identical ids, and the uncached model's.
    tokens = {}
    for name, gen, first in (('stepped', stepped, ref), ('extended', extended, logits)):
        out = [int(first.argmax())]
        for j in range(5):
            out.append(int(_feed_one_by_one(model, prefix, 0, gen, 1, out[-1:], 9 + j).argmax()))
        tokens[name] = out
    uncached = []
    for _ in range(6):
        uncached.append(int(recompute_logits(model, *inputs, prompt + uncached).argmax()))
    assert tokens['extended'] == tokens['stepped'] == uncached


@torch.no_grad()
def test_batched_extend_equals_each_row_alone(model):
    """Ragged rows (prompt lengths, entries already written) in one extend pass == alone.

    One row continues a block that already holds entries (a chunk after a chunk), so the
    pass also equals feeding a prompt in two chunks; padding tokens touch only the scratch.
    """
    cfg = model.config
    B, E = 3, 20
    inputs = make_inputs(cfg, B=B, seed=17)
    prefix = model.prefill(*inputs)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, cfg.backbone.vocab_size, (n,), generator=g).tolist()
               for n in (4, 11, 7)]
    offsets = [0, 0, 3]   # row 2: its first 3 tokens fed before, by decode steps
    batched, alone = KVTensors.allocate(cfg, B, E + 1), KVTensors.allocate(cfg, B, E + 1)
    for gen in (batched, alone):
        _feed_one_by_one(model, prefix, 2, gen, 2, prompts[2][:3])
    rest = [p[off:] for p, off in zip(prompts, offsets)]
    Q = max(map(len, rest))
    logits = model.extend_step(
        prefix.kv, prefix.slots, prefix.valid, prefix.n_valid, torch.tensor(offsets),
        torch.tensor([p + [0] * (Q - len(p)) for p in rest]), torch.tensor(list(map(len, rest))),
        gen=batched, blocks=torch.arange(B))
    for b in range(B):
        ref = model.extend_step(prefix.kv, prefix.slots[b:b + 1], prefix.valid[b:b + 1],
                                prefix.n_valid[b:b + 1], torch.tensor([offsets[b]]),
                                torch.tensor([rest[b]]), torch.tensor([len(rest[b])]),
                                gen=alone, blocks=torch.tensor([b]))[0]
        torch.testing.assert_close(logits[b], ref, atol=1e-4, rtol=1e-4)
        stepped = _feed_one_by_one(model, prefix, b, KVTensors.allocate(cfg, B, E + 1), b,
                                   prompts[b])
        assert int(logits[b].argmax()) == int(stepped.argmax())
        n = len(prompts[b])
        torch.testing.assert_close(batched.k[:, b, :n], alone.k[:, b, :n], atol=1e-5, rtol=1e-5)
        assert batched.k[:, b, n:E].abs().sum() == 0   # padding wrote only the scratch entry
    with pytest.raises(ValueError, match='generated entries'):
        model.extend_step(prefix.kv, prefix.slots[:1], prefix.valid[:1], prefix.n_valid[:1],
                          torch.tensor([15]), torch.tensor([[3] * 6]), torch.tensor([6]),
                          gen=batched, blocks=torch.tensor([0]))


@torch.no_grad()
def test_compiled_patch_embedding_is_the_convolution(model):
    """Traced, the patch embedding runs as patches @ W (inductor's convolution is slower):
    the same float32 result as the convolution eager, up to the order of the sums, also for
    an image side that is no multiple of the patch (the convolution drops the remainder)."""
    embeddings = model.vision.vision_model.embeddings
    traced = torch.compile(embeddings, backend='eager', fullgraph=True)
    side = model.config.vision.image_size
    for extra in (0, 3):
        images = torch.rand(3, 3, side + extra, side + extra) * 2 - 1
        torch.testing.assert_close(traced(images), embeddings(images), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


@torch.no_grad()
def test_a_large_mlp_runs_in_row_blocks_with_one_calls_result(monkeypatch):
    """A gated activation of MLP_SPLIT_VALUES or more runs in calls of at most MLP_ROW_BLOCK
    rows (oneDNN's faster kernel for pi05's gate/up product); rows are independent, so the
    output is one call's (float32 here: up to rounding)."""
    from oxygen_ros.model import gemma
    from oxygen_ros.model.config import GemmaConfig

    mlp = gemma.GemmaMLP(GemmaConfig(32, 1, 64, 2, 1, 16)).eval()
    mlp.fuse()
    x = torch.randn(2, 350, 32)
    whole = mlp(x)
    calls = []
    gated = mlp._gated
    monkeypatch.setattr(mlp, '_gated', lambda block: calls.append(tuple(block.shape))
                        or gated(block))
    monkeypatch.setattr(gemma, 'MLP_SPLIT_VALUES', 700 * 2 * 64)    # x's 700 rows split
    torch.testing.assert_close(mlp(x), whole)
    assert calls == [(1, 234, 32), (1, 234, 32), (1, 232, 32)]     # ceil(700 / 288) calls
    calls.clear()
    monkeypatch.setattr(gemma, 'MLP_SPLIT_VALUES', 1)
    mlp(x[:, :144])                                                 # 288 rows: one call
    mlp(x[:, :145])                                                 # 290: two
    assert calls == [(2, 144, 32), (1, 145, 32), (1, 145, 32)]
