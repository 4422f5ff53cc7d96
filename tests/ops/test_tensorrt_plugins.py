"""TensorRT plugin logic that runs without TensorRT: ids, shapes, attributes, type combinations, launch args."""

import importlib.util

import pytest

from dflash2_lightning.ops import tensorrt_common as common
from dflash2_lightning.ops import tensorrt_plugins as plugins
from dflash2_lightning.ops.block_conv import tensorrt_plugin as conv_plugin
from dflash2_lightning.ops.lattice_walk import tensorrt_plugin as walk_plugin


def test_plugin_ids_match_the_onnx_contract():
    assert plugins.BLOCK_CONV_ID == "dflash::DFlashBlockConv"
    assert plugins.LATTICE_WALK_ID == "dflash::DFlashLatticeWalk"
    assert (plugins.PLUGIN_NAMESPACE, plugins.PLUGIN_VERSION) == ("dflash", "1")


def test_block_conv_output_shape():
    assert conv_plugin.block_conv_output_shape((2, 32, 576), (2, 576), (2, 32, 2, 36), 16) == (2, 32, 576)
    # dynamic batch and length pass; only known sizes are checked
    assert conv_plugin.block_conv_output_shape((None, None, 64), (3, 64), (None, None, 3, 4), 8) == (None, None, 64)


@pytest.mark.parametrize(
    "x,base,delta,block_size,message",
    [
        ((2, 32), (2, 576), (2, 32, 2, 36), 16, "x has shape"),
        ((2, 32, 576), (2, 512), (2, 32, 2, 36), 16, r"base hidden size \(base\[1\]\) vs x\[2\]: 512 != 576"),
        ((2, 32, 576), (2, 576), (3, 32, 2, 36), 16, "delta batch"),
        ((2, 32, 576), (2, 576), (2, 32, 3, 36), 16, "delta taps"),
        ((2, 32, 576), (2, 576), (2, 32, 2, 35), 16, r"groups \(delta\[3\]\) = 35 is invalid"),
        ((2, 24, 576), (2, 576), (2, 24, 2, 36), 16, r"x\[1\] = 24 is invalid: must be a multiple of block_size=16"),
        ((2, 32, 576), (2, 576), (2, 32, 2, 36), 0, "block_size=0 is invalid"),
        ((2, 32, 576), (2, 576), (2, 32, 2, 36), 2.5, "block_size=2.5 is invalid"),
        ((2, 32, 576), (2, 576), (2, 32, 2, 36), "16x", "block_size='16x' is invalid"),
    ],
)
def test_block_conv_output_shape_rejects(x, base, delta, block_size, message):
    with pytest.raises(ValueError, match=message):
        conv_plugin.block_conv_output_shape(x, base, delta, block_size)


def test_check_block_size_accepts_integral_values():
    assert conv_plugin.check_block_size(16) == 16
    assert conv_plugin.check_block_size(8.0) == 8  # ONNX/TensorRT may hand over a float-typed integer


def test_lattice_walk_output_shape():
    shapes = [(4, 15, 16), (4, 15, 16), (4, 15, 256), (4,), (49152, 256), (49152, 256)]
    assert walk_plugin.lattice_walk_output_shape(*shapes) == (4, 15)
    dynamic = [(None, 15, 16), (None, 15, 16), (None, 15, 256), (None,), (100, 256), (100, 256)]
    assert walk_plugin.lattice_walk_output_shape(*dynamic) == (None, 15)


@pytest.mark.parametrize(
    "index,shape,message",
    [
        (0, (4, 15), "cand has shape"),
        (1, (4, 15, 8), r"unary\[2\] \(K\) vs cand\[2\]: 8 != 16"),
        (2, (4, 14, 256), r"proj\[1\] \(L\) vs cand\[1\]"),
        (3, (5,), r"anchor\[0\] \(B\) vs cand\[0\]"),
        (4, (49152, 128), r"pred_codebook\[1\] \(r\) vs proj\[2\]"),
        (5, (100, 256), "succ_codebook shape vs pred_codebook"),
    ],
)
def test_lattice_walk_output_shape_rejects(index, shape, message):
    shapes = [(4, 15, 16), (4, 15, 16), (4, 15, 256), (4,), (49152, 256), (49152, 256)]
    shapes[index] = shape
    with pytest.raises(ValueError, match=message):
        walk_plugin.lattice_walk_output_shape(*shapes)


