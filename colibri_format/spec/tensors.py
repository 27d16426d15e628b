"""The canonical dense tensors a model needs, derived from the metadata `model` object.

The converter writes exactly this list in this order, and the reader demands it, so a file's directory
is never a free-form bag of names: every tensor has a meaning the runtime knows.
"""

from __future__ import annotations


def linear_layers(model: dict) -> list[int]:
    """The Gated DeltaNet layers (model.layer_types), in order."""
    return [i for i, k in enumerate(model.get("layer_types") or ()) if k == "linear_attention"]


def _linear_attention_tensors(model: dict, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """A Gated DeltaNet layer: q|k|v, z, b and a projections, the depthwise conv over q|k|v, A_log, dt_bias, the
    z-gated output norm and the output projection."""
    lin, h = model["linear_attention"], model["hidden_size"]
    nk, nv = lin["num_key_heads"], lin["num_value_heads"]
    key, value = nk * lin["key_head_dim"], nv * lin["value_head_dim"]
    p = f"layers.{i}.linear."
    return [(p + "qkv_proj", (2 * key + value, h)), (p + "z_proj", (value, h)), (p + "b_proj", (nv, h)),
            (p + "a_proj", (nv, h)), (p + "conv", (2 * key + value, lin["conv_kernel"])), (p + "A_log", (nv,)),
            (p + "dt_bias", (nv,)), (p + "norm", (lin["value_head_dim"],)), (p + "o_proj", (h, value))]


def _mla_tensors(model: dict, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """Multi-head latent attention: q through q_proj, or q_a_proj -> q_a_norm -> q_b_proj (q_lora_rank set), each
    head [nope | rope]; kv_a_proj -> [latent c (kv_lora_rank) | shared rope key]; kv_a_norm over c; k_b_proj and
    v_b_proj expand c to each head's nope key and value; o_proj over the heads' values."""
    m, h, nh = model["mla"], model["hidden_size"], model["num_attention_heads"]
    r, rope = m["kv_lora_rank"], m["qk_rope_head_dim"]
    q, rq = nh * (m["qk_nope_head_dim"] + rope), m["q_lora_rank"]
    p = f"layers.{i}.attn."
    out = [(p + "q_proj", (q, h))] if rq is None else [(p + "q_a_proj", (rq, h)), (p + "q_a_norm", (rq,)),
                                                       (p + "q_b_proj", (q, rq))]
    return out + [(p + "kv_a_proj", (r + rope, h)), (p + "kv_a_norm", (r,)),
                  (p + "k_b_proj", (nh * m["qk_nope_head_dim"], r)), (p + "v_b_proj", (nh * m["v_head_dim"], r)),
                  (p + "o_proj", (h, nh * m["v_head_dim"]))]


def _attention_tensors(model: dict, i: int) -> list[tuple[str, tuple[int, ...]]]:
    if i in linear_layers(model):
        return _linear_attention_tensors(model, i)
    if model.get("mla") is not None:
        return _mla_tensors(model, i)
    h, hd = model["hidden_size"], model["head_dim"]
    q, kv = model["num_attention_heads"] * hd, model["num_key_value_heads"] * hd
    p = f"layers.{i}.attn."
    out = [(p + "q_proj", (q, h)), (p + "k_proj", (kv, h)), (p + "v_proj", (kv, h)), (p + "o_proj", (h, q))]
    if model["qkv_bias"]:
        out += [(p + "q_bias", (q,)), (p + "k_bias", (kv,)), (p + "v_bias", (kv,))]
    if model["o_bias"]:
        out.append((p + "o_bias", (h,)))
    if model["qk_norm"] == "per_head":
        out += [(p + "q_norm", (hd,)), (p + "k_norm", (hd,))]
    elif model["qk_norm"] == "full":
        out += [(p + "q_norm", (q,)), (p + "k_norm", (kv,))]
    if model.get("attention_sinks"):
        out.append((p + "sinks", (model["num_attention_heads"],)))
    if model.get("attention_gate"):
        out.append((p + "gate_proj", (q, h)))
    return out


def _ffn_tensors(model: dict, i: int) -> list[tuple[str, tuple[int, ...]]]:
    h = model["hidden_size"]
    if i not in model["moe_layers"]:
        d = model["dense_intermediate_size"]
        p = f"layers.{i}.mlp."
        return [(p + "gate_proj", (d, h)), (p + "up_proj", (d, h)), (p + "down_proj", (h, d))]
    p = f"layers.{i}.moe."
    out = [(p + "router", (model["num_experts"], h))]
    if model["router"]["bias"]:
        out.append((p + "router_bias", (model["num_experts"],)))
    if model.get("expert_bias"):
        e, i_e = model["num_experts"], model["expert_intermediate_size"]
        out += [(p + "expert_gate_up_bias", (e, 2 * i_e)), (p + "expert_down_bias", (e, h))]
    shared = model["shared_expert"]
    if shared is not None:
        s = shared["intermediate_size"]
        out += [(p + "shared.gate_proj", (s, h)), (p + "shared.up_proj", (s, h)),
                (p + "shared.down_proj", (h, s))]
        if shared["gate"] == "sigmoid":
            out.append((p + "shared_gate", (1, h)))
    return out


def canonical_dense_tensors(model: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every dense tensor, in the canonical directory order."""
    v, h = model["vocab_size"], model["hidden_size"]
    out: list[tuple[str, tuple[int, ...]]] = [("embed_tokens", (v, h))]
    for i in range(model["num_layers"]):
        out.append((f"layers.{i}.input_norm", (h,)))
        out += _attention_tensors(model, i)
        out.append((f"layers.{i}.post_attn_norm", (h,)))
        out += _ffn_tensors(model, i)
    out.append(("final_norm", (h,)))
    if not model["tie_word_embeddings"]:
        out.append(("lm_head", (v, h)))
    return out
