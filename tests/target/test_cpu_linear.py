"""Few-row CPU matmuls: rows-first and packed kernels equal F.linear; the typed setting that chooses between
them, held on the target; packing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dflash2_lightning.target.cpu_linear as cpu_linear
from dflash2_lightning.decode.speculative import speculative_generate, target_greedy
from dflash2_lightning.target.cpu_linear import (
    CpuLinears,
    FewRowLinear,
    declare_rows,
    install_cpu_linears,
    packing_available,
    rows_first_linear,
)
from dflash2_lightning.target.load import load_target
from dflash2_lightning.target.spec import TargetError, TargetSpec

needs_mkl = pytest.mark.skipif(not packing_available(torch.zeros(1)), reason="torch built without MKL packing")


def _layer(
    setting: str = "packed",
    inp: int = 96,
    out: int = 160,
    bias: bool = True,
    seed: int = 0,
    kernels: CpuLinears | None = None,
) -> FewRowLinear:
    """A FewRowLinear over a fresh nn.Linear; "packed" by default: declared rows always pack here."""
    torch.manual_seed(seed)
    return FewRowLinear.from_linear(nn.Linear(inp, out, bias=bias), kernels or CpuLinears(setting))


@needs_mkl
def test_packing_is_timed_once_per_shape_and_a_losing_pack_is_not_kept(monkeypatch):
    kernels = CpuLinears("auto")
    layer = _layer(kernels=kernels)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), 4)
    choice = kernels.packing_pays(layer.weight, packed, 4)
    assert isinstance(choice, bool) and list(kernels.packing_choices.values()) == [choice]
    assert kernels.packing_pays(layer.weight, packed, 4) == choice  # remembered, not timed again
    monkeypatch.setattr(kernels, "packing_pays", lambda *args: False)
    declare_rows(layer, 4)
    x = torch.randn(4, 96)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer.packed[4][1] is None  # the loss is remembered: no packed copy kept


def test_kernels_are_timed_on_copies_that_overflow_the_cache():
    weight = torch.randn(160, 96)  # 60 KiB
    copies = cpu_linear.streamed_copies(weight, 2**20)  # a 1 MiB cache
    size = weight.numel() * weight.element_size()
    assert copies[0].data_ptr() == weight.data_ptr() and len(copies) == 2 * 2**20 // size
    assert all(torch.equal(c, weight) for c in copies) and len({c.data_ptr() for c in copies}) == len(copies)
    assert len(cpu_linear.streamed_copies(torch.randn(2048, 1024), 2**20)) == 1  # 8 MiB: already past the cache
    assert len(cpu_linear.streamed_copies(weight, 2**40)) == cpu_linear.MAX_TIMING_COPIES  # bounded
    assert len(cpu_linear.streamed_copies(torch.randn(4096, 1024), 2**40)) == cpu_linear.TIMING_BYTES // 2**24
    assert CpuLinears("auto", cache_bytes=2**20).cache_bytes == 2**20
    assert CpuLinears("auto").cache_bytes == cpu_linear.last_level_cache_bytes()  # read from sysfs once, kept
    calls = []
    best = cpu_linear.fastest({"a": [lambda: calls.append("a")] * 3, "b": [lambda: calls.append("b")]})
    assert set(best) == {"a", "b"} and all(0 <= t < 1 for t in best.values())
    assert calls == (["a"] * 3 + ["b"]) * 3  # interleaved rounds, each kernel's calls back to back


@pytest.fixture
def tiny():
    """The shared (memoised) tiny target, its declared verify rows undone afterwards."""
    target = load_target(TargetSpec(tiny={}))
    yield target
    for module in target.hf.modules():
        if isinstance(module, FewRowLinear):
            module.packed_rows, module.packed = frozenset(), {}
    target.verify_block_sizes.clear()


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


@pytest.mark.parametrize("setting", ["stock", "rows_first", "auto"])
def test_the_few_row_kernel_is_the_set_one_or_the_faster_one(setting):
    kernels = CpuLinears(setting)
    layer = _layer(kernels=kernels)
    x = torch.randn(4, 96)
    got = layer(x)
    stock = torch.nn.functional.linear(x, layer.weight, layer.bias)
    rows_first = rows_first_linear(x, layer.weight, layer.bias)
    if setting != "auto":
        assert torch.equal(got, rows_first if setting == "rows_first" else stock) and not kernels.rows_first_choices
    else:  # timed once for this shape, dtype, bucket and thread count, held on the CpuLinears, then reused
        ((key, choice),) = kernels.rows_first_choices.items()
        assert key == (torch.float32, (160, 96), 4, torch.get_num_threads())  # up to 8 rows: per row count
        assert torch.equal(got, rows_first if choice else stock)
        kernels.rows_first_choices[key] = not choice  # the remembered choice is what runs next time
        assert torch.equal(layer(x), stock if choice else rows_first)
    assert torch.equal(layer(x[:1]), torch.nn.functional.linear(x[:1], layer.weight, layer.bias))  # one row: stock


def test_every_target_linear_is_a_few_row_linear_sharing_its_parameters(tiny):
    linears = [m for m in tiny.hf.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FewRowLinear and m.kernels is tiny.cpu_linears for m in linears)
    assert tiny.cpu_linears.setting == "auto"
    # Same parameters, same outputs: a 4-token forward through the model equals one through plain linears.
    ids = torch.arange(4).view(1, 4)
    got = tiny.hf(input_ids=ids).logits
    plain = load_target(TargetSpec(tiny={}, cpu_linear="stock"))  # a second target: the setting is part of the spec
    assert plain is not tiny and plain.cpu_linears.setting == "stock"
    assert all(torch.equal(a, b) for a, b in zip(tiny.hf.state_dict().values(), plain.hf.state_dict().values()))
    torch.testing.assert_close(got, plain.hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_install_keeps_tied_weights_and_the_state_dict():
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as many LM heads are
    names = set(model.state_dict())
    kernels = install_cpu_linears(model, "rows_first")
    assert type(model[1]) is FewRowLinear and model[1].weight is model[0].weight and kernels.setting == "rows_first"
    assert set(model.state_dict()) == names


def test_the_setting_is_checked_and_named():
    with pytest.raises(
        TargetError,
        match=r"TargetSpec.cpu_linear='fast' is invalid: must be one of auto, stock, "
        r"rows_first, packed",
    ):
        TargetSpec(tiny={}, cpu_linear="fast")
    assert "cpu_linear" not in TargetSpec(tiny={}).key()  # the default keeps the key of older run logs
    assert '"cpu_linear": "stock"' in TargetSpec(tiny={}, cpu_linear="stock").key()


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
def test_packed_rows_equal_linear_and_only_the_declared_count_packs(bias):
    layer = _layer(bias=bias)  # "packed": undeclared counts take the stock kernel, exactly
    assert declare_rows(layer, 4) == 1 and layer.packed_rows == {4}
    assert declare_rows(layer, 1) == 1 and declare_rows(layer, 99) == 1 and layer.packed_rows == {4}  # never packed
    with torch.no_grad():
        for shape in [(4, 96), (1, 4, 96), (2, 2, 96)]:  # any leading dims holding 4 rows
            x = torch.randn(*shape)
            torch.testing.assert_close(
                layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
            )
        assert set(layer.packed) == {4}
        x = torch.randn(3, 96)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert set(layer.packed) == {4}  # 3 rows were not declared: nothing packed for them
    assert set(layer.state_dict()) == set(nn.Linear(96, 160, bias).state_dict())


@needs_mkl
def test_a_changed_weight_is_packed_again():
    layer = _layer()
    declare_rows(layer, 4)
    x = torch.randn(4, 96)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2)  # in place: same storage, new version
        torch.testing.assert_close(
            layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
        )
        layer.weight = nn.Parameter(torch.randn(160, 96))  # replaced: new storage
        torch.testing.assert_close(
            layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
        )


@needs_mkl
def test_packed_rows_keep_gradients_by_taking_the_other_kernels():
    layer = _layer()
    declare_rows(layer, 4)
    x = torch.randn(4, 96, requires_grad=True)
    out = layer(x)  # grad enabled: not the packed kernel (it has no backward)
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(grad, layer.weight.sum(0).expand_as(x))
    assert not layer.packed


@needs_mkl
def test_packing_is_skipped_with_a_note_when_memory_is_short(monkeypatch, capsys):
    layer = _layer()
    declare_rows(layer, 4)
    monkeypatch.setattr(cpu_linear, "available_memory", lambda: 10)
    x = torch.randn(4, 96)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(
                layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
            )
    err = capsys.readouterr().err
    assert err.count("not packing a (160, 96) weight for 4-row products") == 1 and "MiB available" in err
    assert not layer.packed


@needs_mkl
@pytest.mark.parametrize("setting", ["stock", "rows_first"])
def test_settings_without_packing_never_pack(setting):
    layer = _layer(setting)
    declare_rows(layer, 4)
    with torch.no_grad():
        layer(torch.randn(4, 96))
    assert not layer.packed


@needs_mkl
def test_the_loop_declares_the_verify_rows_and_stays_lossless(tiny):
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
    assert tiny.verify_block_sizes == {4} and tiny.cpu_linears.declared_rows == {4}
    assert all(4 in m.packed for m in layers)  # every layer ran its verify pass through its packing decision
    tiny.prepare_verification(4)  # once per target and block size: nothing changes
    assert head.packed_rows == {3, 4}
