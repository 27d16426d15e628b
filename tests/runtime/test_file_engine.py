"""End to end through real `.colibri` files: HF checkpoint -> `convert()` -> reader -> Engine(path).

The checkpoint is converted by the real pipeline (`colibri_format.convert.pipeline.convert`, what
`colibri convert` runs). A float32 file without quantization must match transformers as closely as
test_fidelity.py asks (<= 1e-4 relative logit error) and generate the same greedy tokens. Int8 experts: the
documented bound is INT8_LOGIT_TOL relative logit error on these tiny models with float32/float16 dense
tensors (measured <= 8.5e-3 for every supported architecture, per-row and groups of 16) and
INT8_BF16_LOGIT_TOL with bfloat16 dense tensors (measured <= 1.7e-2). Greedy agreement is checked
teacher-forced on transformers' own greedy continuation: the argmax must agree wherever transformers' top-1
margin exceeds SAFE_MARGIN, and at >= 90% of all positions (a near-tie may flip, which is expected).
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.convert.pipeline import convert
from colibri_format.errors import CorruptExpert, InvalidInput
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime.infer import run_infer
from tests.runtime.hf_tiny import ARCHS, build_hf, hf_logits, prompts, rel_err
from tests.runtime.numpy_tiny import random_weights, tokenizer_entry
from tests.runtime.tiny_weights import write_colibri

INT8_LOGIT_TOL = 2e-2
INT8_BF16_LOGIT_TOL = 3e-2
SAFE_MARGIN = 0.1
FILES = {  # name: (convert options, relative logit bound)
    "f32": (dict(dtype="float32", quantize="none"), 1e-4),
    "int8-f16": (dict(dtype="float16", quantize="expert"), INT8_LOGIT_TOL),
    "int8g16-f32": (dict(dtype="float32", quantize="expert", group_size=16), INT8_LOGIT_TOL),
    "int8-bf16": (dict(dtype="bfloat16", quantize="expert"), INT8_BF16_LOGIT_TOL),
}


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, tmp_path_factory):
    hf = build_hf(request.param)
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out / "hf")
    files = {name: out / f"{name}.colibri" for name in FILES}
    for name, (options, _) in FILES.items():
        convert(out / "hf", files[name], workers=1, **options)
    return hf, files


def greedy_reference(hf, prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(int(hf_logits(hf, ids)[-1].argmax()))
        ids.append(out[-1])
    return out


def test_float32_file_matches_transformers(converted):
    hf, files = converted
    batch = prompts(96, [11, 4], seed=5)
    with Engine(files["f32"], EngineConfig(verify="always")) as engine:
        for ids, logits in zip(batch, engine.logits(batch)):
            assert rel_err(logits, hf_logits(hf, ids)) < FILES["f32"][1]
        assert engine.generate(batch[0], max_new_tokens=6, stop_ids=[]).output_ids == \
            greedy_reference(hf, batch[0], 6)


@pytest.mark.parametrize("name", ["int8-f16", "int8g16-f32", "int8-bf16"])
def test_int8_file_stays_within_the_documented_bound(converted, name):
    hf, files = converted
    prompt = prompts(96, [11], seed=5)[0]
    ids = prompt + greedy_reference(hf, prompt, 6)
    ref = hf_logits(hf, ids)
    with Engine(files[name]) as engine:
        got = engine.logits([ids])[0]
    assert rel_err(got, ref) < FILES[name][1]
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] > SAFE_MARGIN
    agree = got.argmax(-1) == ref.argmax(-1)
    assert agree[decisive].all() and agree.mean() >= 0.9


@pytest.fixture
def small_file(tmp_path):
    weights = random_weights()
    weights.metadata = {"architecture": "mixtral", "tokenizer": tokenizer_entry()}
    weights.dense["embed_tokens"] = weights.dense["embed_tokens"][:10]     # vocab of the test tokenizer
    weights.dense["lm_head"] = weights.dense["lm_head"][:10]
    weights.model["vocab_size"] = 10
    return write_colibri(weights, tmp_path / "small.colibri")


def _corrupt_expert(path, layer: int, expert: int) -> None:
    import colibri_format

    with colibri_format.open(path, verify="never") as f:
        offset = f.blob_offset(layer, expert)
    with open(path, "r+b") as fh:
        fh.seek(offset + 3)
        byte = fh.read(1)
        fh.seek(offset + 3)
        fh.write(bytes([byte[0] ^ 0xFF]))


def _routed(engine, batch) -> set:
    """(layer, expert) pairs the router picks for `batch`, through the engine's route observers."""
    seen: set = set()
    engine.routes.observers.append(lambda step, seq, layer, ids, pos: seen.update((layer, int(e)) for e in ids.ravel()))
    engine.infer(batch)
    return seen


