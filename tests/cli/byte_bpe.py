"""Test helpers: a byte-level BPE tokenizer built with the `tokenizers` library whose tokens split multi-byte UTF-8
characters (CJK, accents, 4-byte emoji) in several ways, and a `.colibri` file whose greedy output is a chain of
token ids chosen by the test (so `colibri infer` generates exactly the text a test wants).

The chain model: every layer adds nothing to the residual (attention output projection and experts are zero), so
the last hidden state is the token's own embedding, random unit-RMS vectors; the LM head row of token s is the sum
of the embeddings of the tokens whose successor is s (scaled), so greedy decoding follows `successor`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# The GPT-2 byte <-> printable-character map that the ByteLevel pre-tokenizer and decoder use.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]


def _byte_chars() -> dict[int, str]:
    chars, extra = {b: chr(b) for b in _PRINTABLE}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


BYTE_CHAR = _byte_chars()

# Merges (left bytes, right bytes), in priority order. Each one makes a token that ends or begins inside a
# character: '"' with the first byte of the euro sign, the last two bytes of the euro sign alone, the first two
# bytes of a CJK character, its last byte with the next character's first byte, an accent's lead byte after an
# ASCII letter, the halves of a 4-byte emoji and the last byte of one emoji with the first of the next.
SPLIT_MERGES: list[tuple[bytes, bytes]] = [
    (b'"', b"\xe2"), (b"\x82", b"\xac"),                      # " + first byte of €  |  rest of €
    (b"\xe4", b"\xb8"), (b"\xad", b"\xe6"),                   # 中 = e4 b8 ad; 文 = e6 96 87
    (b"\x96", b"\x87"), (b"\xe5", b"\xad"),                   # 字 = e5 ad 97
    (b"f", b"\xc3"), (b"\xa9", b" "),                         # café = 63 61 66 c3 a9
    (b"\xf0", b"\x9f"), (b"\x98", b"\x80"), (b"\x80", b"\xf0"),  # 😀 = f0 9f 98 80
    (b"\x8e", b"\x89"),                                       # 🎉 = f0 9f 8e 89
]


def byte_level_bpe(merges: list[tuple[bytes, bytes]] = SPLIT_MERGES):
    """A `tokenizers.Tokenizer`: the 256 single-byte tokens (id = byte value), then one token per merge."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    def text(raw: bytes) -> str:
        return "".join(BYTE_CHAR[b] for b in raw)

    vocab = {BYTE_CHAR[b]: b for b in range(256)}
    for left, right in merges:
        vocab.setdefault(text(left + right), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(text(a), text(b)) for a, b in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def token_bytes(tok, token: int) -> bytes:
    """The bytes token `token` stands for."""
    inverse = {c: b for b, c in BYTE_CHAR.items()}
    return bytes(inverse[c] for c in tok.id_to_token(token))


def splits_a_character(tok, ids: list[int]) -> bool:
    """True when some token of `ids` holds only part of a character's bytes."""
    return any("\ufffd" in tok.decode([i]) for i in ids)


def chain(ids: list[int], start: int) -> dict[int, int]:
    """successor: start -> ids[0] -> ids[1] -> ... -> ids[-1] -> ids[0] (a cycle); a token met again keeps its
    first successor."""
    successor: dict[int, int] = {}
    for a, b in zip([start, *ids], [*ids, ids[0]]):
        successor.setdefault(a, b)
    return successor


def write_chain_model(path: str | Path, tok, successor: dict[int, int], *, hidden: int = 128, seed: int = 0) -> str:
    """A `.colibri` file embedding `tok` whose greedy decoding goes from each token t to successor[t]."""
    from colibri_format import spec as S
    from colibri_format.synthetic import synthetic_metadata, synthetic_model
    from colibri_format.writer import ColibriWriter

    vocab = tok.get_vocab_size()
    model = synthetic_model(vocab=vocab, hidden=hidden, layers=1, heads=4, kv_heads=2, experts=2, top_k=1,
                            expert_inter=16)
    rng = np.random.default_rng(seed)
    embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
    embed /= np.sqrt((embed ** 2).mean(axis=1, keepdims=True))            # unit RMS: the final norm keeps it
    head = np.zeros((vocab, hidden), np.float32)
    for t, s in successor.items():
        head[s] += 10.0 * embed[t]
    fmt = S.ExpertFormat.F32
    with ColibriWriter(path, model, dense_dtype=S.DType.F32, expert_format=fmt) as w:
        for t in w.plan.dense:
            if t.name == "embed_tokens":
                value = embed
            elif t.name == "lm_head":
                value = head
            elif t.name.endswith("norm"):
                value = np.ones(t.shape, np.float32)
            elif t.name.endswith("o_proj"):
                value = np.zeros(t.shape, np.float32)                      # attention adds nothing
            else:
                value = (rng.standard_normal(t.shape) * 0.05).astype(np.float32)
            w.write_dense(t.name, value)
        for layer, e in w.plan.blob_keys():                                # experts add nothing
            w.write_expert(layer, e, {a.name: np.zeros(a.shape, np.float32) for a in w.plan.blob.arrays})
        meta = synthetic_metadata(model, fmt, S.DType.F32)
        meta["tokenizer"] = {"tokenizer_json": tok.to_str(), "tokenizer_config": {},
                             "generation_config": {}}
        w.finalize(meta)
    return str(path)
