"""The DeepSeek-V3 family through the converter: config.json to the `model` object (MLA dims, the softmax scale with
YaRN's mscale^2, dense / MoE layers, the grouped sigmoid router, index_topk), the file's tensors against a direct
reading of the state dict (kv_b_proj split, interleaved rope rows de-interleaved), legacy and v5-fused checkpoints,
the indexer and multi-token-prediction layers skipped and listed in the provenance, FP8 block-scaled checkpoints
(blocks that do not divide the shapes) converted to the dequantized model, Kimi-K2's model_type, and refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import colibri_format
from colibri_format.convert.adapters import normalize_config
from colibri_format.convert.pipeline import convert
from colibri_format.errors import UnsupportedModel
from colibri_format.runtime import Engine, EngineConfig
from tests.convert.quantized_checkpoints import load_reference, to_fp8
from tests.hf_mla import CONFIGS, build, save
from tests.runtime.hf_tiny import hf_logits, prompts, rel_err

TOL = 1e-4
INTERLEAVED = {"deepseek_v3": True, "deepseek_v3-plain": False, "deepseek_v32": True, "glm_moe_dsa": True,
               "glm4_moe_lite": False}


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_maps_onto_the_model_object(name, tmp_path):
    hf = build(name)
    cfg = hf.config
    arch, model = normalize_config(json.loads((save(hf, tmp_path) / "config.json").read_text()))
    assert arch == cfg.model_type
    assert model["mla"] == {"q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": 12, "qk_nope_head_dim": 8,
                            "qk_rope_head_dim": 6, "v_head_dim": 10, "latent_norm_eps": 1e-6}
    assert (model["head_dim"], model["num_key_value_heads"]) == (14, 4)
    rope = cfg.rope_parameters
    scale = 14 ** -0.5
    if rope.get("mscale_all_dim"):
        scale *= _mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    assert model["multipliers"]["attention"] == pytest.approx(scale, rel=1e-12)
    dense = [i for i in range(cfg.num_hidden_layers) if i not in model["moe_layers"]]
    assert dense == ([i for i, k in enumerate(cfg.mlp_layer_types) if k == "dense"] if hasattr(cfg, "mlp_layer_types")
                     else list(range(cfg.first_k_dense_replace)))
    assert model["router"] == {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": cfg.norm_topk_prob,
                               "bias": True, "scale": cfg.routed_scaling_factor, "n_group": cfg.n_group,
                               "topk_group": cfg.topk_group}
    assert model["shared_expert"] == {"intermediate_size": 16 * cfg.n_shared_experts, "gate": "none"}
    assert model.get("index_topk") == getattr(cfg, "index_topk", None)
    assert model["rms_norm_eps"] == cfg.rms_norm_eps and "partial_rotary_factor" not in model["rope"]


def _canonical(hf, interleaved: bool) -> dict[str, np.ndarray]:
    """The file's MLA tensors, read straight from the state dict."""
    cfg, sd = hf.config, {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    nh, dn, dr, dv, r = 4, 8, 6, 10, 12
    pairs = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)]) if interleaved else np.arange(dr)
    out = {}
    for i in range(cfg.num_hidden_layers):
        p, c = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        q = sd[p + ("q_proj.weight" if cfg.q_lora_rank is None else "q_b_proj.weight")].reshape(nh, dn + dr, -1)
        q = np.concatenate([q[:, :dn], q[:, dn:][:, pairs]], axis=1).reshape(nh * (dn + dr), -1)
        if cfg.q_lora_rank is None:
            out[c + "q_proj"] = q
        else:
            out.update({c + "q_a_proj": sd[p + "q_a_proj.weight"], c + "q_a_norm": sd[p + "q_a_layernorm.weight"],
                        c + "q_b_proj": q})
        kva = sd[p + "kv_a_proj_with_mqa.weight"]
        kvb = sd[p + "kv_b_proj.weight"].reshape(nh, dn + dv, r)
        out.update({c + "kv_a_proj": np.concatenate([kva[:r], kva[r:][pairs]]),
                    c + "kv_a_norm": sd[p + "kv_a_layernorm.weight"], c + "k_b_proj": kvb[:, :dn].reshape(-1, r),
                    c + "v_b_proj": kvb[:, dn:].reshape(-1, r), c + "o_proj": sd[p + "o_proj.weight"]})
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_files_attention_tensors_are_the_checkpoints_and_both_layouts_agree(name, tmp_path):
    hf = build(name)
    want = _canonical(hf, INTERLEAVED[name])
    paths = []
    for fused in (False, True):
        paths.append(tmp_path / f"{fused}.colibri")
        convert(save(hf, tmp_path / f"hf{fused}", fused), paths[-1], dtype="float32", quantize="none", workers=1)
    with colibri_format.open(paths[0], verify="always") as a, colibri_format.open(paths[1], verify="always") as b:
        assert a.model == b.model and a.dense_names() == b.dense_names()
        for tensor_name, tensor in want.items():
            np.testing.assert_array_equal(a.dense_f32(tensor_name), tensor)
        for tensor_name in a.dense_names():
            np.testing.assert_array_equal(a.dense_f32(tensor_name), b.dense_f32(tensor_name))
        for layer in a.model["moe_layers"]:
            for e in range(a.model["num_experts"]):
                for x, y in zip(a.expert_f32(layer, e), b.expert_f32(layer, e)):
                    np.testing.assert_array_equal(x, y)


