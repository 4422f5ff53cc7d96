"""The target's features captured by forward hooks on the decoder layers the draft reads, not by keeping every layer.

HF's ``output_hidden_states=True`` keeps all ``num_hidden_layers + 1`` hidden states alive until the forward
returns, though a draft reads a handful (Qwen3-8B: 37 states of ``B*S*H`` for 5). Here a forward hook on each
decoder layer the draft reads copies that layer's output into its slice of one ``[B, S, n*H]`` tensor as the layer
runs, so every other state is freed as soon as the next layer has read it, and no ``torch.cat`` copy is made.

The forward is stopped (by an exception raised from a hook and caught around the call) as soon as nothing more is
needed: after the last layer read when neither the final hidden state nor the logits are, right after the decoder
(its final norm) when the final hidden state is read but the logits are not, so the head never runs.

HF's ``hidden_states[l + 1]`` is layer ``l``'s output, except for the last layer: ``hidden_states[L]`` is the
decoder's normed output (``last_hidden_state``). A request for layer ``L - 1`` is served from the decoder's output,
so the features equal the ``output_hidden_states`` path's bit for bit (``tests/target/test_capture.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from dflash2_lightning.target.spec import TargetError


class Captured(NamedTuple):
    """What :func:`capture_features` computed: the features, the logits (or None), the final normed hidden state
    (or None)."""

    features: torch.Tensor
    logits: torch.Tensor | None
    last_hidden: torch.Tensor | None


class _Stop(Exception):
    """Raised by the hook after which nothing the caller asked for remains to be computed."""


def decoder_and_layers(hf: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The decoder (HF base model, whose output is the final normed hidden state) of a causal LM and its list of
    ``num_hidden_layers`` decoder layers; a :class:`TargetError` for an architecture laid out otherwise."""
    get_decoder = getattr(hf, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    expected = int(getattr(hf.config, "num_hidden_layers", -1))
    if not isinstance(layers, nn.ModuleList) or len(layers) != expected:
        raise TargetError(
            f"the target's architecture ({type(hf).__name__}) has no list of its {expected} decoder layers at "
            "get_decoder().layers, where the draft's features are captured; use a target of a transformers "
            "decoder-only family (Llama, Qwen, Mistral, their mixture-of-experts variants)"
        )
    assert decoder is not None  # layers was found on it
    return decoder, layers


def _tensor_of(output: Any) -> torch.Tensor:
    """A layer's (or the decoder's) output hidden state, whatever the family wraps it in."""
    if isinstance(output, torch.Tensor):
        return output
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    return output[0]


class _FeatureBuffer:
    """The ``[B, S, n*H]`` features, allocated at the first captured state (its shape, dtype and device, which
    autocast may set), each slot written once. A state of another dtype promotes the buffer as ``torch.cat``
    would, so the result is the concatenation's bit for bit."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.tensor: torch.Tensor | None = None
        self.written: set[int] = set()

    def write(self, state: torch.Tensor, slots: list[int]) -> None:
        h = state.shape[-1]
        if self.tensor is None:
            self.tensor = state.new_empty(*state.shape[:-1], self.slots * h)
        elif self.tensor.dtype != state.dtype:
            self.tensor = self.tensor.to(torch.promote_types(self.tensor.dtype, state.dtype))
        for slot in slots:
            self.tensor[..., slot * h : (slot + 1) * h].copy_(state)
            self.written.add(slot)


@torch.no_grad()
def capture_features(
    hf: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_ids: list[int],
    logits: bool,
    last_hidden: bool,
) -> Captured:
    """Run the causal LM ``hf`` once: ``cat([hidden_states[l + 1] for l in layer_ids], -1)``, the logits at every
    position when ``logits``, the final normed hidden state when ``last_hidden``; no more of the model than they
    need (see the module's docstring). ``layer_ids`` are valid ids of ``hf``'s layers (repeats allowed)."""
    decoder, layers = decoder_and_layers(hf)
    last = len(layers) - 1
    slots_of: dict[int, list[int]] = {}
    for slot, layer in enumerate(layer_ids):
        slots_of.setdefault(int(layer), []).append(slot)
    final_slots = slots_of.pop(last, [])  # HF's hidden_states[L] is the decoder's normed output
    needs_final = last_hidden or bool(final_slots)
    stop_after = None if logits or needs_final else max(slots_of)
    buffer = _FeatureBuffer(len(layer_ids))
    final: list[torch.Tensor] = []

    def layer_hook(index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            buffer.write(_tensor_of(output), slots_of[index])
            if index == stop_after:
                raise _Stop

        return hook

    def decoder_hook(module: nn.Module, args: Any, output: Any) -> None:
        state = _tensor_of(output)
        buffer.write(state, final_slots)
        final.append(state)
        if not logits:
            raise _Stop  # the head is not needed: it never runs

    handles = [layers[index].register_forward_hook(layer_hook(index)) for index in slots_of]
    if needs_final:
        handles.append(decoder.register_forward_hook(decoder_hook))
    out_logits = None
    try:
        # Always through the top module (its forward prepares the mask and positions); logits_to_keep=1 when the
        # forward runs to the head for nothing else: no [B, S, V] logits.
        out = hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=0 if logits else 1)
        out_logits = out.logits if logits else None
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if buffer.tensor is None or len(buffer.written) != len(layer_ids):
        raise TargetError(
            f"the target ({type(hf).__name__}) did not run the decoder layers {sorted(set(layer_ids))} it was asked "
            "for: its forward does not call get_decoder().layers in order; use a transformers decoder-only family"
        )
    return Captured(buffer.tensor, out_logits, final[0] if last_hidden else None)
