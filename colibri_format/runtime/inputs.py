"""Checks on what a caller hands an engine; shared by the NumPy and CUDA engines so both reject alike."""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence

import numpy as np

from colibri_format.errors import (BatchTooLarge, EmptyInput, InvalidInput, SequenceTooLong,
                                   TokenIdOutOfRange)


def check_ids(seq: object, vocab_size: int, max_seq_len: int, index: int = 0) -> np.ndarray:
    """One sequence of token ids -> int64 array [n], or a precise error."""
    if isinstance(seq, (str, bytes)) or not isinstance(seq, (Sequence, np.ndarray)):
        raise InvalidInput(f"sequence {index} must be a list of token ids", field=f"batch[{index}]",
                           value=type(seq).__name__)
    arr = np.asarray(seq)
    if arr.size == 0:
        raise EmptyInput(f"sequence {index} has no token ids", field=f"batch[{index}]")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TokenIdOutOfRange(f"sequence {index} must hold integer token ids", field=f"batch[{index}]",
                                value=seq if arr.ndim != 1 else arr.dtype.name)
    if len(arr) > max_seq_len:
        raise SequenceTooLong(f"sequence {index} has {len(arr)} tokens, over max_seq_len={max_seq_len}",
                              field=f"batch[{index}]", value=len(arr))
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        raise TokenIdOutOfRange(f"token id at position {bad[0]} of sequence {index} is outside "
                                f"[0, {vocab_size})", field=f"batch[{index}][{bad[0]}]", value=int(arr[bad[0]]))
    return arr.astype(np.int64)


def check_batch(batch: object, vocab_size: int, max_batch_size: int, max_seq_len: int) -> list[np.ndarray]:
    """A batch (a list of token id lists) -> one int64 array per sequence, or a precise error."""
    if isinstance(batch, (str, bytes)) or not isinstance(batch, (Sequence, np.ndarray)):
        raise InvalidInput("a batch must be a list of token id lists", field="batch", value=type(batch).__name__)
    if len(batch) == 0:
        raise EmptyInput("the batch holds no sequences", field="batch")
    if all(isinstance(x, (int, np.integer)) for x in batch):
        raise InvalidInput("a batch must be a list of token id lists, not one flat list (wrap it: [ids])",
                           field="batch")
    if len(batch) > max_batch_size:
        raise BatchTooLarge(f"{len(batch)} sequences, over max_batch_size={max_batch_size}", field="batch",
                            value=len(batch))
    return [check_ids(seq, vocab_size, max_seq_len, i) for i, seq in enumerate(batch)]


