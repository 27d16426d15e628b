"""Hand-written minimal config.json objects (v4-style spellings) shared by the config tests."""

MIXTRAL = {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 16,
           "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN2 = {**MIXTRAL, "model_type": "qwen2_moe", "num_local_experts": None, "num_experts": 4,
         "moe_intermediate_size": 16, "intermediate_size": 48, "shared_expert_intermediate_size": 24}
QWEN3 = {**QWEN2, "model_type": "qwen3_moe", "shared_expert_intermediate_size": None}

# v4-era configs with the field values of published checkpoints (only the fields that matter here).
PUBLISHED = {
    "Mixtral-8x7B": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2,
                     "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
                     "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
                     "vocab_size": 32000, "hidden_act": "silu"},
    "Qwen1.5-MoE-A2.7B": {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
                          "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "vocab_size": 151936, "rope_theta": 1000000.0,
                          "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21,
                          "norm_topk_prob": False, "decoder_sparse_step": 1, "rms_norm_eps": 1e-06,
                          "max_position_embeddings": 8192, "tie_word_embeddings": False},
    "Qwen3-30B-A3B": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
                      "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None,
                      "sliding_window": None, "use_sliding_window": False, "max_window_layers": 48,
                      "norm_topk_prob": True, "vocab_size": 151936, "attention_bias": False, "rms_norm_eps": 1e-06,
                      "mlp_only_layers": [], "decoder_sparse_step": 1, "tie_word_embeddings": False},
    "OLMoE-1B-7B": {"model_type": "olmoe", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
                    "num_hidden_layers": 16, "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
                    "vocab_size": 50304, "rope_theta": 10000.0, "clip_qkv": None, "norm_topk_prob": False,
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": False},
    "granite-3.0-1b-a400m": {"model_type": "granitemoe", "hidden_size": 1024, "num_attention_heads": 16,
                             "num_key_value_heads": 8, "num_hidden_layers": 24, "intermediate_size": 512,
                             "num_local_experts": 32, "num_experts_per_tok": 8, "vocab_size": 49155,
                             "embedding_multiplier": 12.0, "attention_multiplier": 0.015625,
                             "residual_multiplier": 0.22, "logits_scaling": 6.0, "rope_theta": 10000.0,
                             "max_position_embeddings": 4096, "tie_word_embeddings": True, "rms_norm_eps": 1e-06,
                             "attention_bias": False, "rope_scaling": None},
}
