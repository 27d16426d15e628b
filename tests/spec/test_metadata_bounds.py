"""Metadata of pathological shape within the byte cap: refused by its element count before any parsing, in bounded
time and memory; real-shaped metadata well inside the bound is accepted; the writer never writes what a reader
refuses."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from colibri_format import spec as S
from colibri_format.errors import InvalidMetadata
from colibri_format.spec.metadata import decode_metadata, encode_metadata


def test_many_tiny_elements_are_refused_before_parsing():
    n = 4 * S.MAX_JSON_ELEMENTS                          # 12 MiB: far under MAX_METADATA_BYTES
    raw = ('{"x":[' + ",".join(["{}"] * n) + "]}").encode()
    assert len(raw) < S.MAX_METADATA_BYTES
    tracemalloc.start()
    t0 = time.process_time()             # CPU seconds: other jobs on a loaded machine stretch only the wall clock
    with pytest.raises(InvalidMetadata, match="JSON elements") as exc:
        decode_metadata(raw, offset=4096)
    seconds = time.process_time() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert exc.value.field == "metadata" and exc.value.offset == 4096 and exc.value.value > S.MAX_JSON_ELEMENTS
    assert peak < 4 * len(raw) and seconds < 5          # parsing it would build millions of dicts


def test_commas_and_brackets_inside_strings_do_not_count():
    text = "x,[{" * (S.MAX_JSON_ELEMENTS // 2)         # an embedded tokenizer.json is one long string like this
    assert decode_metadata(encode_metadata({"tokenizer": {"tokenizer_json": text}}))["tokenizer"]["tokenizer_json"] \
        == text
    escaped = {"s": '\\",[' * 1000}                     # escaped quotes do not end the string
    assert decode_metadata(encode_metadata(escaped)) == escaped


@pytest.mark.parametrize("n,ok", [(S.MAX_JSON_ELEMENTS // 3, True), (S.MAX_JSON_ELEMENTS, False)])
def test_the_bound_is_exact_and_the_writer_agrees(n, ok):
    meta = {"per_expert": [[0, 1, 0.5]] * (n // 4)}     # each row: one array and three members
    if ok:
        assert decode_metadata(encode_metadata(meta)) == meta
    else:
        with pytest.raises(InvalidMetadata, match="JSON elements"):
            encode_metadata(meta)
