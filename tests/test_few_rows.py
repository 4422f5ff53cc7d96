"""Few-row CPU matmuls: rows-first and packed kernels equal F.linear; the choice between them; packing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dflash2_lightning.few_rows as few_rows
from dflash2_lightning.few_rows import (FewRowLinear, pack_rows, packing_available, rows_first_linear,
                                       use_few_row_linears)
from dflash2_lightning.speculative import pack_verify, speculative_generate, target_greedy
from dflash2_lightning.target import TargetSpec, load_target

needs_mkl = pytest.mark.skipif(not packing_available(torch.zeros(1)), reason="torch built without MKL packing")


@pytest.fixture(autouse=True)
def packing_forced(monkeypatch):
    """Declared rows always pack here (unset, packing is timed per shape and this machine decides)."""
    monkeypatch.setenv(few_rows.PACK_ENV, "1")


@needs_mkl
def test_packing_is_timed_once_per_shape_and_a_losing_pack_is_not_kept(monkeypatch):
    monkeypatch.delenv(few_rows.PACK_ENV)
    monkeypatch.setattr(few_rows, "_pack_choice", {})
    layer = _layer()
    packed = torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), 4)
    choice = few_rows.packing_pays(layer.weight, packed, 4)
    assert isinstance(choice, bool) and list(few_rows._pack_choice.values()) == [choice]
    assert few_rows.packing_pays(layer.weight, packed, 4) == choice  # remembered, not timed again
    monkeypatch.setattr(few_rows, "packing_pays", lambda *args: False)
    pack_rows(layer, 4)
    x = torch.randn(4, 96)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer._packed_cache[4][1] is None  # the loss is remembered: no packed copy kept


def test_kernels_are_timed_on_copies_that_overflow_the_cache(monkeypatch):
    monkeypatch.setattr(few_rows, "_last_level_cache_bytes", lambda: 2**20)  # a 1 MiB cache
    weight = torch.randn(160, 96)  # 60 KiB
    copies = few_rows.streamed_copies(weight)
    size = weight.numel() * weight.element_size()
    assert copies[0].data_ptr() == weight.data_ptr() and len(copies) == 2 * 2**20 // size
    assert all(torch.equal(c, weight) for c in copies) and len({c.data_ptr() for c in copies}) == len(copies)
    assert len(few_rows.streamed_copies(torch.randn(2048, 1024))) == 1  # 8 MiB: already past the cache
    monkeypatch.setattr(few_rows, "_last_level_cache_bytes", lambda: 2**40)  # bounded by bytes and copies
    assert len(few_rows.streamed_copies(weight)) == few_rows.MAX_TIMING_COPIES
    assert len(few_rows.streamed_copies(torch.randn(4096, 1024))) == few_rows.TIMING_BYTES // 2**24
    calls = []
    best = few_rows.fastest({"a": [lambda: calls.append("a")] * 3, "b": [lambda: calls.append("b")]})
    assert set(best) == {"a", "b"} and all(0 <= t < 1 for t in best.values())
    assert calls == (["a"] * 3 + ["b"]) * 3  # interleaved rounds, each kernel's calls back to back


@pytest.fixture
def tiny():
    """The shared (memoised) tiny target, its packing undone afterwards so other tests see stock layers."""
    target = load_target(TargetSpec(tiny={}))
    yield target
    for module in target.hf.modules():
        module.__dict__.pop("packed_rows", None)
        module.__dict__.pop("_packed_cache", None)
    target.hf.__dict__.pop("_packed_for", None)


def _layer(inp: int = 96, out: int = 160, bias: bool = True, seed: int = 0) -> FewRowLinear:
    torch.manual_seed(seed)
    layer = nn.Linear(inp, out, bias=bias)
    layer.__class__ = FewRowLinear
    return layer


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 15, 64, 65, 300])  # stock, rows-first, padded, stock
@pytest.mark.parametrize("bias", [False, True])
def test_rows_first_linear_equals_linear(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(1, rows, 24, requires_grad=True)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    got = rows_first_linear(x, layer.weight, layer.bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(grad, layer.weight.sum(0).expand_as(x), rtol=1e-5, atol=1e-5)


def test_rows_first_output_is_row_major_so_the_next_linear_folds():
    """A batched decode step's [b, 1, d] rows come out laid out as F.linear's: the strides of the leading dims
    fold into one, so the next F.linear is one mm and not a bmm over b copies of its weight."""
    layer = nn.Linear(24, 40)
    x = torch.randn(16, 1, 24)
    got = rows_first_linear(x, layer.weight)
    assert got.stride() == torch.nn.functional.linear(x, layer.weight).stride() == (40, 40, 1)
    residual = x.new_zeros(16, 1, 40) + got  # the decode loop's residual add keeps that layout
    assert residual.stride(0) == residual.stride(1) * residual.shape[1]


@pytest.mark.parametrize("forced", ["0", "1", ""])
def test_the_few_row_kernel_is_the_faster_one_or_the_forced_one(forced, monkeypatch):
    monkeypatch.setenv(few_rows.ROWS_FIRST_ENV, forced)
    monkeypatch.setattr(few_rows, "_rows_first_choice", {})
    layer = _layer()
    x = torch.randn(4, 96)
    got = layer(x)
    stock = torch.nn.functional.linear(x, layer.weight, layer.bias)
    rows_first = rows_first_linear(x, layer.weight, layer.bias)
    if forced:
        assert torch.equal(got, rows_first if forced == "1" else stock) and not few_rows._rows_first_choice
    else:  # timed once for this shape, dtype, bucket and thread count, then reused
        (key, choice), = few_rows._rows_first_choice.items()
        assert key == (torch.float32, (160, 96), 4, torch.get_num_threads())  # up to 8 rows: per row count
        assert torch.equal(got, rows_first if choice else stock)
        few_rows._rows_first_choice[key] = not choice  # the remembered choice is what runs next time
        assert torch.equal(layer(x), stock if choice else rows_first)
    assert torch.equal(layer(x[:1]), torch.nn.functional.linear(x[:1], layer.weight, layer.bias))  # one row: stock


def test_every_target_linear_is_a_few_row_linear(tiny):
    linears = [m for m in tiny.hf.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FewRowLinear for m in linears)
    # Same parameters, same outputs: a 4-token forward through the swapped model equals the stock one.
    ids = torch.arange(4).view(1, 4)
    got = tiny.hf(input_ids=ids).logits
    for m in linears:
        m.__class__ = nn.Linear
    try:
        torch.testing.assert_close(got, tiny.hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    finally:
        use_few_row_linears(tiny.hf)


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
def test_packed_rows_equal_linear_and_only_the_declared_count_packs(bias, monkeypatch):
    monkeypatch.setenv(few_rows.ROWS_FIRST_ENV, "0")  # undeclared counts: the stock kernel, exactly
    layer = _layer(bias=bias)
    assert pack_rows(layer, 4, 1, 99) == 1 and layer.packed_rows == {4}  # 1 row and > SMALL_ROWS never pack
    with torch.no_grad():
        for shape in [(4, 96), (1, 4, 96), (2, 2, 96)]:  # any leading dims holding 4 rows
            x = torch.randn(*shape)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                       rtol=1e-5, atol=1e-5)
        assert set(layer._packed_cache) == {4}
        x = torch.randn(3, 96)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert set(layer._packed_cache) == {4}  # 3 rows were not declared: nothing packed for them
    assert "_packed_cache" not in layer.state_dict() and set(layer.state_dict()) == set(nn.Linear(96, 160, bias).state_dict())


@needs_mkl
def test_a_changed_weight_is_packed_again():
    layer = _layer()
    pack_rows(layer, 4)
    x = torch.randn(4, 96)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2)  # in place: same storage, new version
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(160, 96))  # replaced: new storage
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)


@needs_mkl
def test_packed_rows_keep_gradients_by_taking_the_other_kernels():
    layer = _layer()
    pack_rows(layer, 4)
    x = torch.randn(4, 96, requires_grad=True)
    out = layer(x)  # grad enabled: not the packed kernel (it has no backward)
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(grad, layer.weight.sum(0).expand_as(x))
    assert "_packed_cache" not in layer.__dict__


@needs_mkl
def test_packing_is_skipped_with_a_note_when_memory_is_short(monkeypatch, capsys):
    layer = _layer()
    pack_rows(layer, 4)
    monkeypatch.setattr(few_rows, "_available_memory", lambda: 10)
    x = torch.randn(4, 96)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                       rtol=1e-5, atol=1e-5)
    err = capsys.readouterr().err
    assert err.count("not packing a (160, 96) weight for 4-row products") == 1 and "MiB available" in err
    assert not layer.__dict__.get("_packed_cache")


@needs_mkl
def test_pack_weights_0_turns_packing_off(monkeypatch):
    monkeypatch.setenv(few_rows.PACK_ENV, "0")
    layer = _layer()
    pack_rows(layer, 4)
    with torch.no_grad():
        layer(torch.randn(4, 96))
    assert not layer.__dict__.get("_packed_cache")


@needs_mkl
def test_the_loop_packs_the_verify_rows_and_stays_lossless(tiny):
    from dflash2_lightning.model import DraftModel

    torch.manual_seed(0)
    draft = DraftModel(tiny.draft_config(num_hidden_layers=1, block_size=4, target_layer_ids=[1])).eval()
    prompt = tiny.tokenizer("a short prompt to continue")["input_ids"]
    want = target_greedy(tiny, prompt, 24, []).tokens
    got = speculative_generate(tiny, draft, prompt, 24, [])
    assert got.tokens == want
    layers = [m for m in tiny.hf.modules() if isinstance(m, FewRowLinear)]
    head = tiny.hf.get_output_embeddings()
    assert all(4 in m.packed_rows for m in layers) and head.packed_rows == {3, 4}
    assert all(4 in m.__dict__.get("_packed_cache", {}) for m in layers)  # every layer ran its verify packed
    pack_verify(tiny.hf, 4)  # once per target and block size: nothing changes
    assert head.packed_rows == {3, 4}
