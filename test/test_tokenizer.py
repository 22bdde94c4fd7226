"""PaliGemma tokenizer wrapper: π0.5 prompt format, padding, truncation, streaming decode."""

import logging

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest
import sentencepiece

from oxygen_ros.model.tokenizer import (BOS_ID, discretize_state, EOS_ID, PAD_ID,
                                        PaligemmaTokenizer, pi05_prompt, train_tiny_tokenizer,
                                        UNK_ID)


@pytest.fixture(scope='module')
def sp_path(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp('sp'), vocab_size=512)


@pytest.fixture(scope='module')
def tok(sp_path):
    return PaligemmaTokenizer(sp_path, max_len=64)


def real_ids(tokens, mask):
    return tokens[mask].tolist()


def test_tiny_tokenizer_ids_and_size(tmp_path, sp_path, tok):
    assert tok.vocab_size == 512
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (BOS_ID, EOS_ID, PAD_ID) == (2, 1, 0)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_path))
    assert (sp.pad_id(), sp.unk_id()) == (PAD_ID, UNK_ID)
    # Cached by parameters, deterministic across fresh trainings.
    assert train_tiny_tokenizer(sp_path.parent, vocab_size=512) == sp_path
    again = train_tiny_tokenizer(tmp_path, vocab_size=512)
    assert again.read_bytes() == sp_path.read_bytes()
    other = train_tiny_tokenizer(tmp_path, vocab_size=1024)
    assert PaligemmaTokenizer(other).vocab_size == 1024


def test_tiny_tokenizer_rejects_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match='too small'):
        train_tiny_tokenizer(tmp_path, vocab_size=100)


def test_byte_fallback_round_trips_any_text(tok):
    for text in ('pick up the red block', 'Grüße, 机器人! ☃ tab\there', '  two  spaces '):
        assert tok.decode(tok._sp.encode(text)) == text


def test_discrete_state_prompt_format(tok):
    state = np.array([-1.0, -0.999, 0.0, 0.5, 0.99999, 1.0, -1.5, 2.0])
    assert discretize_state(state).tolist() == [0, 0, 128, 192, 255, 255, -1, 255]
    tokens, mask = tok.encode_prompt('  pick_up the\nblock ', state)
    assert tokens.dtype == np.int32 and mask.dtype == bool and tokens.shape == mask.shape == (64,)
    ids = real_ids(tokens, mask)
    assert ids[0] == BOS_ID
    expected = 'Task: pick up the block, State: 0 0 128 192 255 255 -1 255;\nAction: '
    assert pi05_prompt('  pick_up the\nblock ', state) == expected
    assert tok.decode(ids) == expected
    # split_digits: every digit of the state bins is its own token.
    pieces = [tok.piece(i) for i in ids]
    assert pieces.count('9') == 1 and pieces.count('5') == 6


def test_prompt_without_state(tok):
    tokens, mask = tok.encode_prompt('open_the drawer\n')
    ids = real_ids(tokens, mask)
    assert ids[0] == BOS_ID
    assert ids[-len(tok._sp.encode('\n')):] == tok._sp.encode('\n')
    assert tok.decode(ids) == 'open the drawer\n'


def test_right_padding_and_mask(tok):
    tokens, mask = tok.encode_prompt('stack the cups', np.zeros(3))
    n = int(mask.sum())
    assert 0 < n < tok.max_len
    assert mask[:n].all() and not mask[n:].any()
    assert (tokens[n:] == 0).all() and (tokens[:n] != 0).all()


def test_truncation_warns_with_count(sp_path, caplog):
    short = PaligemmaTokenizer(sp_path, max_len=10)
    full = PaligemmaTokenizer(sp_path, max_len=1000).prompt_ids('pick up the red block',
                                                                np.linspace(-1, 1, 14))
    with caplog.at_level(logging.WARNING, logger='oxygen_ros.model.tokenizer'):
        tokens, mask = short.encode_prompt('pick up the red block', np.linspace(-1, 1, 14))
    assert mask.all() and tokens.tolist() == full[:10]
    assert f'truncated {len(full) - 10} tokens' in caplog.text


def test_exact_length_does_not_warn(sp_path, caplog):
    n = len(PaligemmaTokenizer(sp_path).prompt_ids('lift the mug'))
    exact = PaligemmaTokenizer(sp_path, max_len=n)
    with caplog.at_level(logging.WARNING):
        _, mask = exact.encode_prompt('lift the mug')
    assert mask.all() and 'truncated' not in caplog.text


def test_bad_state_is_rejected(tok):
    with pytest.raises(ValueError, match='NaN'):
        tok.encode_prompt('x', np.array([0.0, np.nan]))
    with pytest.raises(ValueError, match='1-D'):
        tok.encode_prompt('x', np.zeros((2, 2)))
    with pytest.raises(TypeError, match='prompt must be str'):
        tok.encode_prompt(b'x')


def test_decode_delta_concatenates_to_full_decode(tok):
    text = 'I see a red block, Grüße ☃ and 42 cups.'
    ids = tok._sp.encode(text) + [EOS_ID]
    for step in (1, 2, 3):
        pieces, shown = [], 0
        for end in range(step, len(ids) + step, step):
            end = min(end, len(ids))
            pieces.append(tok.decode_delta(ids[:end], shown, final=end == len(ids)))
            shown = end
        assert ''.join(pieces) == tok.decode(ids) == text
        # next_delta, fed the text it returned last time, gives the same deltas: what the
        # engine's output processor keeps per request instead of decoding the old ids again.
        text_so_far, deltas = '', []
        for end in range(step, len(ids) + step, step):
            end = min(end, len(ids))
            delta, text_so_far = tok.next_delta(ids[:end], text_so_far, final=end == len(ids))
            deltas.append(delta)
        assert deltas == pieces and text_so_far == text


def test_decode_delta_holds_back_partial_characters(tok):
    ids = tok._sp.encode('☃')
    assert len(ids) == 3  # three UTF-8 byte pieces
    assert tok.decode_delta(ids[:1], 0) == ''
    assert tok.decode_delta(ids[:2], 1) == ''
    assert tok.decode_delta(ids, 2) == '☃'
    with pytest.raises(ValueError):
        tok.decode_delta(ids, 5)


def test_decode_accepts_arrays_and_out_of_range_ids(tok):
    import torch
    ids = tok._sp.encode('push the plate')
    assert tok.decode(np.array(ids)) == tok.decode(torch.tensor(ids)) == 'push the plate'
    assert tok.decode([10_000]) == tok.decode([UNK_ID])


def test_missing_model_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        PaligemmaTokenizer(tmp_path / 'nope.model')


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(exclude_categories=('Cs',)), max_size=40),
       st.lists(st.floats(-1.2, 1.2), max_size=14))
def test_any_prompt_decodes_to_the_openpi_string(tok, text, state):
    state = np.array(state)
    ids = tok.prompt_ids(text, state)
    assert ids[0] == BOS_ID
    assert tok.decode(ids) == pi05_prompt(text, state)
