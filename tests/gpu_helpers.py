"""Inputs, references and launch helpers of the GPU and TensorRT tests (``pytest -m gpu``).

The SmolLM2-135M drafting geometry (hidden 576, vocab 49152) with the DFlash2 defaults: block 16, 2 taps,
36 groups, top-16, rank 256.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from dflash2_lightning import ops

H, V, BS, TAPS, GROUPS, TOP_K, RANK = 576, 49152, 16, 2, 36, 16, 256
DEVICE = "cuda"
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def conv_inputs(b: int, s: int, h: int, taps: int, groups: int, dtype: torch.dtype, seed: int = 0):
    """``x [b,s,h]``, ``base [taps,h]`` and both sides' ``delta [b,s,2,taps,groups]`` on the GPU."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(b, s, h, device=DEVICE, generator=g).to(dtype)
    base = torch.randn(taps, h, device=DEVICE, generator=g).to(dtype)
    both = (0.1 * torch.randn(b, s, 2, taps, groups, device=DEVICE, generator=g)).to(dtype)
    return x, base, both


def walk_inputs(b: int, length: int, k: int, r: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """``cand, unary, proj, anchor, pred, succ`` of a lattice walk on the GPU."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    cand = torch.randint(0, vocab, (b, length, k), device=DEVICE, generator=g)
    unary = torch.randn(b, length, k, device=DEVICE, generator=g).to(dtype)
    proj = torch.randn(b, length, r, device=DEVICE, generator=g).to(dtype)
    anchor = torch.randint(0, vocab, (b,), device=DEVICE, generator=g)
    pred = torch.randn(vocab, r, device=DEVICE, generator=g).to(dtype)
    succ = (0.1 * torch.randn(vocab, r, device=DEVICE, generator=g)).to(dtype)
    return cand, unary, proj, anchor, pred, succ


def reference_walk(*args: torch.Tensor) -> torch.Tensor:
    """The eager walk over the full edge-score table (what every kernel must equal)."""
    return ops.walk_edge_scores(ops.edge_scores(*args), args[0])


class CudaDriver:
    """The few CUDA driver calls needed to load PTX and launch it the way TensorRT does."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = (
            [ctypes.c_void_p]
            + [ctypes.c_uint] * 7
            + [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        )

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed with CUDA driver error {code}")

    def launch(self, kernel, grid: tuple, args: list) -> None:
        """Launch an :class:`~dflash2_lightning.ops.triton_aot.AotKernel` with TensorRT's argument order."""
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(
            self.lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(kernel.ptx.encode())), "cuModuleLoadData"
        )
        self._check(
            self.lib.cuModuleGetFunction(ctypes.byref(func), module, kernel.name.encode()), "cuModuleGetFunction"
        )
        storage = [
            ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int32(int(a)) for a in args
        ]
        params = (ctypes.c_void_p * len(storage))(*[ctypes.cast(ctypes.byref(s), ctypes.c_void_p) for s in storage])
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        stream = torch.cuda.current_stream().cuda_stream
        self._check(
            self.lib.cuLaunchKernel(func, *grid, kernel.block_x, 1, 1, kernel.shared, stream, params, None),
            "cuLaunchKernel",
        )
        torch.cuda.synchronize()


def single_op_graphs(directory: Path, dtype: str = "float32") -> dict[str, Path]:
    """Write ``block_conv.<dtype>.trt.onnx`` and ``lattice_walk.<dtype>.trt.onnx``: one dflash node each,
    dynamic batch, no function bodies (so TensorRT's parser must use the plugins)."""
    import onnx
    from onnx import TensorProto, helper

    ft = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[dtype]
    i64 = TensorProto.INT64
    attrs = {"plugin_namespace": "dflash", "plugin_version": "1"}
    directory.mkdir(parents=True, exist_ok=True)
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("dflash", 1)]
    io = helper.make_tensor_value_info
    conv = helper.make_graph(
        [helper.make_node("DFlashBlockConv", ["x", "base", "delta"], ["y"], domain="dflash", block_size=BS, **attrs)],
        "block_conv",
        [io("x", ft, ["batch", BS, H]), io("base", ft, [TAPS, H]), io("delta", ft, ["batch", BS, TAPS, GROUPS])],
        [io("y", ft, ["batch", BS, H])],
    )
    walk = helper.make_graph(
        [
            helper.make_node(
                "DFlashLatticeWalk",
                ["cand", "unary", "proj", "anchor", "pred", "succ"],
                ["tokens"],
                domain="dflash",
                **attrs,
            )
        ],
        "lattice_walk",
        [
            io("cand", i64, ["batch", BS - 1, TOP_K]),
            io("unary", ft, ["batch", BS - 1, TOP_K]),
            io("proj", ft, ["batch", BS - 1, RANK]),
            io("anchor", i64, ["batch"]),
            io("pred", ft, [V, RANK]),
            io("succ", ft, [V, RANK]),
        ],
        [io("tokens", i64, ["batch", BS - 1])],
    )
    paths = {}
    for graph in (conv, walk):
        model = helper.make_model(
            graph, opset_imports=opsets, ir_version=10
        )  # torch.onnx's; onnxruntime 1.30 reads <= 13
        onnx.checker.check_model(model)
        paths[graph.name] = directory / f"{graph.name}.{dtype}.trt.onnx"
        onnx.save(model, str(paths[graph.name]))
    return paths


def engine_inputs(name: str, dtype: torch.dtype, batch: int) -> dict[str, torch.Tensor]:
    """Host inputs of a single-op engine (:func:`single_op_graphs`)."""
    if name == "block_conv":
        x, base, both = conv_inputs(batch, BS, H, TAPS, GROUPS, dtype)
        return {"x": x.cpu(), "base": base.cpu(), "delta": both[:, :, 0].contiguous().cpu()}
    args = walk_inputs(batch, BS - 1, TOP_K, RANK, V, dtype)
    return {k: t.cpu() for k, t in zip(("cand", "unary", "proj", "anchor", "pred", "succ"), args)}


def engine_reference(name: str, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a single-op engine must compute for ``feed``."""
    if name == "block_conv":
        return ops.block_conv_reference(feed["x"].float(), feed["base"].float(), feed["delta"].float(), BS)
    return reference_walk(*(feed[k] for k in ("cand", "unary", "proj", "anchor", "pred", "succ")))
