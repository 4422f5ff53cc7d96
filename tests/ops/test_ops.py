"""The two custom ops: block convolution (locality, gradients, op registration) and the lattice walk."""

from __future__ import annotations

import pytest
import torch

from dflash2_lightning.model import DFlashGroupedConv
from dflash2_lightning.ops import (
    block_conv,
    block_conv_reference,
    edge_scores,
    lattice_walk,
    lattice_walk_per_position,
    walk_edge_scores,
)
from dflash2_lightning.ops.lattice_walk import torch_op as walk_op


# ----------------------------------------------------------------------------- block conv
def naive_block_conv(x, base, delta, block_size):
    """The formula, one position and tap at a time (independent of the op's shift helpers)."""
    b, s, h = x.shape
    taps, groups = delta.shape[2], delta.shape[3]
    y = torch.zeros_like(x)
    for i in range(s):
        for t in range(taps):
            if i % block_size >= t:
                kernel = base[t] + delta[:, i, t].repeat_interleave(h // groups, dim=-1)
                y[:, i] += kernel * x[:, i - t]
    return y


def conv_inputs(batch=2, blocks=3, block_size=4, hidden=8, taps=3, groups=2, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = blocks * block_size

    def rand(*shape):  # bounded away from zero, so every tap really contributes
        r = torch.rand(*shape, generator=gen, dtype=dtype) + 0.5
        return r * (torch.randint(0, 2, shape, generator=gen) * 2 - 1).to(dtype)

    return rand(batch, s, hidden), rand(taps, hidden), rand(batch, s, taps, groups)


def moved_positions(before, after):
    """Set of ``(batch, position)`` whose output changed at all."""
    changed = (before != after).any(-1)
    return {tuple(idx) for idx in changed.nonzero().tolist()}


@pytest.mark.parametrize("taps", [1, 2, 3, 4])
def test_block_conv_matches_the_formula(taps):
    x, base, delta = conv_inputs(taps=taps)
    expected = naive_block_conv(x, base, delta, 4)
    torch.testing.assert_close(block_conv(x, base, delta, 4), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(block_conv_reference(x, base, delta, 4), expected, rtol=0, atol=1e-12)


def test_block_conv_on_many_blocks_is_the_reference_per_block():
    x, base, delta = conv_inputs(blocks=3, block_size=4)
    per_block = torch.cat(
        [block_conv_reference(x[:, i : i + 4], base, delta[:, i : i + 4], 4) for i in range(0, 12, 4)], dim=1
    )
    assert torch.equal(block_conv(x, base, delta, 4), per_block)


def test_block_conv_taps_stay_inside_their_block():
    """Perturbing x at position j moves exactly j .. j+T-1, clipped at the end of j's block."""
    bs, taps, s = 4, 3, 12
    x, base, delta = conv_inputs(block_size=bs, taps=taps)
    y = block_conv(x, base, delta, bs)
    for j in range(s):
        bumped = x.clone()
        bumped[1, j] += torch.linspace(0.5, 1.5, x.shape[-1], dtype=x.dtype)
        block_end = (j // bs + 1) * bs
        expected = {(1, i) for i in range(j, min(j + taps, block_end))}
        assert moved_positions(y, block_conv(bumped, base, delta, bs)) == expected, f"position {j}"


def test_block_conv_delta_acts_only_at_its_own_position_and_valid_taps():
    bs, taps = 4, 3
    x, base, delta = conv_inputs(block_size=bs, taps=taps)
    y = block_conv(x, base, delta, bs)
    for i in range(12):
        for t in range(taps):
            bumped = delta.clone()
            bumped[0, i, t] += 1.0
            # A tap that would reach before the block start must be inert.
            expected = {(0, i)} if i % bs >= t else set()
            assert moved_positions(y, block_conv(x, base, bumped, bs)) == expected, f"position {i} tap {t}"


def test_grouped_conv_module_is_causal_within_block():
    """The module: its input side convolves inside the block, its output-side delta is per position."""
    torch.manual_seed(0)
    bs, taps = 4, 2
    conv = DFlashGroupedConv(hidden_size=8, block_size=bs, taps=taps, group_size=4).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x, y_sub = torch.randn(2, 12, 8, dtype=torch.float64), torch.randn(2, 12, 8, dtype=torch.float64)
    out, delta = conv.prepare(x)
    fin = conv.finish(y_sub, delta)
    for j in range(12):
        bumped = x.clone()
        bumped[0, j] += 1.0
        out2, delta2 = conv.prepare(bumped)
        block_end = (j // bs + 1) * bs
        assert moved_positions(out, out2) == {(0, i) for i in range(j, min(j + taps, block_end))}
        assert moved_positions(delta.flatten(2), delta2.flatten(2)) == {(0, j)}
        # finish() with the new delta: position j's kernel changed, taps reach j..j+T-1 only if y moved.
        assert moved_positions(fin, conv.finish(y_sub, delta2)) == {(0, j)}
        bumped_y = y_sub.clone()
        bumped_y[1, j] += 1.0
        assert moved_positions(fin, conv.finish(bumped_y, delta)) == {
            (1, i) for i in range(j, min(j + taps, block_end))
        }


def test_block_conv_rejects_partial_blocks():
    x, base, delta = conv_inputs(blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"sequence length 8 .*multiple of block_size=3"):
        block_conv(x, base, delta, 3)
    with pytest.raises(ValueError, match="block_conv shapes disagree"):
        block_conv(x, base[:, :4], delta, 4)


def test_block_conv_without_taps_is_refused():
    x, base, delta = conv_inputs(blocks=2, block_size=4)
    with pytest.raises(ValueError, match="at least one tap"):  # was an AttributeError on None
        block_conv(x, base[:0], delta[:, :, :0], 4)


def test_block_conv_backward_equals_autograd_of_reference():
    x, base, delta = (
        t.requires_grad_() for t in conv_inputs(batch=2, blocks=2, block_size=4, hidden=4, taps=3, groups=2)
    )
    grad_out = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ours = torch.autograd.grad(block_conv(x, base, delta, 4), (x, base, delta), grad_out)
    ref = torch.autograd.grad(block_conv_reference(x, base, delta, 4), (x, base, delta), grad_out)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *a: block_conv(*a, 4), (x, base, delta))


def test_block_conv_backward_with_some_inputs_frozen():
    x, base, delta = conv_inputs(batch=1, blocks=2, block_size=4, hidden=4, taps=2, groups=2)
    x.requires_grad_()
    (gx,) = torch.autograd.grad(block_conv(x, base, delta, 4).sum(), x)
    (rx,) = torch.autograd.grad(block_conv_reference(x, base, delta, 4).sum(), x)
    torch.testing.assert_close(gx, rx, rtol=0, atol=1e-12)


def test_opcheck_block_conv():
    x, base, delta = conv_inputs(batch=1, blocks=2, block_size=4, hidden=4, taps=2, groups=2)
    torch.library.opcheck(torch.ops.dflash.block_conv.default, (x, base, delta, 4))
    # With gradients: schema, autograd registration and fake impl. (AOT-tracing the backward with
    # dynamic shapes costs ~10 s; the backward's values are pinned by the gradcheck above.)
    grads = tuple(t.clone().requires_grad_() for t in (x, base, delta))
    torch.library.opcheck(
        torch.ops.dflash.block_conv.default,
        (*grads, 4),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


# ----------------------------------------------------------------------------- lattice walk
def naive_walk(cand, unary, proj, anchor, pred, succ):
    """Greedy walk in plain Python, first maximum wins. Returns (tokens, number of real ties met)."""
    tokens, ties = [], 0
    for b in range(cand.shape[0]):
        prev, path = int(anchor[b]), []
        for pos in range(cand.shape[1]):
            scores = [
                float(unary[b, pos, k]) + float((pred[prev] * proj[b, pos] * succ[cand[b, pos, k]]).sum())
                for k in range(cand.shape[2])
            ]
            best = max(scores)
            first = scores.index(best)
            ties += sum(
                1 for k, v in enumerate(scores) if v == best and int(cand[b, pos, k]) != int(cand[b, pos, first])
            )
            prev = int(cand[b, pos, first])
            path.append(prev)
        tokens.append(path)
    return torch.tensor(tokens), ties


def walk_inputs(batch, length, k, vocab, rank, dtype, seed, integer=False):
    gen = torch.Generator().manual_seed(seed)
    cand = torch.stack(
        [torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(length)]) for _ in range(batch)]
    )
    anchor = torch.randint(0, vocab, (batch,), generator=gen)
    if integer:
        # Small integers: every score is exact in any summation order, and ties are common.
        unary = torch.randint(0, 3, (batch, length, k), generator=gen).to(dtype)
        proj = torch.randint(-1, 2, (batch, length, rank), generator=gen).to(dtype)
        pred = torch.randint(-1, 2, (vocab, rank), generator=gen).to(dtype)
        succ = torch.randint(-1, 2, (vocab // 4, rank), generator=gen).to(dtype).repeat_interleave(4, 0)
    else:
        unary = torch.randn(batch, length, k, generator=gen).sort(-1, descending=True).values.to(dtype)
        proj = torch.randn(batch, length, rank, generator=gen).to(dtype)
        pred = torch.randn(vocab, rank, generator=gen).to(dtype)
        succ = torch.randn(vocab, rank, generator=gen).to(dtype)
    return cand, unary, proj, anchor, pred, succ


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lattice_walk_equals_per_position_loop(dtype, seed):
    inputs = walk_inputs(batch=3, length=7, k=5, vocab=40, rank=6, dtype=dtype, seed=seed)
    fast = lattice_walk(*inputs)
    assert fast.dtype == torch.long and fast.shape == (3, 7)
    assert torch.equal(fast, lattice_walk_per_position(*inputs))
    assert torch.equal(fast, naive_walk(*inputs)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lattice_walk_ties_go_to_the_lowest_candidate_index(dtype):
    inputs = walk_inputs(batch=4, length=9, k=6, vocab=48, rank=3, dtype=dtype, seed=3, integer=True)
    expected, ties = naive_walk(*inputs)
    assert ties > 0, "the inputs must contain real ties between different tokens"
    assert torch.equal(lattice_walk(*inputs), expected)
    assert torch.equal(lattice_walk_per_position(*inputs), expected)


def test_lattice_walk_rows_are_independent():
    inputs = walk_inputs(batch=3, length=6, k=4, vocab=30, rank=5, dtype=torch.float32, seed=4)
    batched = lattice_walk(*inputs)
    for b in range(3):
        row = [t[b : b + 1] for t in inputs[:4]] + list(inputs[4:])
        assert torch.equal(lattice_walk(*row), batched[b : b + 1])


def test_lattice_walk_is_seeded_by_the_anchor():
    # Unary all equal: the anchor alone decides the first choice through the codebooks.
    cand = torch.tensor([[[0, 1], [2, 3], [4, 5]]])
    unary, proj = torch.zeros(1, 3, 2, dtype=torch.float64), torch.ones(1, 3, 1, dtype=torch.float64)
    succ = torch.tensor([[1.0], [-1.0]] * 4, dtype=torch.float64)  # even tokens +1, odd -1
    pred = torch.tensor([[1.0], [-1.0]] * 4, dtype=torch.float64)  # even prefers even, odd prefers odd
    assert lattice_walk(cand, unary, proj, torch.tensor([6]), pred, succ).tolist() == [[0, 2, 4]]
    assert lattice_walk(cand, unary, proj, torch.tensor([7]), pred, succ).tolist() == [[1, 3, 5]]


def test_edge_scores_table_matches_definition():
    cand, unary, proj, anchor, pred, succ = walk_inputs(
        batch=2, length=4, k=3, vocab=20, rank=5, dtype=torch.float64, seed=6
    )
    scores = edge_scores(cand, unary, proj, anchor, pred, succ)
    assert scores.shape == (2, 4, 3, 3)
    for b in range(2):
        for pos in range(4):
            for p in range(3):
                prev = anchor[b] if pos == 0 else cand[b, pos - 1, p]
                row = unary[b, pos] + (pred[prev] * proj[b, pos] * succ[cand[b, pos]]).sum(-1)
                torch.testing.assert_close(scores[b, pos, p], row, rtol=0, atol=1e-12)
    assert torch.equal(walk_edge_scores(scores, cand), lattice_walk(cand, unary, proj, anchor, pred, succ))


def test_host_and_device_pointer_walks_agree():
    best = torch.randint(0, 5, (3, 8, 5), generator=torch.Generator().manual_seed(7))
    assert torch.equal(walk_op._follow_on_host(best), walk_op._follow_on_device(best))


def test_lattice_walk_rejects_mismatched_shapes():
    cand, unary, proj, anchor, pred, succ = walk_inputs(
        batch=2, length=4, k=3, vocab=20, rank=5, dtype=torch.float32, seed=8
    )
    with pytest.raises(ValueError, match="lattice_walk"):
        lattice_walk(cand, unary[:, :, :2], proj, anchor, pred, succ)
    with pytest.raises(ValueError, match="lattice_walk shapes disagree"):
        lattice_walk(cand, unary, proj, anchor, pred[:, :4], succ)


def test_opcheck_lattice_walk():
    inputs = walk_inputs(batch=2, length=4, k=3, vocab=20, rank=5, dtype=torch.float32, seed=9)
    torch.library.opcheck(torch.ops.dflash.lattice_walk.default, inputs)


def test_eager_inference_skips_the_dispatcher_with_the_same_numbers():
    """Under no_grad the ops call their implementation directly (no torch.library dispatch): same results."""
    gen = torch.Generator().manual_seed(0)
    x, base = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 16, generator=gen)
    delta = torch.randn(2, 8, 2, 4, generator=gen)
    cand = torch.randint(0, 50, (2, 3, 4), generator=gen)
    unary, proj = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, 5, generator=gen)
    anchor, books = torch.randint(0, 50, (2,), generator=gen), torch.randn(2, 50, 5, generator=gen)
    with torch.no_grad():
        assert torch.equal(block_conv(x, base, delta, 4), torch.ops.dflash.block_conv(x, base, delta, 4))
        assert torch.equal(
            lattice_walk(cand, unary, proj, anchor, books[0], books[1]),
            torch.ops.dflash.lattice_walk(cand, unary, proj, anchor, books[0], books[1]),
        )
    base.requires_grad_(True)  # with autograd the op (and its backward) is used
    block_conv(x, base, delta, 4).sum().backward()
    assert base.grad is not None and base.grad.shape == base.shape
