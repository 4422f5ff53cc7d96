"""On a CUDA device: the Triton kernels against the reference ops, the ops' dispatch to them, and the
ahead-of-time PTX launched the way TensorRT launches it. ``pytest -m gpu`` runs these (and the TensorRT
tests); without a CUDA device they are skipped, or fail when ``-m gpu`` asked for them."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import (
    BS,
    DEVICE,
    GROUPS,
    RANK,
    TAPS,
    TOL,
    TOP_K,
    CudaDriver,
    H,
    V,
    conv_inputs,
    reference_walk,
    walk_inputs,
)

from dflash2_lightning import ops

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s", [(1, BS), (8, BS), (2, 2048)])
@pytest.mark.parametrize("side", [0, 1])
def test_block_conv_kernel_equals_the_reference(dtype, b, s, side):
    from dflash2_lightning.ops.block_conv.triton_kernel import block_conv

    x, base, both = conv_inputs(b, s, H, TAPS, GROUPS, dtype)
    delta = both[:, :, side]  # a strided slice of the [B,S,2,T,G] projection, used in place
    got = block_conv(x, base, delta, BS).float()
    want = ops.block_conv_reference(x.float(), base.float(), delta.float(), BS)
    assert (got - want).abs().max().item() <= TOL[dtype] * 10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", [1, 8, 64])
def test_lattice_walk_kernel_equals_the_reference(dtype, b):
    from dflash2_lightning.ops.lattice_walk.triton_kernel import lattice_walk

    args = walk_inputs(b, BS - 1, TOP_K, RANK, V, dtype)
    agree = (lattice_walk(*args) == reference_walk(*args)).float().mean().item()
    # float32 sums in another order than the reference only at exact near-ties; half precision flips more.
    assert agree == 1.0 if dtype == torch.float32 else agree > 0.97


def test_lattice_walk_kernel_sends_ties_to_the_lowest_index():
    from dflash2_lightning.ops.lattice_walk.triton_kernel import lattice_walk

    cand, _, proj, anchor, pred, _ = walk_inputs(4, BS - 1, TOP_K, RANK, V, torch.float32, seed=1)
    flat = (cand, torch.zeros_like(cand, dtype=torch.float32), proj, anchor, pred, torch.zeros(V, RANK, device=DEVICE))
    assert torch.equal(lattice_walk(*flat), cand[:, :, 0])


def test_the_ops_dispatch_to_the_kernels_with_gradients(monkeypatch):
    from dflash2_lightning.ops import dispatch

    assert dispatch.cuda_block_conv is not None and dispatch.cuda_lattice_walk is not None  # installed on import
    calls = {"conv": 0, "walk": 0}
    conv, walk = dispatch.cuda_block_conv, dispatch.cuda_lattice_walk
    monkeypatch.setattr(
        dispatch, "cuda_block_conv", lambda *a: calls.__setitem__("conv", calls["conv"] + 1) or conv(*a)
    )
    monkeypatch.setattr(
        dispatch, "cuda_lattice_walk", lambda *a: calls.__setitem__("walk", calls["walk"] + 1) or walk(*a)
    )
    x, base, both = conv_inputs(2, BS, H, TAPS, GROUPS, torch.float32)
    x.requires_grad_(True)
    base = base.clone().requires_grad_(True)
    delta = both[:, :, 0].clone().requires_grad_(True)
    y = ops.block_conv(x, base, delta, BS)
    grads = torch.autograd.grad(y.square().sum(), (x, base, delta))
    xr, br, dr = (t.detach().clone().requires_grad_(True) for t in (x, base, delta))
    yr = ops.block_conv_reference(xr, br, dr, BS)
    grads_ref = torch.autograd.grad(yr.square().sum(), (xr, br, dr))
    assert calls["conv"] == 1
    torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)
    scale = max(1.0, grads_ref[1].abs().max().item())
    assert max((g - r).abs().max().item() for g, r in zip(grads, grads_ref)) < 1e-2 * scale
    args = walk_inputs(8, BS - 1, TOP_K, RANK, V, torch.float32)
    assert torch.equal(ops.lattice_walk(*args), reference_walk(*args)) and calls["walk"] == 1


def test_a_dflash2_draft_drafts_the_same_tokens_with_and_without_the_kernels(monkeypatch):
    from dflash2_lightning.config import DraftConfig
    from dflash2_lightning.model.draft import DraftModel
    from dflash2_lightning.ops import dispatch

    torch.manual_seed(0)
    cfg = DraftConfig(
        hidden_size=H,
        vocab_size=V,
        num_target_layers=8,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        block_size=BS,
    )
    model = DraftModel(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "kernel_projection" in name or "successor_codebook" in name:
                p.normal_(std=0.05)  # away from the exact no-op start, so the kernels matter
    embed = torch.nn.Embedding(V, H).to(DEVICE)
    head = torch.nn.Linear(H, V, bias=False).to(DEVICE)
    b, c = 4, 64
    feats = torch.randn(b, c, cfg.num_target_features * H, device=DEVICE)
    positions = torch.arange(c, device=DEVICE).expand(b, c)
    anchor = torch.randint(0, V, (b,), device=DEVICE)
    with torch.no_grad():
        ctx = model.context_kv(feats, positions)
        with_kernels = model.draft_block(anchor, ctx, embed, head)
        monkeypatch.setattr(dispatch, "cuda_block_conv", None)
        monkeypatch.setattr(dispatch, "cuda_lattice_walk", None)
        reference = model.draft_block(anchor, ctx, embed, head)
    assert (with_kernels == reference).float().mean().item() >= 0.95


@pytest.mark.parametrize("dtype,name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_ahead_of_time_block_conv_ptx_launches_as_tensorrt_launches_it(dtype, name):
    from dflash2_lightning.ops.block_conv.tensorrt_plugin import block_conv_launch
    from dflash2_lightning.ops.block_conv.triton_kernel import compile_block_conv

    kernel = compile_block_conv(name, H)  # the build GPU's arch, as the plugin compiles it
    x, base, both = conv_inputs(8, BS, H, TAPS, GROUPS, dtype)
    delta = both[:, :, 1].contiguous()
    y = torch.empty_like(x)
    scalars, grid = block_conv_launch(
        x.shape, base.shape, delta.shape, BS, kernel.constants["BLOCK_ROWS"], kernel.constants["BLOCK_H"]
    )
    CudaDriver().launch(kernel, grid, [x, base, delta, *scalars, y])
    err = (y.float() - ops.block_conv_reference(x.float(), base.float(), delta.float(), BS)).abs().max().item()
    assert err <= TOL[dtype] * 10


def test_ahead_of_time_lattice_walk_ptx_launches_as_tensorrt_launches_it():
    from dflash2_lightning.ops.lattice_walk.tensorrt_plugin import lattice_walk_launch
    from dflash2_lightning.ops.lattice_walk.triton_kernel import compile_lattice_walk

    kernel = compile_lattice_walk("fp32", TOP_K, RANK)
    args = walk_inputs(8, BS - 1, TOP_K, RANK, V, torch.float32)
    tokens = torch.empty(8, BS - 1, dtype=torch.long, device=DEVICE)
    scalars, grid = lattice_walk_launch(args[0].shape, args[2].shape)
    CudaDriver().launch(kernel, grid, [*args, *scalars, tokens])
    assert torch.equal(tokens, reference_walk(*args))
