"""Tiny random causal LMs of several transformers families (dense and mixture-of-experts), built in a second, and
saved as local HF model directories with the tiny tokenizer: targets for tests, nothing downloaded.

Norms and routers are perturbed away from their initial values (HF starts norms at 1 and router biases at 0), so a
capture that skipped a norm or a router would show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 512
DENSE = ("llama",)
MOE = ("qwen3_moe", "mixtral")
# Routed experts per layer and those each token uses (num_experts_per_tok), per MoE family here.
EXPERTS = {"qwen3_moe": (8, 2), "mixtral": (4, 2)}


def tiny_config(family: str, **overrides: Any) -> Any:
    """A tiny random config of ``family``: ``llama``, ``qwen3_moe`` or ``mixtral`` (4 layers, hidden 64)."""
    import transformers as tf

    from dflash2_lightning.target.tiny import TINY_DEFAULTS, tiny_tokenizer

    tok = tiny_tokenizer(VOCAB)
    common: dict[str, Any] = {
        **TINY_DEFAULTS,  # the tiny target's geometry: 4 layers, hidden 64, 4 heads of 16, 2 KV heads
        "max_position_embeddings": 512,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")],
    }
    common.update(overrides)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "qwen3_moe":
        experts, active = EXPERTS[family]
        return tf.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=32,
            num_experts=experts,
            num_experts_per_tok=active,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    if family == "mixtral":
        experts, active = EXPERTS[family]
        return tf.MixtralConfig(**common, num_local_experts=experts, num_experts_per_tok=active)
    raise ValueError(f"no tiny config for family {family!r}")


def tiny_hf(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> nn.Module:
    """A seeded tiny random causal LM of ``family`` in eval mode, frozen, with perturbed norms and routers."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return model.requires_grad_(False)


def save_tiny_hf(family: str, directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """``tiny_hf(family)`` written as a local HF model directory with the tiny tokenizer (a ``target.path``)."""
    from dflash2_lightning.target.tiny import tiny_tokenizer

    tiny_hf(family, seed, **overrides).save_pretrained(directory)
    tiny_tokenizer(VOCAB).save_pretrained(directory)
    return directory


def hand_count(family: str) -> tuple[int, int]:
    """(all parameters, those one token reads) of the tiny ``family`` model, from its geometry by hand."""
    cfg = tiny_config(family)
    h, v, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    attention = h * q + 2 * h * kv + q * h + (2 * head_dim if family == "qwen3_moe" else 0)  # q/k norms in Qwen3
    experts, k = EXPERTS[family]
    width = cfg.moe_intermediate_size if family == "qwen3_moe" else cfg.intermediate_size
    expert = 3 * h * width  # gate, up and down projections, no biases
    layer = attention + 2 * h + experts * h  # two norms, the router
    ends = 2 * v * h + h  # embedding, head, final norm
    return ends + layers * (layer + experts * expert), ends + layers * (layer + k * expert)
