"""Warm start: begin the draft as a copy of the target layers that follow its last feature layer.

The draft has the target's geometry, so its layers can start as the target's own instead of random ones. With
features from target layer ``l`` (HF ``hidden_states[l + 1]``): draft layer ``i`` <- target layer ``l + 1 + i``,
``hidden_norm`` <- layer ``l + 1``'s ``input_layernorm``, ``fc`` <- identity on the last feature layer's columns,
``norm`` <- the target's final norm. At step 0 the draft's context K/V are then what target layer ``l + 1``
computes from its input (up to the per-head k_norm a Llama target lacks), and its output is read by the head as
the target's last hidden state is; the block convolution and the selector keep their no-op init. What is left to
learn is running those layers on the block's tokens instead of the target's residual stream.

:func:`init_selector_from_embedding` starts both selector codebooks at each token's coordinates on the target
embedding's top-``r`` principal directions: a batch trains only the rows of its tokens, so on a small budget most
rows would never leave their random init; this way a rarely seen token starts at the vector of tokens it
resembles. Both are ``experimental`` options; what they measured: docs/recipe.md.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash2_lightning.errors import ConfigError
from dflash2_lightning.model import DraftModel
from dflash2_lightning.model.selector import CandidateSelector
from dflash2_lightning.target.shard import full_tensor


def _target_layers(hf: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    base = getattr(hf, "model", None)
    layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
    if layers is None or norm is None:
        raise ConfigError(
            f"init_from_target: the target ({type(hf).__name__}) has no model.layers / model.norm "
            "(a Llama / Qwen-style decoder is needed)"
        )
    return layers, norm


@torch.no_grad()
def init_from_target(draft: DraftModel, hf: nn.Module) -> list[int]:
    """Copy the target layers after the draft's last feature layer into ``draft`` (in place).

    Returns the target layer indices copied (one per draft layer). Raises :class:`ConfigError`
    when the target has too few layers after the feature layer, or a layer's shapes differ. A sharded target's
    weights are gathered whole, one at a time (a collective: every process of the job calls it).
    """
    cfg = draft.config
    layers, final_norm = _target_layers(hf)
    first = max(cfg.target_layer_ids or [0]) + 1
    source = list(range(first, first + cfg.num_hidden_layers))
    if source[-1] >= len(layers):
        raise ConfigError(
            f"init_from_target=true with target_layer_ids={cfg.target_layer_ids} and "
            f"num_hidden_layers={cfg.num_hidden_layers}: needs target layers {source}, but the target "
            f"has {len(layers)} (0..{len(layers) - 1}); use an earlier feature layer or fewer draft layers"
        )
    for layer, index in zip(draft.layers, source):
        theirs = dict(layers[index].named_parameters())
        for name, p in layer.named_parameters():
            if name in theirs:
                if theirs[name].shape != p.shape:
                    raise ConfigError(
                        f"init_from_target: draft {name} has shape {tuple(p.shape)} but target layer "
                        f"{index}'s has {tuple(theirs[name].shape)}: keep the target's geometry"
                    )
                p.copy_(full_tensor(theirs[name]).to(p.dtype))
    input_norm = layers[first].get_parameter("input_layernorm.weight")
    draft.hidden_norm.weight.copy_(full_tensor(input_norm).to(draft.hidden_norm.weight.dtype))
    draft.norm.weight.copy_(full_tensor(final_norm.get_parameter("weight")).to(draft.norm.weight.dtype))
    h = cfg.hidden_size
    fc = torch.zeros_like(draft.fc.weight)
    fc[:, -h:] = torch.eye(h, dtype=fc.dtype)  # features are concatenated in target_layer_ids order
    draft.fc.weight.copy_(fc)
    return source


@torch.no_grad()
def init_selector_from_embedding(selector: CandidateSelector, embedding: torch.Tensor, std: float) -> float:
    """Start ``selector``'s codebooks at the tokens' principal coordinates in ``embedding [V, H]`` (in place).

    Both codebooks get the centred embedding projected on its top-``rank`` principal directions, scaled so
    their entries have RMS ``std`` (the random init's scale, so Adam moves them as fast relative to their
    size); ``hidden_projection`` starts at zero, so the fresh selector still reproduces the backbone's own
    ranking exactly and the first step trains the projection. Returns the share of the embedding's
    variance the ``rank`` directions hold.
    """
    vocab, rank = selector.predecessor_codebook.shape
    if embedding.dim() != 2 or embedding.shape[0] != vocab:
        raise ConfigError(
            f"selector_init=target_embedding: the target's embedding has shape {tuple(embedding.shape)}, "
            f"the selector needs [{vocab}, hidden]"
        )
    if rank > embedding.shape[1]:
        raise ConfigError(
            f"selector_init=target_embedding: selector_rank={rank} must be <= the embedding width "
            f"{embedding.shape[1]} (it takes that many principal directions); use selector_init=random"
        )
    centred = embedding.double() - embedding.double().mean(0)
    variances, directions = torch.linalg.eigh(centred.T @ centred)  # ascending
    coords = centred @ directions[:, -rank:].flip(-1)
    coords *= std / coords.pow(2).mean().sqrt().clamp(min=1e-12)
    for codebook in (selector.predecessor_codebook, selector.successor_codebook):
        codebook.copy_(coords.to(codebook.dtype))
    selector.hidden_projection.weight.zero_()
    return float(variances[-rank:].sum() / variances.sum().clamp(min=1e-12))
