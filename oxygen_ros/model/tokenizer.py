"""PaliGemma SentencePiece tokenizer with π0.5 prompt formatting, plus a tiny offline trainer."""

from __future__ import annotations

import hashlib
import io
import itertools
import logging
import os
from pathlib import Path
import tempfile
from typing import Iterable, Sequence

import numpy as np
import sentencepiece

logger = logging.getLogger(__name__)

# PaliGemma's special ids (our tiny tokenizers use the same ones).
PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3

STATE_BINS = 256  # π0.5 discretises each normalised state value into 256 bins over [-1, 1)


def clean_prompt(text: str) -> str:
    """Normalise an instruction the way openpi does before tokenising."""
    return text.strip().replace('_', ' ').replace('\n', ' ')


def discretize_state(state: np.ndarray) -> np.ndarray:
    """Map a normalised state [S] to bin ids [S] (256 bins over [-1, 1]).

    Values below -1 give -1 and values >= 1 give 255, exactly as openpi (no clipping).
    """
    edges = np.linspace(-1.0, 1.0, STATE_BINS + 1)[:-1]  # [256] left bin edges
    return np.digitize(state, bins=edges) - 1


def pi05_prompt(text: str, state: np.ndarray) -> str:
    """Return the π0.5 discrete-state prompt string (before BOS is added)."""
    state_ids = ' '.join(str(int(b)) for b in discretize_state(state))
    return f'Task: {clean_prompt(text)}, State: {state_ids};\nAction: '


def _as_id_list(ids) -> list[int]:
    """Turn a list / numpy array / torch tensor of ids into a list of Python ints."""
    if hasattr(ids, 'tolist'):
        ids = ids.tolist()
    return [int(i) for i in ids]


def _stable_text(text: str) -> str:
    """Drop trailing U+FFFD: the bytes of a character that later tokens may still complete."""
    return text.rstrip('\ufffd')


