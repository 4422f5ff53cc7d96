"""Features captured by hooks (target/capture.py) equal the old ``output_hidden_states`` path bit for bit.

The old computation (every hidden state kept, the needed ones concatenated, the logits of the full forward) is
written out here as the reference, for the tiny random target (Qwen3) and tiny HF targets of other families
(Llama, and the mixture-of-experts Qwen3-MoE and Mixtral), in float32 and bfloat16, for layer sets with the last
layer (HF's normed state) and a repeat, in each of the three ways the project calls it.
"""

from __future__ import annotations

import pytest
import torch
from hf_families import tiny_hf
from memory_helpers import LiveTensorBytes

from dflash2_lightning.target.capture import capture_features
from dflash2_lightning.target.load import build_target
from dflash2_lightning.target.spec import TargetError, TargetSpec
from dflash2_lightning.target.target import Target
from dflash2_lightning.target.tiny import tiny_tokenizer

FAMILIES = ("tiny", "llama", "qwen3_moe", "mixtral")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYER_SETS = ([1, 2], [0, 2], [3], [1, 1, 3], [2, 0])  # 3: the last layer; a repeat; out of order


def target_of(family: str, dtype: str) -> Target:
    if family == "tiny":
        return build_target(TargetSpec(tiny={}, dtype=dtype, seed=3))
    return Target(tiny_hf(family, seed=3, dtype=DTYPES[dtype]), tiny_tokenizer(512))


def old_features(target: Target, ids: torch.Tensor, mask: torch.Tensor, layer_ids: list[int]) -> dict:
    """What Target.features computed before the hooks: every hidden state kept."""
    with torch.no_grad():
        out = target.hf(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True, use_cache=False)
    return {
        "features": torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1),
        "logits": out.logits,
        "last_hidden": out.hidden_states[-1],
    }


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (3, 24), generator=g)
    mask = torch.ones(3, 24, dtype=torch.bool)
    mask[2, 16:] = False  # right padding
    return ids, mask


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_equal_the_output_hidden_states_path(family: str, dtype: str) -> None:
    target = target_of(family, dtype)
    ids, mask = batch(target.vocab_size)
    for layer_ids in LAYER_SETS:
        ref = old_features(target, ids, mask, layer_ids)
        full = target.features(ids, mask, layer_ids)  # the cache build's call
        online = target.features(ids, mask, layer_ids, logits=False, last_hidden=True)  # the online fit's
        bare = target.features(ids, mask, layer_ids, logits=False)
        for out in (full, online, bare):
            assert out.features.dtype == ref["features"].dtype
            assert torch.equal(out.features, ref["features"]), (family, dtype, layer_ids)
        assert torch.equal(full.logits, ref["logits"]) and full.last_hidden is None
        assert online.logits is None and torch.equal(online.last_hidden, ref["last_hidden"])
        assert bare.logits is None and bare.last_hidden is None
        both = target.features(ids, mask, layer_ids, logits=True, last_hidden=True)
        assert torch.equal(both.logits, ref["logits"]) and torch.equal(both.last_hidden, ref["last_hidden"])


def test_hooks_equal_the_old_path_under_autocast() -> None:
    """The offline cache build runs a float32 target under bf16 autocast: the features keep the dtype the layers
    give (as torch.cat of the kept states did)."""
    target = target_of("tiny", "float32")
    ids, mask = batch(target.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = old_features(target, ids, mask, [0, 3])
        out = target.features(ids, mask, [0, 3])
    assert out.features.dtype == ref["features"].dtype
    assert torch.equal(out.features, ref["features"]) and torch.equal(out.logits, ref["logits"])


def test_no_hook_is_left_behind_and_no_layer_runs_past_the_need() -> None:
    target = target_of("tiny", "float32")
    ids, mask = batch(target.vocab_size)
    ran: list[str] = []
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: ran.append(f"layer{i}"))
        for i, layer in enumerate(target.hf.model.layers)
    ]
    handles.append(target.hf.lm_head.register_forward_hook(lambda m, a, o: ran.append("head")))
    try:
        target.features(ids, mask, [1], logits=False)
        assert ran == ["layer0", "layer1"]  # stopped after the last layer read: no later layer, no head
        ran.clear()
        target.features(ids, mask, [1], logits=False, last_hidden=True)
        assert ran == ["layer0", "layer1", "layer2", "layer3"]  # the final norm, then stopped: the head never runs
    finally:
        for handle in handles:
            handle.remove()
    hooks = [m._forward_hooks for m in target.hf.modules()]
    assert not any(hooks), "capture left a hook on the target"


def test_an_architecture_without_a_decoder_layer_list_is_refused() -> None:
    target = target_of("tiny", "float32")
    saved = target.hf.model.layers
    target.hf.model.layers = torch.nn.ModuleList(list(saved)[:2])  # a list that is not the config's 4 layers
    try:
        with pytest.raises(TargetError, match="no list of its 4 decoder layers"):
            capture_features(target.hf, torch.zeros(1, 4, dtype=torch.long), None, [1], logits=False, last_hidden=False)
    finally:
        target.hf.model.layers = saved


def live_peak(fn, target: Target, ids: torch.Tensor) -> int:
    """Peak bytes of tensors alive during ``fn`` beyond the weights and the input (counted by the tensors)."""
    with LiveTensorBytes() as tensors:
        tensors.track(*target.hf.parameters(), *target.hf.buffers(), ids)
        base = tensors.live
        result = fn()
        peak = tensors.peak - base
        del result
    return peak


def test_hooks_hold_fewer_hidden_states_than_output_hidden_states() -> None:
    """At a size where the hidden states dominate (12 layers, 2 x 256 tokens, a 64-token vocabulary), the online
    call holds at least 12 + 1 - 2 - 1 states fewer than the old path (its 13 states kept, against the 2 features
    and the final state)."""
    target = Target(tiny_hf("llama", num_hidden_layers=12, vocab_size=512, hidden_size=128), tiny_tokenizer(512))
    ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(0))
    state = 2 * 256 * 128 * 4

    def old():
        with torch.no_grad():
            out = target.hf(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
            return torch.cat([out.hidden_states[i + 1] for i in (1, 6)], dim=-1), out.hidden_states[-1]

    before = live_peak(old, target, ids)
    after = live_peak(lambda: target.features(ids, None, [1, 6], logits=False, last_hidden=True), target, ids)
    assert before - after >= (12 + 1 - 2 - 1) * state, (before / state, after / state)
