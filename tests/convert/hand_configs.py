"""Hand-written minimal config.json objects (v4-style spellings) shared by the config tests."""

MIXTRAL = {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 16,
           "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN2 = {**MIXTRAL, "model_type": "qwen2_moe", "num_local_experts": None, "num_experts": 4,
         "moe_intermediate_size": 16, "intermediate_size": 48, "shared_expert_intermediate_size": 24}
QWEN3 = {**QWEN2, "model_type": "qwen3_moe", "shared_expert_intermediate_size": None}