class PaligemmaTokenizer:
    """SentencePiece tokenizer producing fixed-length, right-padded π0.5 prompts."""

    def __init__(self, model_path: str | os.PathLike, max_len: int = 200):
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f'SentencePiece model not found: {path}')
        if max_len < 1:
            raise ValueError(f'max_len must be >= 1, got {max_len}')
        self.model_path = path
        self.max_len = max_len
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.truncations = 0                 # prompts cut to max_len so far
        self._warned_texts: set[str] = set()  # instructions already warned about

    @property
    def vocab_size(self) -> int:
        """Number of ids the SentencePiece model defines."""
        return self._sp.vocab_size()

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (2 for PaliGemma)."""
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        """End-of-sequence id (1 for PaliGemma); generation stops on it."""
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        """Id written into padded prompt positions: always 0, as openpi pads."""
        return PAD_ID

    def text_piece_ids(self) -> list[int]:
        """Ids of ordinary text pieces (no control, unknown, byte or unused pieces)."""
        sp = self._sp
        return [i for i in range(sp.vocab_size())
                if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)
                        or sp.is_unused(i) or sp.id_to_piece(i).startswith('<unused'))]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Encode plain text (no prompt formatting, no padding)."""
        return list(self._sp.encode(text, add_bos=add_bos)) if text else []

    def prompt_ids(self, text: str, state: np.ndarray | None = None) -> list[int]:
        """Token ids of the full prompt, BOS first, before truncation and padding."""
        if not isinstance(text, str):
            raise TypeError(f'prompt must be str, got {type(text).__name__}')
        if state is None:
            # Without discrete state (pi0 format / pi05_libero): "\n" marks the start of answer.
            return (self._sp.encode(clean_prompt(text), add_bos=True)
                    + self._sp.encode('\n'))
        state = np.asarray(state)
        if state.ndim != 1 or not np.issubdtype(state.dtype, np.number):
            raise ValueError(
                f'state must be a 1-D numeric vector, got dtype {state.dtype} shape {state.shape}')
        if not np.all(np.isfinite(state)):
            raise ValueError(f'state contains NaN or inf: {state}')
        return self._sp.encode(pi05_prompt(text, state), add_bos=True)

    def encode_prompt(self, text: str, state: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Return (tokens int32 [max_len], mask bool [max_len]), right-padded with 0 / False.

        state: normalised state [S] in [-1, 1] for π0.5's discrete-state prompt, or None.
        """
        ids = self.prompt_ids(text, state)
        if len(ids) > self.max_len:
            # The same instruction comes every frame: warn once per text, count every time.
            self.truncations += 1
            log = logger.debug if text in self._warned_texts else logger.warning
            if len(self._warned_texts) < 256:
                self._warned_texts.add(text)
            log('prompt has %d tokens but max_len is %d: truncated %d tokens '
                '(raise max_token_len if this happens often)',
                len(ids), self.max_len, len(ids) - self.max_len)
            ids = ids[:self.max_len]
        tokens = np.full(self.max_len, PAD_ID, dtype=np.int32)  # [L]
        mask = np.zeros(self.max_len, dtype=bool)  # [L]
        tokens[:len(ids)] = ids
        mask[:len(ids)] = True
        return tokens, mask

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text; control ids decode to '', ids outside the vocab to unk."""
        ids = _as_id_list(ids)
        n = self._sp.vocab_size()
        unk = self._sp.unk_id()
        # A model whose vocab is larger than the tokenizer's may emit ids we cannot map.
        return self._sp.decode([i if 0 <= i < n else unk for i in ids])

    def decode_delta(self, all_ids: Sequence[int], n_old: int, final: bool = False) -> str:
        """Return the text added by all_ids[n_old:] given that all_ids[:n_old] was shown.

        Text is decoded as a whole and differenced, so SentencePiece's leading-space handling and
        multi-token characters come out right. A character whose bytes are still incomplete is
        held back (it appears in a later delta) unless final is True. Concatenating the deltas
        of a stream, with final=True on the last, gives decode(all_ids).
        """
        all_ids = _as_id_list(all_ids)
        if not 0 <= n_old <= len(all_ids):
            raise ValueError(f'n_old={n_old} outside [0, {len(all_ids)}]')
        return self.next_delta(all_ids, _stable_text(self.decode(all_ids[:n_old])), final)[0]

    def next_delta(self, all_ids: Sequence[int], shown: str, final: bool = False
                   ) -> tuple[str, str]:
        """Return (delta, text) for a stream whose shown text so far is `shown`.

        `shown` is the `text` this returned for the stream's previous ids ('' for none), so a
        caller that keeps it decodes each request's ids once per step instead of twice;
        decode_delta(ids, n_old) == next_delta(ids, <text of ids[:n_old]>)[0]. With final, text
        is decode(all_ids).
        """
        new = self.decode(all_ids)
        if not final:
            new = _stable_text(new)
        if new.startswith(shown):
            return new[len(shown):], new
        # Should not happen with SentencePiece; fall back to the text after the common prefix.
        common = len(os.path.commonprefix([shown, new]))
        logger.debug('decode_delta: old text is not a prefix of new text (%r, %r)', shown, new)
        return new[common:], new

    def piece(self, token_id: int) -> str:
        """Return the SentencePiece piece string of one id (for debugging)."""
        return self._sp.id_to_piece(int(token_id))


# ---------------------------------------------------------------------------------------------
# Tiny offline tokenizer for tests and random-weight demos.

_VERBS = ('pick up', 'put', 'place', 'open', 'close', 'push', 'pull', 'move', 'turn on',
          'turn off', 'stack', 'grasp', 'lift', 'slide', 'fold', 'wipe', 'pour', 'hand over')
_OBJECTS = ('the red block', 'the blue cup', 'the black bowl', 'the top drawer', 'the towel',
            'the pen', 'the mug', 'the sponge', 'the plate', 'the ketchup bottle',
            'the cream cheese', 'the alphabet soup', 'the stove', 'the microwave door',
            'the green cube', 'the yellow marker')
_PLACES = ('on the plate', 'in the basket', 'on the shelf', 'into the drawer', 'next to the sink',
           'on top of the cabinet', 'to the left', 'to the right', 'behind the box',
           'on the table')
_EXTRA = ('What do you see? I see a robot arm and a table.',
          'The gripper is open. The gripper is closed.',
          'Done! Next, move slowly (carefully) - then stop; ok.',
          'Describe the scene: objects, colors, positions.')

# Bump when the corpus or trainer options change, so cached files are not reused.
_TINY_VERSION = 1


def _tiny_corpus() -> list[str]:
    """Return a deterministic English robot-instruction corpus (a few thousand lines)."""
    lines = [f'{v} {o} {p}' for v, o, p in itertools.product(_VERBS, _OBJECTS, _PLACES)]
    prompts = []
    for i, line in enumerate(lines[::11]):
        state = ' '.join(str((i * 37 + j * 11) % STATE_BINS) for j in range(8))
        prompts.append(f'Task: {line}, State: {state};\nAction: ')
    return lines + prompts + list(_EXTRA)


def _sp_train(lines: Sequence[str], vocab_size: int, n_unused: int) -> bytes:
    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
        model_type='bpe', byte_fallback=True, character_coverage=1.0,
        pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
        # A small corpus cannot fill a large vocab; let BPE stop early.
        hard_vocab_limit=False,
        # Exact round trips (decode(encode(x)) == x), digits one per piece like Gemma.
        normalization_rule_name='identity', remove_extra_whitespaces=False,
        add_dummy_prefix=False, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=[f'<unused{i}>' for i in range(n_unused)],
        num_threads=1, minloglevel=2)
    return buf.getvalue()


def train_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512,
                         text: Sequence[str] | None = None) -> Path:
    """Train (or reuse) a small SentencePiece model with PaliGemma's special ids; return its path.

    BPE with byte fallback, so any text encodes. The vocab is filled to exactly vocab_size with
    '<unusedN>' pieces (as PaliGemma has), so every id a model with that vocab emits decodes.
    Deterministic; files are cached in out_dir by vocab size and corpus hash.
    """
    lines = list(text) if text is not None else _tiny_corpus()
    if not lines or not all(isinstance(s, str) for s in lines):
        raise ValueError('text must be a non-empty sequence of strings')
    # Minimum: pad/eos/bos/unk + 256 byte pieces + every distinct character of the corpus.
    min_vocab = 4 + 256 + len(set(''.join(lines)))
    if vocab_size < min_vocab:
        raise ValueError(f'vocab_size={vocab_size} too small for this corpus: need >= {min_vocab} '
                         '(4 special + 256 byte pieces + its characters)')
    digest = hashlib.sha256('\n'.join(lines).encode()).hexdigest()[:12]
    out_dir = Path(out_dir)
    path = out_dir / f'tiny_sp_v{_TINY_VERSION}_{vocab_size}_{digest}.model'
    if path.is_file():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)

    natural = sentencepiece.SentencePieceProcessor(
        model_proto=_sp_train(lines, vocab_size, 0)).vocab_size()
    proto = _sp_train(lines, vocab_size, vocab_size - natural)
    got = sentencepiece.SentencePieceProcessor(model_proto=proto).vocab_size()
    if got > vocab_size:
        raise RuntimeError(f'trained vocab {got} exceeds requested {vocab_size}')

    # Write atomically: concurrent test workers may train the same file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix='.tmp')
    with os.fdopen(fd, 'wb') as f:
        f.write(proto)
    os.replace(tmp, path)
    return path
