"""`check_cuda_support` for the GLM-4.5 / MiniMax-M2 / gpt-oss features (CPU only): what the kernels compute runs
(grouped top-k, a router bias on the logits, attention sinks, gpt-oss's expert biases and clamped SwiGLU, Qwen3-Next's
gated attention and Gated DeltaNet layers among them), what they do not compute (value heads wider than the delta-rule
kernel's block) is refused at open with one line naming the field."""

from __future__ import annotations

import pytest

from colibri_format import errors as E
from colibri_format import spec as S
from colibri_format.runtime.cuda import limits as L
from colibri_format.synthetic import synthetic_model

ROW = S.ExpertFormat.INT8_ROW


def model(**changes) -> dict:
    m = {**synthetic_model(), **changes}
    S.check_model(m)
    return m


def blob(m: dict) -> S.BlobLayout:
    return S.blob_layout(m["hidden_size"], m["expert_intermediate_size"], ROW, 0)


SIGMOID = {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": True, "bias": True, "scale": 2.5}


@pytest.mark.parametrize("changes", [
    {"router": {**SIGMOID, "n_group": 1, "topk_group": 1}},                # GLM-4.5: plain top-k
    {"router": {**SIGMOID, "n_group": 2, "topk_group": 2}},                # every group kept: plain top-k
    {"router": {**SIGMOID, "scale": 1.0}, "qk_norm": "full"},               # MiniMax-M2
    {"rope": {"type": "default", "theta": 1e4, "partial_rotary_factor": 0.5}},
    {"router": {**SIGMOID, "n_group": 2, "topk_group": 1}},                # grouped top-k (router.cu)
    {"router": {"scoring": "softmax", "order": "topk_softmax", "normalize_topk": False, "bias": True,
                "scale": 1.0}},                                            # gpt-oss's router: a bias on the logits
    {"attention_sinks": True},                                              # gpt-oss's sinks (layers.cu)
    {"sliding_window": 4, "sliding_layers": [0]},                           # gpt-oss's per-layer windows
    {"expert_act": {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}},      # gpt-oss's experts (*_extras kernels)
    {"expert_act": {"alpha": 1.702, "limit": None, "up_offset": 1.0}},     # no clamp
    {"expert_bias": True},
    {"expert_act": {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}, "expert_bias": True},
])
def test_glm_minimax_and_gpt_oss_features_run(changes):
    m = model(**changes)
    L.check_cuda_support(m, blob(m))


def hybrid(value_head_dim: int = 8, key_head_dim: int = 8) -> dict:
    """Qwen3-Next / Qwen3.5's layers: Gated DeltaNet, then gated full attention."""
    return {"layer_types": ["linear_attention", "full_attention"], "attention_gate": True,
            "linear_attention": {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": key_head_dim,
                                 "value_head_dim": value_head_dim, "conv_kernel": 4}}


@pytest.mark.parametrize("changes", [
    {"attention_gate": True},
    hybrid(),
    hybrid(value_head_dim=L.DELTANET_MAX_VALUE_DIM, key_head_dim=4096),     # the widest heads deltanet.cu runs
])
def test_qwen3_next_layers_run(changes):
    m = model(**changes)
    L.check_cuda_support(m, blob(m))


@pytest.mark.parametrize("changes, field", [
    (hybrid(value_head_dim=L.DELTANET_MAX_VALUE_DIM + 16), "model.linear_attention.value_head_dim"),
])
def test_features_the_kernels_lack_are_refused_in_one_line(changes, field):
    m = model(**changes)
    with pytest.raises(E.UnsupportedModel) as info:
        L.check_cuda_support(m, blob(m))
    assert info.value.field == field
    assert "\n" not in str(info.value) and "the CUDA kernels cannot run this model" in str(info.value)


MLA = {"q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
       "latent_norm_eps": 1e-6}
DEEPSEEK_V3_MLA = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                   "v_head_dim": 128, "latent_norm_eps": 1e-6}


def mla_model(mla: dict, **changes) -> dict:
    return model(num_key_value_heads=4, head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], mla=mla,
                 **changes)


@pytest.mark.parametrize("mla, changes", [
    (MLA, {"index_topk": 64}),                    # V3.2 / GLM-5 (contexts beyond index_topk: refused by the engine)
    (DEEPSEEK_V3_MLA, {}),
    ({**DEEPSEEK_V3_MLA, "qk_nope_head_dim": 192, "v_head_dim": 256}, {}),     # GLM-5's widths
])
def test_multi_head_latent_attention_runs(mla, changes):
    m = mla_model(mla, **changes)
    L.check_cuda_support(m, blob(m))


@pytest.mark.parametrize("changes, field", [
    ({"kv_lora_rank": L.MLA_MAX_RANK + 32}, "model.mla.kv_lora_rank"),        # the attention kernel's accumulator
    ({"qk_nope_head_dim": 2048}, "model.mla"),                                # absorb_q's shared memory
])
def test_latent_attention_beyond_the_kernels_is_refused_in_one_line(changes, field):
    m = mla_model({**DEEPSEEK_V3_MLA, **changes})
    with pytest.raises(E.UnsupportedModel) as info:
        L.check_cuda_support(m, blob(m))
    assert info.value.field == field and "\n" not in str(info.value)


def test_mla_shared_memory_of_deepseek_v3_fits():
    assert max(L.mla_shared_bytes(DEEPSEEK_V3_MLA).values()) <= L.SHARED_MEMORY_BYTES
