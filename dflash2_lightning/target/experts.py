"""Mixture-of-experts targets: how many of a model's parameters are routed experts, and how many a token uses.

Every routed expert's weights are held in memory, but a token passes through ``num_experts_per_tok`` (k) of the
``E`` routed experts of a layer, so its forward's arithmetic reads ``total - routed + routed * k / E`` parameters.
transformers 5 keeps a layer's routed experts fused in a module named ``experts`` (Qwen3-MoE, Mixtral, gpt-oss:
``mlp.experts.gate_up_proj [E, ...]``); shared experts (``shared_expert``, ``shared_experts``) are not routed, so
they count as always active.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from dflash2_lightning.target.spec import TargetError

#: Config fields naming the routed experts per layer, by family (Qwen-MoE, Mixtral and gpt-oss, DeepSeek).
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class RoutedExperts:
    """The routed experts of a mixture-of-experts model: their parameters (all layers, all experts), the experts per
    layer (``E``) and how many each token is routed to (``k``)."""

    parameters: int
    experts: int
    per_token: int

    def active(self, total: int) -> int:
        """Parameters one token's forward reads, of a model of ``total`` parameters."""
        return total - self.parameters + self.parameters * self.per_token // self.experts


def routed_experts(model: nn.Module, config: Any) -> RoutedExperts | None:
    """The routed experts of ``model`` (built on any device, the meta device included), or None for a dense model.

    A :class:`TargetError` when the model has routed experts but its config does not say how many there are or how
    many a token uses.
    """
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}")
    if not routed:
        return None
    experts = next((int(getattr(config, f)) for f in EXPERT_COUNT_FIELDS if getattr(config, f, None)), 0)
    per_token = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if not experts or not 0 < per_token <= experts:
        raise TargetError(
            f"the target ({type(model).__name__}) has routed experts, but its config gives "
            f"{'/'.join(EXPERT_COUNT_FIELDS)}={experts or None} and num_experts_per_tok={per_token or None}: "
            "give the model's config.json as published"
        )
    return RoutedExperts(parameters=routed, experts=experts, per_token=per_token)