def _add_mtp_layer(folder, layers: int) -> list[str]:
    """A multi-token-prediction layer as the releases ship it (`model.layers.{num_hidden_layers}.*`: a decoder layer
    plus enorm / hnorm / eh_proj / shared_head), and num_nextn_predict_layers = 1 in config.json."""
    tensors = load_file(str(folder / "model.safetensors"))
    last = f"model.layers.{layers - 1}."
    mtp = {f"model.layers.{layers}." + k[len(last):]: v.clone() for k, v in tensors.items() if k.startswith(last)}
    h = tensors["model.norm.weight"].shape[0]
    for extra, shape in (("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
                         ("shared_head.norm.weight", (h,))):
        mtp[f"model.layers.{layers}.{extra}"] = torch.ones(shape)
    save_file({**tensors, **mtp}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return sorted(mtp)


def _skipped(path) -> dict[str, list[str]]:
    with colibri_format.open(path) as r:
        groups = r.metadata["provenance"].get("skipped_tensors", [])
    return {g["reason"]: g["names"] for g in groups}


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
def test_the_mtp_layer_and_the_indexer_are_skipped_and_listed_in_the_provenance(name, tmp_path):
    hf = build(name)
    folder = save(hf, tmp_path / "hf")
    mtp = _add_mtp_layer(folder, hf.config.num_hidden_layers)
    convert(folder, tmp_path / "out.colibri", dtype="float32", quantize="none", workers=1)
    skipped = _skipped(tmp_path / "out.colibri")
    by_kind = {("mtp" if "multi-token" in reason else "indexer" if "indexer" in reason else reason): names
               for reason, names in skipped.items()}
    assert by_kind["mtp"] == mtp
    indexer = sorted(k for k in hf.state_dict() if ".indexer." in k)
    assert by_kind.get("indexer", []) == indexer and bool(indexer) == (name == "glm_moe_dsa")


@pytest.mark.parametrize("name, block", [("deepseek_v3", (8, 16)), ("deepseek_v3-plain", (128, 128)),
                                         ("deepseek_v32", (16, 8))])
def test_fp8_checkpoint_converts_to_the_dequantized_model(tmp_path, name, block):
    # blocks that do not divide the shapes (kv_a_proj_with_mqa has 18 rows, kv_b_proj 12 columns), an FP8 MTP layer
    hf = build(name)
    folder = save(hf, tmp_path / "hf")
    _add_mtp_layer(folder, hf.config.num_hidden_layers)
    fp8, dequantized = to_fp8(folder, tmp_path, block)
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in load_file(str(fp8 / "model.safetensors"))
    convert(fp8, tmp_path / "fp8.colibri", dtype="float32", quantize="none", workers=2)
    convert(dequantized, tmp_path / "deq.colibri", dtype="float32", quantize="none", workers=1)
    with colibri_format.open(tmp_path / "fp8.colibri") as a, colibri_format.open(tmp_path / "deq.colibri") as b:
        assert a.model == b.model
        for tensor_name in b.dense_names():
            np.testing.assert_array_equal(a.dense_f32(tensor_name), b.dense_f32(tensor_name))
        for layer in b.model["moe_layers"]:
            for e in range(b.model["num_experts"]):
                for x, y in zip(a.expert_f32(layer, e), b.expert_f32(layer, e)):
                    np.testing.assert_array_equal(x, y)
    ref = load_reference(dequantized)
    batch = prompts(hf.config.vocab_size, [11, 4], seed=5)
    with Engine(tmp_path / "fp8.colibri", EngineConfig(max_seq_len=64)) as engine:
        for ids, logits in zip(batch, engine.logits(batch)):
            assert rel_err(logits, hf_logits(ref, ids)) < TOL
        ids, out = list(batch[0]), []
        for _ in range(8):
            out.append(int(hf_logits(ref, ids)[-1].argmax()))
            ids.append(out[-1])
        assert engine.generate(batch[0], max_new_tokens=8, stop_ids=[]).output_ids == out
    assert rel_err(hf_logits(ref, batch[0]), hf_logits(hf, batch[0])) > 10 * TOL      # FP8 really rounds


def test_kimi_k2_declares_the_deepseek_v3_graph(tmp_path):
    folder = save(build("deepseek_v3"), tmp_path / "hf")
    raw = json.loads((folder / "config.json").read_text())
    assert normalize_config({**raw, "model_type": "kimi_k2"}) == ("kimi_k2", normalize_config(raw)[1])
    # transformers' deepseek_v3 reads first_k_dense_replace only; mlp_layer_types is V3.2 / GLM-5's
    assert normalize_config({**raw, "mlp_layer_types": ["sparse"] * 3})[1]["moe_layers"] == [1, 2]


@pytest.mark.parametrize("name, change, field", [
    ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
    ("deepseek_v3", {"topk_method": "group_limited_greedy"}, "topk_method"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek_v3", {"first_k_dense_replace": 3}, "first_k_dense_replace"),      # no MoE layer left
    ("glm_moe_dsa", {"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ("glm_moe_dsa", {"mlp_layer_types": ["dense"] * 3}, "first_k_dense_replace"),
])
def test_what_the_engine_does_not_compute_is_refused_naming_the_field(tmp_path, name, change, field):
    raw = json.loads((save(build(name), tmp_path) / "config.json").read_text())
    with pytest.raises(UnsupportedModel) as info:
        normalize_config({**raw, **change})
    assert info.value.field == field and "\n" not in str(info.value)


# config.json of published checkpoints, v4 spellings (rope_scaling with "type"; the fields that matter here)
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "attention_bias": False, "first_k_dense_replace": 3, "hidden_act": "silu",
               "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
               "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
               "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
               "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
               "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                       "weight_block_size": [128, 128]},
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"},
               "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
               "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280}
PUBLISHED = {
    "DeepSeek-V3": (DEEPSEEK_V3, dict(heads=128, q_lora=1536, moe=(3, 61), groups=(8, 4), shared=2048, experts=256,
                                      scale=192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)),
    "Kimi-K2-Instruct": ({**DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
                          "n_routed_experts": 384, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                          "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "num_nextn_predict_layers": 0,
                          "max_position_embeddings": 131072, "vocab_size": 163840,
                          "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": 32}},
                         dict(heads=64, q_lora=1536, moe=(1, 61), groups=(1, 1), shared=2048, experts=384,
                              scale=192 ** -0.5 * (0.1 * math.log(32) + 1) ** 2)),
    # no q LoRA, no rope scaling, two shared experts
    "Moonlight-16B-A3B": ({**DEEPSEEK_V3, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
                           "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                           "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 2.446,
                           "q_lora_rank": None, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
                           "first_k_dense_replace": 1, "max_position_embeddings": 8192, "rope_theta": 50000.0,
                           "rope_scaling": None, "vocab_size": 163840, "quantization_config": None},
                          dict(heads=16, q_lora=None, moe=(1, 27), groups=(1, 1), shared=2816, experts=64,
                               scale=192 ** -0.5)),
    # transformers' GlmMoeDsaConfig defaults (GLM-5)
    "GLM-5": ({"model_type": "glm_moe_dsa", "hidden_size": 6144, "intermediate_size": 12288,
               "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
               "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
               "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64, "v_head_dim": 256,
               "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
               "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "index_topk": 2048, "index_head_dim": 128,
               "index_n_heads": 32, "first_k_dense_replace": 3, "vocab_size": 154880, "num_nextn_predict_layers": 1,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
              dict(heads=64, q_lora=2048, moe=(3, 78), groups=(1, 1), shared=2048, experts=256, scale=256 ** -0.5,
                   index_topk=2048)),
    # transformers' Glm4MoeLiteConfig defaults (GLM-4.7-Flash): 20 heads do not divide hidden 2048, no head_dim key
    "GLM-4.7-Flash": ({"model_type": "glm4_moe_lite", "hidden_size": 2048, "intermediate_size": 10240,
                       "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
                       "num_key_value_heads": 20, "n_shared_experts": 1, "n_routed_experts": 64,
                       "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768, "qk_rope_head_dim": 64,
                       "v_head_dim": 256, "qk_nope_head_dim": 192, "num_experts_per_tok": 4, "rms_norm_eps": 1e-5,
                       "max_position_embeddings": 202752, "vocab_size": 154880, "rope_interleave": True,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
                      dict(heads=20, q_lora=768, moe=(1, 47), groups=(1, 1), shared=1536, experts=64, scale=256 ** -0.5)),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_normalize(name):
    raw, want = PUBLISHED[name]
    arch, model = normalize_config(raw)
    assert arch == raw["model_type"]
    assert (model["num_attention_heads"], model["num_key_value_heads"]) == (want["heads"], want["heads"])
    assert model["mla"]["q_lora_rank"] == want["q_lora"] and model["mla"]["kv_lora_rank"] == 512
    assert model["head_dim"] == raw["qk_nope_head_dim"] + 64
    assert model["moe_layers"] == list(range(*want["moe"]))
    assert (model["router"]["n_group"], model["router"]["topk_group"]) == want["groups"]
    assert model["shared_expert"] == {"intermediate_size": want["shared"], "gate": "none"}
    assert model["num_experts"] == want["experts"]
    assert model["multipliers"]["attention"] == pytest.approx(want["scale"], rel=1e-12)
    assert model.get("index_topk") == want.get("index_topk")