def test_lattice_walk_top_k_bound():
    shapes = [(1, 3, 2048), (1, 3, 2048), (1, 3, 8), (1,), (5000, 8), (5000, 8)]
    with pytest.raises(ValueError, match=r"top_k \(cand\[2\]\) = 2048 is invalid"):
        walk_plugin.lattice_walk_output_shape(*shapes)


def test_type_combinations():
    conv = conv_plugin.block_conv_type_combinations()
    assert len(conv) == len(set(conv)) == 27  # x, base, delta independently FP32/FP16/BF16
    for combo in conv:
        fields = [f.strip() for f in combo.split(",")]
        assert len(fields) == 4 and fields[3] == fields[0]  # y has the type of x
        assert set(fields) <= set(common.FLOAT_TYPES)
    assert conv[0] == "FP32, FP32, FP32, FP32"
    walk = walk_plugin.lattice_walk_type_combinations()
    assert len(walk) == len(set(walk)) == 81
    for combo in walk:
        fields = [f.strip() for f in combo.split(",")]
        assert len(fields) == 7
        assert fields[0] == fields[3] == fields[6] == "INT64"  # cand, anchor, tokens
        assert {fields[i] for i in (1, 2, 4, 5)} <= set(common.FLOAT_TYPES)


def test_triton_type_of():
    assert [common.triton_type_of(n) for n in ("FLOAT", "HALF", "BF16", "INT64")] == ["fp32", "fp16", "bf16", "i64"]
    with pytest.raises(ValueError, match="'INT8' is not supported"):
        common.triton_type_of("INT8")


def test_launch_arguments():
    # x [2, 32, 576], base [2, 576], delta [2, 32, 2, 36], block 16, tiles 8 x 256
    scalars, grid = conv_plugin.block_conv_launch((2, 32, 576), (2, 576), (2, 32, 2, 36), 16, 8, 256)
    assert scalars == (64, 576, 2, 36, 16, 72, 36)  # rows, H, T, G, bs, delta row / tap strides
    assert grid == (8, 3)
    scalars, grid = walk_plugin.lattice_walk_launch((4, 15, 16), (4, 15, 256))
    assert scalars == (15, 16, 256) and grid == (4,)


def test_launch_arguments_are_symbolic_friendly():
    # The plugin passes TensorRT shape expressions through the same code: only + - * // are used.
    class Sym:
        def __init__(self, text):
            self.text = text

        def _op(self, sign, other):
            return Sym(f"({self.text}{sign}{getattr(other, 'text', other)})")

        __add__ = lambda self, o: self._op("+", o)
        __sub__ = lambda self, o: self._op("-", o)
        __mul__ = lambda self, o: self._op("*", o)
        __floordiv__ = lambda self, o: self._op("//", o)

    b, s = Sym("B"), Sym("S")
    scalars, grid = conv_plugin.block_conv_launch((b, s, 576), (2, 576), (b, s, 2, 36), 16, 8, 256)
    assert scalars[0].text == "(B*S)" and grid[0].text == "(((B*S)+7)//8)"


def test_register_plugins_needs_tensorrt():
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed")
    with pytest.raises(ImportError):
        plugins.register_plugins()


def test_tensorrt_older_than_11_2_1_is_refused_with_the_reason():
    assert common.tensorrt_version_problem("11.4.0.106") is None
    assert common.tensorrt_version_problem("11.2.1.3") is None and common.tensorrt_version_problem("12.0.0") is None
    for old in ("10.16.1.11", "11.1.0.2", "11.2.0.1"):
        problem = common.tensorrt_version_problem(old)
        assert problem.startswith(f"TensorRT {old} is too old for the dflash plugins (needs >= 11.2.1")
        assert "tensorrt-cu13==11.4.0.106" in problem
