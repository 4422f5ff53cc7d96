"""Triton kernels vs the reference ops (under Triton's CPU interpreter) and ahead-of-time PTX.

Triton fixes interpreter mode when it is first imported (its own library functions are decorated
then), so one process cannot both interpret kernels and compile them. The interpreter tests
(marked ``interp``) therefore run in a child pytest started with ``TRITON_INTERPRET=1``
(``test_interpreter_tests_in_a_child_process``); every other test is marked ``parent`` and runs only
in the parent process. Running ``TRITON_INTERPRET=1 pytest tests/ops/test_triton_kernels.py``
directly runs the interpreter tests in-process.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash2_lightning import ops

pytestmark = pytest.mark.triton
pytest.importorskip("triton")

# Below the skip: these modules import triton.
from dflash2_lightning.ops import triton_aot as aot  # noqa: E402
from dflash2_lightning.ops.block_conv import tensorrt_plugin as conv_plugin  # noqa: E402
from dflash2_lightning.ops.block_conv import triton_kernel as block_conv  # noqa: E402
from dflash2_lightning.ops.lattice_walk import tensorrt_plugin as walk_plugin  # noqa: E402
from dflash2_lightning.ops.lattice_walk import triton_kernel as lattice_walk  # noqa: E402
from dflash2_lightning.ops.triton_runtime import interpreting, launchable, next_power_of_2  # noqa: E402

INTERPRETING = interpreting()
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child process")
parent = pytest.mark.skipif(INTERPRETING, reason="runs in the parent process (Triton compiles only there)")
REPO = Path(__file__).resolve().parents[2]


def test_interpreter_tests_in_a_child_process():
    if INTERPRETING:
        pytest.skip("this is the child process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "triton", __file__]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


def _conv_inputs(b, s, h, taps, groups, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, generator=g)
    base = torch.randn(taps, h, generator=g)
    both = torch.randn(b, s, 2, taps, groups, generator=g)  # like DFlashGroupedConv's projection
    return x.to(dtype), base.to(dtype), both.to(dtype)


# ----------------------------------------------------------------------------- block conv
@interp
@pytest.mark.parametrize(
    "b,s,h,taps,groups,bs",
    [
        (1, 4, 8, 1, 8, 4),  # one tap = a per-channel scale; group size 1
        (2, 8, 12, 2, 3, 4),  # H not a power of two, two blocks per row
        (3, 12, 20, 3, 4, 6),  # taps > 2, batch > 1
        (2, 8, 300, 2, 12, 8),  # several channel tiles and row tiles
        (1, 16, 16, 8, 2, 8),  # taps == block_size
    ],
)
def test_block_conv_matches_reference(b, s, h, taps, groups, bs):
    x, base, both = _conv_inputs(b, s, h, taps, groups)
    for side in (0, 1):  # a strided slice of the [B,S,2,T,G] projection, used in place
        delta = both[:, :, side]
        got = block_conv.block_conv(x, base, delta, bs)
        want = ops.block_conv_reference(x, base, delta, bs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interp
def test_block_conv_taps_stop_at_block_starts():
    # x is one-hot at the first position of block 1; with a pure shift kernel (tap 1 only) nothing
    # may leak into block 0 and position 1 of block 1 must receive it.
    bs, h = 4, 4
    x = torch.zeros(1, 2 * bs, h)
    x[0, bs] = 1.0
    base = torch.tensor([[0.0] * h, [1.0] * h])
    delta = torch.zeros(1, 2 * bs, 2, 1)
    y = block_conv.block_conv(x, base, delta, bs)
    assert torch.count_nonzero(y[0, :bs]) == 0
    assert torch.equal(y[0, bs + 1], torch.ones(h))
    x2 = torch.zeros(1, 2 * bs, h)
    x2[0, bs - 1] = 1.0  # last position of block 0 must not reach block 1
    assert torch.count_nonzero(block_conv.block_conv(x2, base, delta, bs)) == 0


@interp
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_block_conv_half_precision(dtype, tol):
    x, base, both = _conv_inputs(2, 8, 24, 2, 6, seed=1, dtype=dtype)
    delta = both[:, :, 1]
    got = block_conv.block_conv(x, base, delta, 4)
    assert got.dtype == dtype
    want = ops.block_conv_reference(x.float(), base.float(), delta.float(), 4)  # float32 accumulation
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@parent
def test_block_conv_tiles():
    assert block_conv.block_conv_tiles(576) == (8, 256, 4)
    assert block_conv.block_conv_tiles(12) == (128, 16, 4)
    assert block_conv.block_conv_grid(16, 576) == (2, 3)
    with pytest.raises(ValueError, match="hidden=0"):
        block_conv.block_conv_tiles(0)


# ----------------------------------------------------------------------------- lattice walk
def _walk_inputs(b, length, k, r, vocab, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(b * length)]).view(b, length, k)
    unary = torch.randn(b, length, k, generator=g)
    proj = torch.randn(b, length, r, generator=g)
    anchor = torch.randint(0, vocab, (b,), generator=g)
    pred = torch.randn(vocab, r, generator=g)
    succ = torch.randn(vocab, r, generator=g)
    return cand, unary.to(dtype), proj.to(dtype), anchor, pred.to(dtype), succ.to(dtype)


def _reference_walk(*args):
    return ops.walk_edge_scores(ops.edge_scores(*args), args[0])


@interp
@pytest.mark.parametrize(
    "b,length,k,r,vocab",
    [
        (1, 1, 1, 1, 5),  # degenerate: one candidate
        (2, 3, 4, 8, 20),
        (3, 7, 16, 24, 50),  # the released top-k, batch > 1
        (2, 4, 5, 300, 40),  # K not a power of two; r in several chunks
    ],
)
def test_lattice_walk_matches_reference(b, length, k, r, vocab):
    args = _walk_inputs(b, length, k, r, vocab)
    got = lattice_walk.lattice_walk(*args)
    assert got.dtype == torch.long and got.shape == (b, length)
    assert torch.equal(got, _reference_walk(*args))


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lattice_walk_half_precision_inputs(dtype):
    args = _walk_inputs(2, 5, 8, 16, 30, seed=3, dtype=dtype)
    assert torch.equal(lattice_walk.lattice_walk(*args), _reference_walk(*args))


@interp
def test_lattice_walk_ties_go_to_lowest_index():
    b, length, k, r = 2, 4, 6, 8
    vocab = b * length * k  # every candidate a distinct token, so successor rows can be set per slot
    cand, _, proj, anchor, pred, succ = _walk_inputs(b, length, k, r, vocab, seed=5)
    cand = torch.randperm(vocab, generator=torch.Generator().manual_seed(6)).view(b, length, k)
    # (a) every score equal: the walk takes candidate 0 everywhere
    zeros = torch.zeros(b, length, k)
    flat = (cand, zeros, proj, anchor, pred, torch.zeros(vocab, r))
    assert torch.equal(lattice_walk.lattice_walk(*flat), cand[:, :, 0])
    assert torch.equal(_reference_walk(*flat), cand[:, :, 0])
    # (b) candidates 2 and 4 tie for the maximum with non-zero transitions: identical successor
    # rows and unary scores make their scores bit-identical, so index 2 must win.
    succ = succ.clone()
    succ[cand[:, :, 4]] = succ[cand[:, :, 2]]
    unary = torch.randn(b, length, k) - 100.0
    unary[:, :, 2] = unary[:, :, 4] = 100.0
    tied = (cand, unary, proj, anchor, pred, succ)
    assert torch.equal(lattice_walk.lattice_walk(*tied), cand[:, :, 2])
    assert torch.equal(_reference_walk(*tied), cand[:, :, 2])


@interp
def test_lattice_walk_follows_the_chosen_predecessor():
    # The transition term decides: only the path through the right predecessor scores high.
    vocab, r = 10, 2
    cand = torch.tensor([[[1, 2], [3, 4]]])
    unary = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # position 0 picks token 1 (unary only: succ rows 1,2 = 0)
    proj = torch.ones(1, 2, r)
    pred = torch.zeros(vocab, r)
    pred[1] = torch.tensor([1.0, 0.0])  # after token 1 ...
    pred[2] = torch.tensor([0.0, 1.0])
    succ = torch.zeros(vocab, r)
    succ[3] = torch.tensor([0.0, 5.0])  # ... token 3 needs predecessor 2
    succ[4] = torch.tensor([5.0, 0.0])  # ... token 4 needs predecessor 1
    args = (cand, unary, proj, torch.tensor([0]), pred, succ)
    assert lattice_walk.lattice_walk(*args).tolist() == [[1, 4]]
    assert _reference_walk(*args).tolist() == [[1, 4]]


@parent
def test_lattice_walk_tiles():
    assert lattice_walk.lattice_walk_tiles(16, 256) == (16, 256, 4)
    assert lattice_walk.lattice_walk_tiles(5, 300) == (8, 512, 4)
    assert lattice_walk.lattice_walk_tiles(1024, 64) == (1024, 16, 4)
    with pytest.raises(ValueError, match="top_k=0"):
        lattice_walk.lattice_walk_tiles(0, 8)
    with pytest.raises(ValueError, match="rank=0"):
        lattice_walk.lattice_walk_tiles(4, 0)
    assert [next_power_of_2(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]


# ----------------------------------------------------------------------------- TensorRT launch layout
@interp
def test_plugin_launch_arguments_drive_the_kernels():
    # Launch both kernels the way TensorRT's AOT plugin does: inputs, the plugin's scalar arguments,
    # output, on the plugin's grid (each op's tensorrt_plugin.py computes both from the input shapes).
    x, base, both = _conv_inputs(2, 8, 20, 2, 4, seed=7)
    delta = both[:, :, 0].contiguous()  # TensorRT tensors are dense
    y = torch.empty_like(x)
    block_rows, block_h, _ = block_conv.block_conv_tiles(20)
    scalars, grid = conv_plugin.block_conv_launch(x.shape, base.shape, delta.shape, 4, block_rows, block_h)
    assert len(scalars) == len(block_conv.BLOCK_CONV_SCALARS)
    launchable(block_conv.block_conv_kernel)[grid](x, base, delta, *scalars, y, BLOCK_ROWS=block_rows, BLOCK_H=block_h)
    torch.testing.assert_close(y, ops.block_conv_reference(x, base, delta, 4), rtol=1e-5, atol=1e-5)

    args = _walk_inputs(3, 5, 6, 12, 40, seed=8)
    tokens = torch.empty(3, 5, dtype=torch.long)
    block_k, block_r, _ = lattice_walk.lattice_walk_tiles(6, 12)
    scalars, grid = walk_plugin.lattice_walk_launch(args[0].shape, args[2].shape)
    assert len(scalars) == len(lattice_walk.LATTICE_WALK_SCALARS)
    launchable(lattice_walk.lattice_walk_kernel)[grid](*args, *scalars, tokens, BLOCK_K=block_k, BLOCK_R=block_r)
    assert torch.equal(tokens, _reference_walk(*args))


# ----------------------------------------------------------------------------- dispatch
@parent
def test_package_import_is_lazy_without_cuda():
    code = (
        "import sys, dflash2_lightning.ops.dispatch as k; "
        "print(k.cuda_block_conv is None, k.cuda_lattice_walk is None, 'triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the launchers are installed by design")
    assert out.stdout.split() == ["True", "True", "False"]


@parent
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_and_op_dispatch(monkeypatch):
    from dflash2_lightning.ops import dispatch as kernels

    assert kernels.cuda_block_conv is block_conv.block_conv
    x, base, both = (t.cuda() for t in _conv_inputs(2, 32, 576, 2, 36))
    calls = []
    monkeypatch.setattr(kernels, "cuda_block_conv", lambda *a: calls.append("conv") or block_conv.block_conv(*a))
    monkeypatch.setattr(kernels, "cuda_lattice_walk", lambda *a: calls.append("walk") or lattice_walk.lattice_walk(*a))
    y = ops.block_conv(x, base, both[:, :, 1], 16)
    torch.testing.assert_close(y, ops.block_conv_reference(x, base, both[:, :, 1], 16), rtol=1e-4, atol=1e-4)
    args = tuple(t.cuda() for t in _walk_inputs(4, 15, 16, 256, 1000))
    assert torch.equal(ops.lattice_walk(*args), _reference_walk(*args))
    assert calls == ["conv", "walk"]


# ----------------------------------------------------------------------------- ahead of time
@parent
@pytest.mark.parametrize(
    "arch,kind,dtype", [(80, "conv", "fp32"), (90, "conv", "bf16"), (80, "walk", "fp16"), (90, "walk", "fp32")]
)
def test_aot_ptx_for_sm80_and_sm90(arch, kind, dtype):
    if kind == "conv":
        kernel = block_conv.compile_block_conv(dtype, hidden=576, arch=arch)
        n_args = 3 + len(block_conv.BLOCK_CONV_SCALARS) + 1
    else:
        kernel = lattice_walk.compile_lattice_walk(dtype, top_k=16, rank=256, arch=arch)
        n_args = 6 + len(lattice_walk.LATTICE_WALK_SCALARS) + 1
    name = {"conv": "block_conv_kernel", "walk": "lattice_walk_kernel"}[kind]
    assert kernel.name == name and kernel.arch == arch
    targets = [line.split()[1] for line in kernel.ptx.splitlines() if line.startswith(".target")]
    assert targets and targets[0].startswith(f"sm_{arch}")  # sm_90 comes out as sm_90a
    assert f".entry {name}(" in kernel.ptx
    # exactly inputs, scalars, output: Triton's trailing scratch pointers are gone
    assert len(aot.ptx_entry_params(kernel.ptx, name)) == n_args == len(kernel.params)
    assert kernel.cubin and kernel.block_x == kernel.num_warps * 32


@interp
def test_aot_refuses_to_compile_while_interpreting():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        block_conv.compile_block_conv("fp32", hidden=64, arch=80)


@parent
def test_aot_refuses_to_drop_a_used_parameter():
    ptx = (
        ".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1\n)\n{\n"
        "\tld.param.u64 %rd1, [k_param_1];\n}\n"
    )
    with pytest.raises(RuntimeError, match="k_param_1"):
        aot._drop_unused_params(ptx, "k", keep=1)
    unused = ptx.replace("[k_param_1]", "[k_param_0]")
    assert aot.ptx_entry_params(aot._drop_unused_params(unused, "k", keep=1), "k") == [".param .u64 k_param_0"]


@parent
def test_aot_dtype_names():
    assert aot.float_type_name(torch.bfloat16) == "bf16"
    assert aot.float_type_name("float16") == "fp16"
    with pytest.raises(ValueError, match="int8"):
        aot.float_type_name("int8")
    with pytest.raises(ValueError, match="arch=70"):
        aot.cuda_target(70)
