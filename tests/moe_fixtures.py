"""Small random mixture-of-experts models of each family transformers 5 fuses (structure, not quality):
hidden 256, 2 layers, 8 experts, top-2, expert intermediate 128 (Qwen2-MoE: shared expert 256)."""

from __future__ import annotations

import torch

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def make_moe_model(family: str, *, seed: int = 0, layers: int = 2, experts: int = 8, top_k: int = 2,
                   vocab_size: int = 512):
    import transformers

    common = dict(hidden_size=256, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=vocab_size, max_position_embeddings=256, tie_word_embeddings=False,
                  num_experts_per_tok=top_k, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=128, intermediate_size=384,
                                             num_experts=experts, head_dim=64, decoder_sparse_step=1, mlp_only_layers=[])
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, moe_intermediate_size=128, intermediate_size=384,
                                             shared_expert_intermediate_size=256, num_experts=experts)
        cls = transformers.Qwen2MoeForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=128, num_local_experts=experts)
        cls = transformers.MixtralForCausalLM
    elif family == "deepseek_v3":  # MLA attention, a dense first layer, routed + shared experts
        config = transformers.DeepseekV3Config(
            **common, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=experts, n_shared_experts=1,
            first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
            v_head_dim=64, n_group=1, topk_group=1)
        cls = transformers.DeepseekV3ForCausalLM
    elif family == "olmoe":
        config = transformers.OlmoeConfig(**common, intermediate_size=128, num_experts=experts)
        cls = transformers.OlmoeForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # routers far from uniform, so that top-k choices are not near ties
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def save_moe_model(family: str, folder, **kwargs):
    model = make_moe_model(family, **kwargs)
    model.save_pretrained(folder)
    return folder