def prompt_ids(prompt: Sequence[int] | str, tokenizer, vocab_size: int, max_seq_len: int) -> np.ndarray:
    """A generate() prompt: token ids, or text encoded with the file's tokenizer (after the cheap size bound)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidInput("a text prompt needs a tokenizer, and this file embeds none", field="prompt")
        check_text_fits(prompt, tokenizer, max_seq_len)
        prompt = tokenizer.encode(prompt)
    return check_ids(prompt, vocab_size, max_seq_len)


# --- a cheap bound before tokenizing ----------------------------------------------------------------------------
# Tokenizing costs about 200 bytes of memory and 1 us per byte of text (a 5 MB prompt: 1 GB, 4 s), so a text that
# cannot fit in max_seq_len tokens is refused on its size first: one token stands for at most as many bytes as
# the vocabulary's longest entry (times a margin for normalizers that merge characters, NFC/NFKC). Vocabularies
# where one token may stand for a run of any length (an unknown-word token: WordLevel, WordPiece, fused
# unknowns) or whose normalizer may delete text have no such bound: their texts are tokenized as before.
NORMALIZER_MARGIN = 2
_DELETING_NORMALIZERS = frozenset({"StripAccents", "Strip", "Replace", "BertNormalizer", "Precompiled"})
_per_token_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_bytes_per_token(tokenizer) -> int | None:
    """The most UTF-8 bytes of text one token of `tokenizer` (runtime.tokenizer.Tokenizer) can stand for, or
    None when there is no such bound. Computed once per tokenizer."""
    try:
        return _per_token_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    bound = _max_bytes_per_token(getattr(tokenizer, "library_tokenizer", tokenizer))
    try:
        _per_token_cache[tokenizer] = bound
    except TypeError:            # not weakly referenceable: not cached
        pass
    return bound


def _max_bytes_per_token(hf) -> int | None:
    try:
        model = hf.model
        kind = type(model).__name__
        normalizer = json.loads(hf.normalizer.__getstate__()) if hf.normalizer is not None else {}
        vocab = hf.get_vocab(with_added_tokens=True)
    except Exception:            # noqa: BLE001 - not a `tokenizers` tokenizer: no bound
        return None
    if kind in ("WordLevel", "WordPiece", "Unigram") or (getattr(model, "unk_token", None) is not None
                                                        and getattr(model, "fuse_unk", False)):
        return None
    if _normalizer_types(normalizer) & _DELETING_NORMALIZERS:
        return None
    longest = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=0)
    return max(4, longest) * NORMALIZER_MARGIN


def _normalizer_types(state) -> set[str]:
    types: set[str] = set()
    stack = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                types.add(node["type"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return types


def check_text_fits(text: str, tokenizer, max_seq_len: int, field: str = "prompt", what: str | None = None) -> None:
    """Refuse, before tokenizing it, a text too big for max_seq_len tokens of `tokenizer` (see above).

    Raises:
        SequenceTooLong: the text holds more bytes than max_seq_len tokens can stand for.
    """
    per_token = max_bytes_per_token(tokenizer)
    if per_token is None:
        return
    limit = max_seq_len * per_token
    if 4 * len(text) <= limit:   # at most 4 bytes a character: most texts stop here, nothing encoded
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise SequenceTooLong(f"the {what or field} is {size:,} bytes, more than max_seq_len={max_seq_len} tokens "
                              f"can hold (at most {per_token} bytes a token in this vocabulary); it was not "
                              "tokenized", field=field, value=size)


# --- text prompts -------------------------------------------------------------------------------------------
MAX_PROMPT_BYTES = 64 << 20     # a prompt file or standard input; far above any max_seq_len


def utf8_text(value: str | bytes, field: str = "prompt", what: str | None = None) -> str:
    """`value` as text, refused unless it is valid UTF-8.

    Bytes are decoded strictly. A str may carry the undecodable bytes of a command line as lone surrogates
    (Python's surrogateescape); those are refused too. The error names the offset of the first bad byte;
    `what` names the text in it (default: `field`).
    """
    what = what or field
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError as exc:
            try:
                raw = value.encode("utf-8", "surrogateescape")          # back to the bytes the user gave
            except UnicodeEncodeError:
                offset = len(value[:exc.start].encode("utf-8", "surrogatepass"))
                raise InvalidInput(f"{what} is not valid UTF-8 (a lone surrogate)", field=field,
                                   value=value[exc.start:exc.start + 1], offset=offset) from None
    else:
        raw = bytes(value)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{what} is not valid UTF-8 (byte 0x{raw[exc.start]:02x})", field=field,
                           value=raw[exc.start:exc.start + 8], offset=exc.start) from None


def read_text(source, field: str, what: str, limit: int = MAX_PROMPT_BYTES) -> str:
    """A prompt read whole from a path or a binary stream (standard input), checked as UTF-8; `what` names it
    in errors ("the prompt file")."""
    try:
        if hasattr(source, "read"):
            raw = source.read(limit + 1)
        else:
            with open(source, "rb") as fh:
                raw = fh.read(limit + 1)
    except OSError as exc:
        raise InvalidInput(f"cannot read {what}: {exc.strerror}", field=field,
                           value=None if hasattr(source, "read") else str(source)) from None
    if len(raw) > limit:
        raise InvalidInput(f"{what} is over {limit} bytes", field=field, value=len(raw))
    return utf8_text(raw, field, what)
