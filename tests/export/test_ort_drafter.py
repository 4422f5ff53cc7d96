"""The onnxruntime drafter: same tokens as the torch draft, cycle after cycle and inside the speculative loop."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import randomize_draft_

from dflash2_lightning.decode.drafter import TorchDrafter, as_drafter
from dflash2_lightning.decode.speculative import speculative_generate
from dflash2_lightning.export.onnx import OrtDrafter
from dflash2_lightning.export.onnx.export import export_drafter, target_embedding_and_head
from dflash2_lightning.model import DraftModel
from dflash2_lightning.target.load import load_target
from dflash2_lightning.target.spec import TargetSpec

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> SimpleNamespace:
    """A tiny random target, a randomized 1-layer DFlash2 draft of its geometry, exported in float32."""
    target = load_target(TargetSpec(tiny={}))
    cfg = target.draft_config(num_hidden_layers=1, block_size=4, selector_rank=8, selector_top_k=6)
    draft = randomize_draft_(DraftModel(cfg), seed=0).eval()
    out = tmp_path_factory.mktemp("ort_drafter")
    export_drafter(draft, *target_embedding_and_head(target), out)
    return SimpleNamespace(target=target, cfg=cfg, draft=draft, dir=out, drafter=OrtDrafter(out, threads=1))


def _close(a: Any, b: Any) -> None:
    assert a.positions.tolist() == b.positions.tolist()
    for x, y in zip(a.layers, b.layers):
        torch.testing.assert_close(x.keys, y.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.values, y.values, atol=1e-5, rtol=1e-5)


def test_drafter_offers_the_loop_interface(setup):
    drafter = setup.drafter
    assert drafter.block_size == setup.cfg.block_size and drafter.path == "selector"
    assert drafter.target_layer_ids == setup.cfg.target_layer_ids
    assert as_drafter(drafter) is drafter and drafter.eval() is drafter
    assert drafter.config.to_hf_dict() == setup.cfg.to_hf_dict()


@torch.no_grad()
def test_cycles_of_append_crop_and_draft_match_torch(setup):
    """Several draft/verify cycles on the same inputs: every block of tokens equals the torch draft's."""
    draft, drafter, target = setup.draft, setup.drafter, setup.target
    cfg, gen = setup.cfg, torch.Generator().manual_seed(0)
    width = cfg.num_target_features * cfg.hidden_size
    batch, length = 2, 9
    features, positions = torch.randn(batch, length, width, generator=gen), torch.arange(length).expand(batch, length)
    ref = draft.context_kv(features, positions)  # the concatenating reference cache
    ort = drafter.new_cache(batch, 64).append(drafter.context_kv(features, positions))  # preallocated, in place
    assert ort.capacity == 64 and ort.keys[0].shape[2] == 64 + cfg.block_size
    drafted = 0
    for cycle in range(6):
        _close(ort, ref)
        anchor = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
        expected = draft.draft_block(anchor, ref, target.embed, target.head, length)
        tokens = drafter.draft_block(anchor, ort, target.embed, target.head, length)
        assert tokens.dtype == torch.long and tokens.shape == (batch, cfg.block_size - 1)
        assert torch.equal(tokens, expected), f"cycle {cycle}"
        drafted += tokens.numel()
        if cycle == 3:  # a rollback: drop the last two context positions
            ref, ort, length = ref.crop(length - 2), ort.crop(length - 2), length - 2
        new = int(torch.randint(1, cfg.block_size + 1, (), generator=gen))  # anchor + accepted drafts
        features = torch.randn(batch, new, width, generator=gen)
        positions = (length + torch.arange(new)).expand(batch, new)
        ref = ref.append(draft.context_kv(features, positions))
        ort = ort.append(drafter.context_kv(features, positions))
        length += new
        assert ort.length == ref.length == length
    # start defaults to the position after the cache, as in the torch draft.
    anchor = torch.tensor([3, 7])
    assert torch.equal(drafter.draft_block(anchor, ort), draft.draft_block(anchor, ref, target.embed, target.head))
    assert drafted == 6 * batch * (cfg.block_size - 1)


class _Recording:
    """Wraps a drafter and keeps every block it proposes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.blocks = inner, []
        self.block_size, self.target_layer_ids = inner.block_size, inner.target_layer_ids

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> Any:
        return self.inner.context_kv(features, positions)

    def draft_block(self, anchor: torch.Tensor, context: Any, embed: Any, head: Any, start: int) -> torch.Tensor:
        tokens = self.inner.draft_block(anchor, context, embed, head, start)
        self.blocks.append(tokens[0].tolist())
        return tokens


def test_speculative_loop_same_tokens_and_acceptance(setup):
    """The exported graphs drive the speculative loop: same drafts, same acceptance, same output."""
    prompt = torch.randint(0, setup.cfg.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name, drafter in (("torch", TorchDrafter(setup.draft)), ("onnxruntime", setup.drafter)):
        recording = _Recording(drafter)
        result = speculative_generate(setup.target, recording, prompt, max_new_tokens=20)
        runs[name] = (result, recording.blocks)
    (ref, ref_blocks), (ort, ort_blocks) = runs["torch"], runs["onnxruntime"]
    assert len(ref_blocks) >= 3 and ort_blocks == ref_blocks
    assert ort.tokens == ref.tokens and ort.accepted == ref.accepted
    assert ort.stats().tau == ref.stats().tau
    # Without the recording wrapper the loop preallocates the drafter's own cache: same output again.
    direct = speculative_generate(setup.target, setup.drafter, prompt, max_new_tokens=20)
    assert type(direct.context).__name__ == "DraftCache" and direct.tokens == ref.tokens
    assert direct.context.length == direct.anchors[-1]


def test_old_exports_are_refused_with_the_fix(setup, tmp_path):
    shutil.copytree(setup.dir, tmp_path / "v1")
    manifest = json.loads((tmp_path / "v1" / "drafter.json").read_text())
    (tmp_path / "v1" / "drafter.json").write_text(json.dumps({**manifest, "format_version": 1}))
    with pytest.raises(ValueError, match="format_version=1.*re-export"):
        OrtDrafter(tmp_path / "v1")


def test_onnxruntime_drafter_is_greedy_only(setup):
    """Sampling needs the proposal distributions; the exported draft_step graph returns tokens only."""
    with pytest.raises(ValueError, match="temperature=1.0 is invalid for OrtDrafter: it drafts greedily only"):
        speculative_generate(setup.target, setup.drafter, [1, 2, 3], max_new_tokens=4, temperature=1.0)


def test_bad_inputs_and_unrunnable_exports_are_refused(setup, tmp_path):
    with pytest.raises(ValueError, match="features"):
        setup.drafter.context_kv(torch.zeros(1, 3, 5), torch.zeros(1, 2, dtype=torch.long))
    shutil.copytree(setup.dir, tmp_path / "bf16")
    manifest = json.loads((tmp_path / "bf16" / "drafter.json").read_text())
    (tmp_path / "bf16" / "drafter.json").write_text(json.dumps({**manifest, "dtype": "bf16"}))
    with pytest.raises(ValueError, match="bfloat16"):
        OrtDrafter(tmp_path / "bf16")
    with pytest.raises(FileNotFoundError, match="drafter.json"):
        OrtDrafter(tmp_path / "nothing")
