"""A random tiny model built with NumPy alone (no transformers): for engine behaviour tests.

`random_weights` gives the canonical tensors in memory (`TinyWeights`); `tiny_file` writes them to a `.colibri`
file, which is what an `Engine` opens.
"""

from __future__ import annotations

import numpy as np

from tests.runtime.tiny_weights import TinyWeights, write_colibri

MODEL = {
    "vocab_size": 50, "hidden_size": 16, "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 4, "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
    "rope": {"type": "default", "theta": 10000.0}, "qkv_bias": False, "o_bias": False, "qk_norm": "none",
    "clip_qkv": None, "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
    "moe_layers": [0, 1], "dense_intermediate_size": None, "num_experts": 8, "top_k": 2,
    "expert_intermediate_size": 16,
    "router": {"scoring": "softmax", "order": "softmax_topk", "normalize_topk": True, "bias": False, "scale": 1.0},
    "shared_expert": None, "multipliers": {"embedding": 1.0, "residual": 1.0, "attention": None, "logits": 1.0},
}


def dense_shapes(m: dict) -> dict[str, tuple[int, ...]]:
    h, v, hd = m["hidden_size"], m["vocab_size"], m["head_dim"]
    nq, nkv = m["num_attention_heads"] * hd, m["num_key_value_heads"] * hd
    shapes = {"embed_tokens": (v, h), "final_norm": (h,), "lm_head": (v, h)}
    for i in range(m["num_layers"]):
        p = f"layers.{i}"
        shapes |= {f"{p}.input_norm": (h,), f"{p}.post_attn_norm": (h,), f"{p}.attn.q_proj": (nq, h),
                   f"{p}.attn.k_proj": (nkv, h), f"{p}.attn.v_proj": (nkv, h), f"{p}.attn.o_proj": (h, nq),
                   f"{p}.moe.router": (m["num_experts"], h)}
    return shapes


def random_weights(seed: int = 0, **overrides) -> TinyWeights:
    model = {**MODEL, **overrides}
    rng = np.random.default_rng(seed)
    dense = {n: (1.0 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.3 * rng.standard_normal(s))
             .astype(np.float32) for n, s in dense_shapes(model).items()}
    h, i = model["hidden_size"], model["expert_intermediate_size"]
    experts = {(layer, e): ((0.3 * rng.standard_normal((2 * i, h))).astype(np.float32),
                            (0.3 * rng.standard_normal((h, i))).astype(np.float32))
               for layer in model["moe_layers"] for e in range(model["num_experts"])}
    return TinyWeights(model, dense, experts)


def tiny_file(path, seed: int = 0, **overrides):
    """`random_weights(seed, **overrides)` written to `path` (float32 dense and experts); returns the path."""
    return write_colibri(random_weights(seed, **overrides), path)


# --- a word-level tokenizer over a 10-word vocabulary, with a chat template -----------------------------

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", ":", "hi", "there"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} "
            "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")


def tokenizer_entry(**extra) -> dict:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = HFTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "chat_template": TEMPLATE}
    return {"tokenizer_json": tok.to_str(), "tokenizer_config": config, "generation_config": {}, **extra}
