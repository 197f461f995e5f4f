"""A tiny random-initialised model for fast unit and end-to-end tests."""

import torch


def make_tiny_model(vocab_size: int = 49152, seed: int = 0):
    """A random-initialised 2-layer Llama with the real vocabulary: fast, and real HF code."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).float()
    # a larger init than the default makes the random policy's samples differ visibly
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.5)
    return model


def make_tiny_qwen3(vocab_size: int = 49152, seed: int = 0, tie: bool = False):
    """A random-initialised 2-layer Qwen3 (q/k norms per head, untied output projection unless ``tie``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.5)
        for layer in model.model.layers:  # norms away from 1, so their gradients matter in the checks
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


def make_tiny_qwen3_moe(vocab_size: int = 49152, seed: int = 0):
    """A random-initialised 2-layer Qwen3-MoE: 4 experts, 2 per token (an OLMoE-like routed MLP)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.5)
    return model


def make_tiny_mixtral(seed: int = 0):
    """A random-initialised 2-layer Mixtral (4 experts, 2 per token): a model the fast decoder does not run."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return MixtralForCausalLM(config).float()
