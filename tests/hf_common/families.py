"""The model families the transformers common-test harness runs, each as a tiny config.

Every family is `AutoConfig.for_model(model_type, **COMMON, **own)`: the same small sizes for all, plus what the
family needs to be small and valid (MoE sizes, head dims, layer types). Activations are left at each config's own
default (SiLU for the Llama-style families, GeGLU for Gemma, GPT-OSS's clamped gate, DeepSeek-V4's clamped SiLU):
the harness checks that `swiglu_cupy.patch` fuses what it claims on the configs users actually load.
"""

COMMON = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,
)

# MoE experts run through torch's grouped_mm by default, which on CPU wants every width a multiple of 16 bytes.
_MOE = dict(intermediate_size=32, moe_intermediate_size=16, num_experts_per_tok=2)

# model_type -> (kind, config overrides beyond COMMON)
FAMILIES = {
    "llama": ("dense", {}),
    "mistral": ("dense", {}),
    "qwen2": ("dense", {}),
    "qwen3": ("dense", {}),
    "olmo2": ("dense", {}),
    "gemma": ("dense", {}),
    "gemma2": ("dense", {}),
    "gemma3_text": ("dense", {}),
    "phi3": ("dense", {}),
    "glm": ("dense", {}),
    "glm4": ("dense", {}),
    # DeepSeek-V4's dense MLP (its shared expert, clamped SiLU) beside hash-routed and routed experts.
    "deepseek_v4": ("moe", dict(n_routed_experts=4, n_shared_experts=1, q_lora_rank=16, qk_rope_head_dim=8,
                                head_dim=16, num_key_value_heads=1, index_n_heads=4, index_head_dim=8,
                                index_topk=4, o_groups=2, o_lora_rank=16, sliding_window=4,
                                layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                                mlp_layer_types=["hash_moe", "moe"], **_MOE)),
    "mixtral": ("moe", dict(num_local_experts=4, **_MOE)),
    "qwen2_moe": ("moe", dict(num_experts=4, shared_expert_intermediate_size=16, **_MOE)),
    "qwen3_moe": ("moe", dict(num_experts=4, **_MOE)),
    "olmoe": ("moe", dict(num_experts=4, **_MOE)),
    "deepseek_v3": ("moe", dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4, **_MOE)),
    "gpt_oss": ("moe", dict(num_local_experts=4, **_MOE)),
}


def config_kwargs(family):
    return {**COMMON, **FAMILIES[family][1]}


def tiny_config(family, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **config_kwargs(family), **extra)