@pytest.mark.parametrize("max_cached", [None, 4])      # resident (read in place) and paged
def test_a_corrupt_expert_fails_only_when_routed(small_file, max_cached):
    config = EngineConfig(max_cached_experts=max_cached)
    with Engine(small_file, config) as engine:
        routed = _routed(engine, [[1, 2, 3]])
    unrouted = next((0, e) for e in range(8) if (0, e) not in routed)
    _corrupt_expert(small_file, *unrouted)
    with Engine(small_file, config) as engine:
        engine.infer([[1, 2, 3]])                        # the damaged expert is never read, so never checked
    _corrupt_expert(small_file, *sorted(routed)[0])
    with Engine(small_file, config) as engine, pytest.raises(CorruptExpert):
        engine.infer([[1, 2, 3]])
    with Engine(small_file, EngineConfig(verify="never", max_cached_experts=max_cached)) as engine:
        engine.infer([[1, 2, 3]])


def test_bytes_paged_counts_whole_blobs(small_file):
    import colibri_format

    with colibri_format.open(small_file) as f:
        blob = len(f.expert_blob(0, 0))
    with Engine(small_file, EngineConfig(max_cached_experts=4)) as engine:      # paged: 4 of 16 experts
        stats = engine.generate([1, 2], max_new_tokens=3, stop_ids=[]).stats
        assert stats.expert_loads > 0
        fills = engine.experts.counters.fills       # admissions filled by the kernels as they read (no copy)
        assert stats.bytes_paged == (stats.expert_loads - fills) * blob and blob % 4096 == 0
        assert engine.cache.stats().bytes_paged >= stats.bytes_paged    # an expert admitted and evicted between
        #                                                   two passes counts for the cache but is never copied
        assert engine.stats()["paging"]["bytes_paged"] == stats.bytes_paged
    with Engine(small_file) as engine:                  # resident, read in place: nothing is paged
        stats = engine.generate([1, 2], max_new_tokens=3, stop_ids=[]).stats
        assert engine.cache is None and stats.expert_loads == stats.bytes_paged == 0


def test_run_infer_with_ids_text_chat_and_streaming(small_file, tmp_path):
    by_ids = run_infer(small_file, ids=[3, 4], max_new_tokens=4, max_cached_experts=3)
    assert set(by_ids) == {"prompt_ids", "output_ids", "text", "finish_reason", "stats"}
    assert by_ids["stats"]["experts_touched"] > 0
    pieces = []
    by_text = run_infer(small_file, "hello world", max_new_tokens=4, stream=pieces.append,
                        trace_path=str(tmp_path / "t.jsonl"))
    assert by_text["prompt_ids"] == [3, 4] and by_text["output_ids"] == by_ids["output_ids"]
    assert "".join(pieces).strip() == by_text["text"].strip()
    chat = run_infer(small_file, "hi there", chat=True, max_new_tokens=2)
    assert chat["prompt_ids"] == [1, 5, 7, 8, 9, 2, 6, 7]
    with pytest.raises(InvalidInput, match="exactly one"):
        run_infer(small_file, "hi", ids=[1])


def test_the_tokenizer_survives_conversion(tmp_path):
    import json

    hf = build_hf("qwen3_moe")
    src = tmp_path / "hf"
    hf.save_pretrained(src)                                  # writes generation_config.json (eos 2)
    entry = tokenizer_entry()
    (src / "tokenizer_config.json").write_text(json.dumps(entry["tokenizer_config"]))  # chat_template inside
    (src / "tokenizer.json").write_text(entry["tokenizer_json"])
    out = tmp_path / "m.colibri"
    convert(src, out, dtype="float32", quantize="none", workers=1)
    result = run_infer(out, "hi there", chat=True, max_new_tokens=6)
    assert result["prompt_ids"] == [1, 5, 7, 8, 9, 2, 6, 7]
    expected = greedy_reference(hf, result["prompt_ids"], 6)
    if 2 in expected:                                        # eos from generation_config ends generation
        expected = expected[:expected.index(2) + 1]
    assert result["output_ids"] == expected
