"""config.json normalisation: every supported arch, v4/v5 spellings, and untrusted-input rejection."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import xxhash

from colibri_format.convert import hf_config
from colibri_format.convert.adapters import SUPPORTED_MODEL_TYPES, get_adapter, normalize_config
from colibri_format.convert.hf_config import load_config
from colibri_format.errors import ColibriFormatError, InvalidInput, UnsupportedModel
from tests.convert.hand_configs import MIXTRAL, QWEN2, QWEN3
from tests.hf_models import ARCHS

BASE = {
    "vocab_size": 128, "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
    "rope": {"type": "default", "theta": 10000.0}, "qkv_bias": False, "o_bias": False, "qk_norm": "none",
    "clip_qkv": None, "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
    "moe_layers": [0, 1], "dense_intermediate_size": None, "num_experts": 4, "top_k": 2,
    "expert_intermediate_size": 16,
    "router": {"scoring": "softmax", "order": "softmax_topk", "normalize_topk": True, "bias": False, "scale": 1.0},
    "shared_expert": None, "multipliers": {"embedding": 1.0, "residual": 1.0, "attention": None, "logits": 1.0},
}
GRANITE_ROUTER = {**BASE["router"], "order": "topk_softmax", "normalize_topk": False}
GRANITE_MULT = {"embedding": 12.0, "residual": 0.22, "attention": 0.0625, "logits": 6.0}
EXPECTED = {
    "mixtral": {"rms_norm_eps": 1e-5, "rope": {"type": "default", "theta": 1e6}},
    "qwen2_moe": {"num_layers": 3, "qkv_bias": True, "moe_layers": [1, 2], "dense_intermediate_size": 48,
                  "router": {**BASE["router"], "normalize_topk": False},
                  "shared_expert": {"intermediate_size": 24, "gate": "sigmoid"}},
    "qwen3_moe": {"head_dim": 16, "qk_norm": "per_head"},
    "olmoe": {"rms_norm_eps": 1e-5, "qk_norm": "full", "clip_qkv": 8.0,
              "router": {**BASE["router"], "normalize_topk": False}},
    "granitemoe": {"router": GRANITE_ROUTER, "multipliers": GRANITE_MULT},
    "granitemoeshared": {"router": GRANITE_ROUTER, "multipliers": GRANITE_MULT,
                         "shared_expert": {"intermediate_size": 24, "gate": "none"}},
    "glm4_moe": {"num_layers": 3, "head_dim": 16, "rms_norm_eps": 1e-5, "qkv_bias": True, "qk_norm": "per_head",
                 "rope": {"type": "default", "theta": 10000.0, "partial_rotary_factor": 0.5},
                 "moe_layers": [1, 2], "dense_intermediate_size": 48,
                 "router": {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": True, "bias": True,
                            "scale": 2.5, "n_group": 1, "topk_group": 1},
                 "shared_expert": {"intermediate_size": 16, "gate": "none"}},
    "gpt_oss": {"head_dim": 16, "rms_norm_eps": 1e-5, "qkv_bias": True, "o_bias": True, "sliding_window": 8,
                "rope": {"type": "yarn", "theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096.0},
                "expert_intermediate_size": 48,
                "router": {"scoring": "softmax", "order": "topk_softmax", "normalize_topk": False, "bias": True,
                           "scale": 1.0},
                "sliding_layers": [0], "attention_sinks": True, "expert_bias": True,
                "expert_act": {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}},
    "minimax_m2": {"head_dim": 16, "qk_norm": "full", "rope": {"type": "default", "theta": 5e6,
                                                               "partial_rotary_factor": 0.5},
                   "router": {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": True, "bias": True,
                              "scale": 1.0}},
}

def model_of(raw: dict[str, Any]) -> dict[str, Any]:
    return normalize_config({k: v for k, v in raw.items() if v is not None})[1]


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_config_normalizes_to_the_design_doc_model(arch: str, tiny_checkpoint: Any) -> None:
    cfg = load_config(tiny_checkpoint(arch))
    architecture, model = normalize_config(cfg.raw)
    assert architecture == arch
    assert list(model) == [k for k in hf_config.MODEL_KEYS + hf_config.OPTIONAL_MODEL_KEYS if k in model]
    assert model == {**BASE, **EXPECTED[arch]}


def test_tied_config_sets_the_flag(tiny_checkpoint: Any) -> None:
    cfg = load_config(tiny_checkpoint("granitemoe", tie=True))
    assert normalize_config(cfg.raw)[1]["tie_word_embeddings"] is True


def test_config_hash_is_xxh3_of_the_exact_bytes(tiny_checkpoint: Any) -> None:
    folder = tiny_checkpoint("mixtral")
    assert load_config(folder).xxh3 == xxhash.xxh3_64_hexdigest((folder / "config.json").read_bytes())


def test_registry_lists_every_fixture_arch() -> None:
    # the hybrid models' fixtures are tests/hf_hybrid.py (converter tests: tests/convert/test_convert_qwen3_next.py),
    # the DeepSeek-V3 family's tests/hf_mla.py (tests/convert/test_convert_mla.py)
    assert set(SUPPORTED_MODEL_TYPES) == set(ARCHS) | {"qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v3",
                                                       "kimi_k2", "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite"}
    assert all(get_adapter(a).model_type == a for a in ARCHS)


# --- v4 / v5 spellings -----------------------------------------------------------------------------

@pytest.mark.parametrize("alias", hf_config.EXPERT_COUNT_ALIASES)
def test_every_expert_count_alias_is_accepted(alias: str) -> None:
    raw = {**MIXTRAL, "num_local_experts": None, alias: 6}
    assert model_of(raw)["num_experts"] == 6


def test_agreeing_aliases_pass_and_disagreeing_ones_fail() -> None:
    assert model_of({**MIXTRAL, "num_experts": 4})["num_experts"] == 4
    with pytest.raises(InvalidInput, match="disagree"):
        model_of({**MIXTRAL, "num_experts": 8})


def test_v5_qwen3_writes_num_local_experts() -> None:
    assert model_of({**QWEN3, "num_experts": None, "num_local_experts": 4})["num_experts"] == 4


def test_v4_rope_theta_and_scaling_with_type_alias() -> None:
    rope = model_of({**MIXTRAL, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}})["rope"]
    assert rope == {"type": "linear", "theta": 5e5, "factor": 2.0}


def test_v5_rope_parameters_with_yarn() -> None:
    params = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096,
              "beta_fast": 32, "beta_slow": 1, "truncate": False}
    rope = model_of({**QWEN3, "rope_parameters": params})["rope"]
    assert rope == {"type": "yarn", "theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096.0,
                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


@pytest.mark.parametrize("params, needle", [
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"), ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "longrope", "short_factor": [1.0]}, "long_factor"),
])
def test_rope_type_without_its_parameters_is_invalid(params: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidInput, match=needle):
        model_of({**MIXTRAL, "rope_parameters": params})


def test_longrope_keeps_its_factor_lists() -> None:
    params = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1, 1.5], "long_factor": [2, 3],
              "original_max_position_embeddings": 4096}
    rope = model_of({**MIXTRAL, "rope_parameters": params})["rope"]
    assert rope["short_factor"] == [1.0, 1.5] and rope["long_factor"] == [2.0, 3.0]


def test_per_layer_type_rope_is_unsupported() -> None:
    params = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(UnsupportedModel, match="per-layer-type"):
        model_of({**MIXTRAL, "rope_parameters": params})


def test_rope_parameters_win_over_v4_fields() -> None:
    raw = {**MIXTRAL, "rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 2e6}}
    assert model_of(raw)["rope"] == {"type": "default", "theta": 2e6}


def test_missing_rope_uses_the_architecture_default_theta() -> None:
    assert model_of(MIXTRAL)["rope"]["theta"] == 1e6
    assert model_of(QWEN3)["rope"]["theta"] == 1e4


def test_unknown_rope_type_is_unsupported() -> None:
    with pytest.raises(UnsupportedModel, match="mrope"):
        model_of({**MIXTRAL, "rope_scaling": {"type": "mrope"}})


def test_head_dim_null_means_hidden_over_heads_and_explicit_wins() -> None:
    assert model_of({**MIXTRAL, "head_dim": None})["head_dim"] == 8
    assert model_of({**QWEN3, "head_dim": 32})["head_dim"] == 32


@pytest.mark.parametrize("window, expected", [(0, None), (None, None), (64, 64)])
def test_mixtral_sliding_window_zero_or_null_is_disabled(window: Any, expected: Any) -> None:
    assert model_of({**MIXTRAL, "sliding_window": window})["sliding_window"] == expected


def test_qwen_use_sliding_window_flag() -> None:
    assert model_of({**QWEN3, "sliding_window": 64, "use_sliding_window": False})["sliding_window"] is None
    assert model_of({**QWEN3, "sliding_window": 64, "use_sliding_window": True})["sliding_window"] == 64
    assert model_of({**QWEN2, "sliding_window": 0, "use_sliding_window": False})["sliding_window"] is None
    with pytest.raises(UnsupportedModel, match="sliding"):
        model_of({**QWEN2, "sliding_window": 64, "use_sliding_window": True})


def test_qwen_sparse_step_and_mlp_only_layers_make_dense_layers() -> None:
    model = model_of({**QWEN2, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert model["moe_layers"] == [1, 5]
    assert model["dense_intermediate_size"] == 48


def test_qwen2_v4_config_without_qkv_bias_field_has_bias() -> None:
    assert model_of(QWEN2)["qkv_bias"] is True
    assert model_of({**QWEN2, "qkv_bias": False})["qkv_bias"] is False


# --- rejected configs ------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [
    ("num_local_experts", "8"), ("num_local_experts", True), ("num_local_experts", 0),
    ("num_local_experts", 5000), ("num_local_experts", 4.0), ("num_hidden_layers", 2000),
    ("hidden_size", 1 << 21), ("num_experts_per_tok", 5), ("num_key_value_heads", 3),
    ("rms_norm_eps", "1e-5"), ("rms_norm_eps", 0), ("tie_word_embeddings", "false"),
    ("hidden_size", None), ("vocab_size", -1), ("rope_theta", -1.0), ("rope_parameters", [1]),
])
def test_wrong_types_and_out_of_range_values_are_invalid_input(key: str, value: Any) -> None:
    raw = {**MIXTRAL, key: value}
    if value is None:
        del raw[key]
    with pytest.raises(InvalidInput) as info:
        normalize_config(raw)
    assert info.value.field in (key, "num_experts", "rope_parameters", "num_key_value_heads",
                                "num_experts_per_tok", "rope_theta")


@pytest.mark.parametrize("model_type", ["deepseek_v2", "jamba", "llama", "not_a_model"])
def test_unknown_or_unsupported_model_type_names_it_and_lists_supported(model_type: str) -> None:
    with pytest.raises(UnsupportedModel) as info:
        normalize_config({**MIXTRAL, "model_type": model_type})
    assert model_type in str(info.value) and "mixtral" in str(info.value) and "qwen3_moe" in str(info.value)


@pytest.mark.parametrize("extra, needle", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "gptq"),
    ({"quantization_config": {"quant_method": "awq"}}, "awq"),
    ({"kv_lora_rank": 512}, "kv_lora_rank"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_features_are_named(extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(UnsupportedModel, match=needle):
        normalize_config({**MIXTRAL, **extra})


def test_missing_model_type_is_invalid() -> None:
    with pytest.raises(InvalidInput, match="model_type"):
        normalize_config({k: v for k, v in MIXTRAL.items() if k != "model_type"})


# --- the file itself -------------------------------------------------------------------------------

def write_config(folder: Path, text: str | bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = text.encode() if isinstance(text, str) else text
    (folder / "config.json").write_bytes(data)
    return folder


@pytest.mark.parametrize("text, needle", [
    ("[1, 2]", "object"), ("\"mixtral\"", "object"), ('{"model_type": "mixtral", "model_type": "x"}', "duplicate"),
    ('{"model_type": "mixtral", "rope_theta": NaN}', "NaN"), ("{", "JSON"), (b"\xff\xfe{}", "UTF-8"),
    ("[" * 100_000 + "]" * 100_000, "deeply|JSON"),
])
def test_malformed_config_files_are_invalid_input(tmp_path: Path, text: str | bytes, needle: str) -> None:
    with pytest.raises(InvalidInput, match=needle):
        load_config(write_config(tmp_path, text))


def test_oversized_config_is_refused_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_config, "CONFIG_MAX_BYTES", 64)
    with pytest.raises(InvalidInput, match="cap"):
        load_config(write_config(tmp_path, json.dumps({**MIXTRAL, "pad": "x" * 100})))


def test_missing_config_and_config_symlink_escape(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput):
        load_config(tmp_path)
    outside = write_config(tmp_path / "outside", json.dumps(MIXTRAL)) / "config.json"
    (tmp_path / "ckpt").mkdir()
    os.symlink(outside, tmp_path / "ckpt" / "config.json")
    with pytest.raises(InvalidInput, match="outside"):
        load_config(tmp_path / "ckpt")


def test_config_that_is_a_directory_is_invalid(tmp_path: Path) -> None:
    (tmp_path / "config.json").mkdir()
    with pytest.raises(InvalidInput, match="regular file"):
        load_config(tmp_path)


def test_all_config_errors_are_colibri_format_errors() -> None:
    for raw in ({}, {"model_type": 3}, {**MIXTRAL, "num_local_experts": "x"}, {**MIXTRAL, "model_type": "dbrx"}):
        with pytest.raises(ColibriFormatError):
            normalize_config(raw)


def test_error_messages_stay_short_for_huge_untrusted_values() -> None:
    for raw in ({**MIXTRAL, "num_local_experts": "x" * 100_000}, {**MIXTRAL, "model_type": "m" * 100_000}):
        with pytest.raises(ColibriFormatError) as info:
            normalize_config(raw)
        assert len(str(info.value)) < 600


@pytest.mark.parametrize("name, expected", [
    ("Mixtral-8x7B", {"head_dim": 128, "num_experts": 8, "top_k": 2, "expert_intermediate_size": 14336,
                      "rope": {"type": "default", "theta": 1e6}, "moe_layers": list(range(32))}),
    ("Qwen1.5-MoE-A2.7B", {"num_experts": 60, "sliding_window": None, "qkv_bias": True,
                           "shared_expert": {"intermediate_size": 5632, "gate": "sigmoid"}}),
    ("Qwen3-30B-A3B", {"head_dim": 128, "num_experts": 128, "top_k": 8, "qk_norm": "per_head",
                       "dense_intermediate_size": None}),
    ("OLMoE-1B-7B", {"qk_norm": "full", "clip_qkv": None, "expert_intermediate_size": 1024}),
    ("granite-3.0-1b-a400m", {"tie_word_embeddings": True, "vocab_size": 49155,
                              "multipliers": {"embedding": 12.0, "residual": 0.22, "attention": 0.015625,
                                              "logits": 6.0}}),
    ("GLM-4.5-Air", {"moe_layers": list(range(1, 46)), "dense_intermediate_size": 10944, "qkv_bias": True,
                     "o_bias": False, "qk_norm": "none", "num_experts": 128,
                     "rope": {"type": "default", "theta": 1e6, "partial_rotary_factor": 0.5},
                     "shared_expert": {"intermediate_size": 1408, "gate": "none"}}),
    ("GLM-4.5", {"moe_layers": list(range(3, 92)), "qk_norm": "per_head", "num_experts": 160,
                 "router": {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": True, "bias": True,
                            "scale": 2.5, "n_group": 1, "topk_group": 1}}),
    ("gpt-oss-20b", {"num_experts": 32, "top_k": 4, "head_dim": 64, "qkv_bias": True, "o_bias": True,
                     "sliding_window": 128, "sliding_layers": list(range(0, 24, 2)), "attention_sinks": True,
                     "rope": {"type": "yarn", "theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "original_max_position_embeddings": 4096.0, "truncate": False},
                     "expert_act": {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}}),
    ("MiniMax-M2", {"qk_norm": "full", "num_experts": 256, "top_k": 8, "expert_intermediate_size": 1536,
                    "shared_expert": None, "rope": {"type": "default", "theta": 5e6, "partial_rotary_factor": 0.5},
                    "router": {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": True, "bias": True,
                               "scale": 1.0}}),
])
def test_published_model_configs_normalize(name: str, expected: dict[str, Any]) -> None:
    from tests.convert.hand_configs import PUBLISHED

    model = model_of(PUBLISHED[name])
    assert {k: model[k] for k in expected} == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_adapters_called_directly_still_refuse_quantized_checkpoints(arch: str) -> None:
    raw = {**MIXTRAL, "model_type": arch, "quantization_config": {"quant_method": "gptq"}}
    with pytest.raises(UnsupportedModel, match="gptq"):
        get_adapter(arch).normalize_config(raw)
