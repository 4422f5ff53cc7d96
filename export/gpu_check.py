"""Everything about the kernels and plugins that needs a GPU, in one run: ``python export/gpu_check.py``.

    python export/gpu_check.py [--out DIR] [--onnx EXPORT_DIR] [--runs 200]

1. Triton kernels vs the reference ops on CUDA (fp32/fp16/bf16, SmolLM2-135M geometry, ties).
2. The ``dflash::`` torch ops dispatch to the kernels on CUDA tensors; gradients through the op; a
   DFlash2 draft drafts the same tokens with and without the kernels.
3. The ahead-of-time PTX (as TensorRT gets it: Triton's scratch parameters removed) loaded with the
   CUDA driver and launched with TensorRT's argument order (inputs, scalars, outputs).
4. If ``tensorrt`` imports: single-op ONNX graphs -> engines with the plugins -> outputs vs the
   reference; the engine run again in a fresh process that never imports the plugin code; with
   ``--onnx``, ``export/to_trt.py`` on a real export directory.
5. Latency (CUDA events, median after warm-up) of reference vs kernel (vs TensorRT engine) at the
   SmolLM2-135M drafting geometry: H=576, block 16, 2 taps, 36 groups; K=16, r=256, V=49152.

Writes ``gpu_check.json`` (and the engines) to ``--out`` (default ``$OUT`` or ``gpu_check_out``), prints
a summary, exits 1 if any check failed.
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a checkout works without installing

from dflash2_lightning import ops  # noqa: E402


# SmolLM2-135M drafting geometry (hidden 576, vocab 49152) with the DFlash2 defaults.
H, V, BS, TAPS, GROUPS, TOP_K, RANK = 576, 49152, 16, 2, 36, 16, 256
DEVICE = "cuda"
RESULTS: list[dict] = []


def record(name: str, ok: bool | None, **detail) -> None:
    """One check's outcome (``ok=None``: skipped)."""
    RESULTS.append({"check": name, "ok": ok, **detail})
    mark = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
    print(f"[{mark}] {name} {json.dumps(detail, default=str)}", flush=True)


def guarded(fn: Callable) -> Callable:
    """Run a check section; an exception is recorded as a failure and the run goes on."""
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001  (report and continue with the next section)
            record(fn.__name__, False, error=repr(err), trace=traceback.format_exc()[-2000:])
    return run


# ----------------------------------------------------------------------------- inputs
def conv_inputs(b, s, h, taps, groups, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(b, s, h, device=DEVICE, generator=g).to(dtype)
    base = torch.randn(taps, h, device=DEVICE, generator=g).to(dtype)
    both = (0.1 * torch.randn(b, s, 2, taps, groups, device=DEVICE, generator=g)).to(dtype)
    return x, base, both


def walk_inputs(b, length, k, r, vocab, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    cand = torch.randint(0, vocab, (b, length, k), device=DEVICE, generator=g)
    unary = torch.randn(b, length, k, device=DEVICE, generator=g).to(dtype)
    proj = torch.randn(b, length, r, device=DEVICE, generator=g).to(dtype)
    anchor = torch.randint(0, vocab, (b,), device=DEVICE, generator=g)
    pred = torch.randn(vocab, r, device=DEVICE, generator=g).to(dtype)
    succ = (0.1 * torch.randn(vocab, r, device=DEVICE, generator=g)).to(dtype)
    return cand, unary, proj, anchor, pred, succ


def reference_walk(*args):
    return ops.walk_edge_scores(ops.edge_scores(*args), args[0])


TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


# ----------------------------------------------------------------------------- 1. kernels vs reference
@guarded
def check_kernels() -> None:
    from dflash2_lightning.kernels import block_conv, lattice_walk

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for b, s in ((1, BS), (8, BS), (2, 2048)):
            x, base, both = conv_inputs(b, s, H, TAPS, GROUPS, dtype)
            for side in (0, 1):
                delta = both[:, :, side]
                got = block_conv.block_conv(x, base, delta, BS).float()
                want = ops.block_conv_reference(x.float(), base.float(), delta.float(), BS)
                err = (got - want).abs().max().item()
                record(f"block_conv {str(dtype)[6:]} B={b} S={s} side={side}", err <= TOL[dtype] * 10, max_err=err)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for b in (1, 8, 64):
            args = walk_inputs(b, BS - 1, TOP_K, RANK, V, dtype)
            got, want = lattice_walk.lattice_walk(*args), reference_walk(*args)
            agree = (got == want).float().mean().item()
            record(f"lattice_walk {str(dtype)[6:]} B={b}", agree == 1.0 if dtype == torch.float32 else agree > 0.97,
                   agreement=agree)
    # exact ties -> lowest index
    cand, _, proj, anchor, pred, _ = walk_inputs(4, BS - 1, TOP_K, RANK, V, torch.float32, seed=1)
    flat = (cand, torch.zeros_like(cand, dtype=torch.float32), proj, anchor, pred, torch.zeros(V, RANK, device=DEVICE))
    record("lattice_walk ties -> index 0", torch.equal(lattice_walk.lattice_walk(*flat), cand[:, :, 0]))


# ----------------------------------------------------------------------------- 2. op dispatch
@guarded
def check_dispatch() -> None:
    import dflash2_lightning.kernels as kernels

    record("kernels installed on import", kernels.cuda_block_conv is not None and kernels.cuda_lattice_walk is not None)
    calls = {"conv": 0, "walk": 0}
    conv, walk = kernels.cuda_block_conv, kernels.cuda_lattice_walk

    def counting_conv(*a):
        calls["conv"] += 1
        return conv(*a)

    def counting_walk(*a):
        calls["walk"] += 1
        return walk(*a)

    kernels.cuda_block_conv, kernels.cuda_lattice_walk = counting_conv, counting_walk
    try:
        x, base, both = conv_inputs(2, BS, H, TAPS, GROUPS, torch.float32)
        x.requires_grad_(True)
        base = base.clone().requires_grad_(True)
        delta = both[:, :, 0].clone().requires_grad_(True)
        y = ops.block_conv(x, base, delta, BS)
        grads = torch.autograd.grad(y.square().sum(), (x, base, delta))
        xr, br, dr = (t.detach().clone().requires_grad_(True) for t in (x, base, delta))
        yr = ops.block_conv_reference(xr, br, dr, BS)
        grads_ref = torch.autograd.grad(yr.square().sum(), (xr, br, dr))
        grad_err = max((g - r).abs().max().item() for g, r in zip(grads, grads_ref))
        record("dflash::block_conv -> Triton on CUDA", calls["conv"] == 1 and torch.allclose(y, yr, atol=1e-4),
               calls=calls["conv"], grad_max_err=grad_err)
        record("dflash::block_conv backward on CUDA", grad_err < 1e-2 * max(1.0, grads_ref[1].abs().max().item()))
        args = walk_inputs(8, BS - 1, TOP_K, RANK, V, torch.float32)
        tokens = ops.lattice_walk(*args)
        record("dflash::lattice_walk -> Triton on CUDA", calls["walk"] == 1 and torch.equal(tokens, reference_walk(*args)),
               calls=calls["walk"])
    finally:
        kernels.cuda_block_conv, kernels.cuda_lattice_walk = conv, walk
    check_draft_model(kernels)


def check_draft_model(kernels) -> None:
    """A DFlash2 draft with non-trivial conv and selector drafts the same tokens with and without kernels."""
    from dflash2_lightning.config import DraftConfig
    from dflash2_lightning.model.draft import DraftModel

    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=H, vocab_size=V, num_target_layers=8, num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, block_size=BS)
    model = DraftModel(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "kernel_projection" in name or "successor_codebook" in name:
                p.normal_(std=0.05)  # leave the exact no-op start so the kernels matter
    embed = torch.nn.Embedding(V, H).to(DEVICE)
    head = torch.nn.Linear(H, V, bias=False).to(DEVICE)
    b, c = 4, 64
    feats = torch.randn(b, c, cfg.num_target_features * H, device=DEVICE)
    positions = torch.arange(c, device=DEVICE).expand(b, c)
    anchor = torch.randint(0, V, (b,), device=DEVICE)
    with torch.no_grad():
        ctx = model.context_kv(feats, positions)
        with_kernels = model.draft_block(anchor, ctx, embed, head)
        conv, walk = kernels.cuda_block_conv, kernels.cuda_lattice_walk
        kernels.cuda_block_conv = kernels.cuda_lattice_walk = None
        try:
            reference = model.draft_block(anchor, ctx, embed, head)
        finally:
            kernels.cuda_block_conv, kernels.cuda_lattice_walk = conv, walk
    agree = (with_kernels == reference).float().mean().item()
    record("DFlash2 draft_block tokens, kernels vs reference", agree >= 0.95, agreement=agree)


# ----------------------------------------------------------------------------- 3. PTX launch
class _Driver:
    """The few CUDA driver calls needed to load PTX and launch it the way TensorRT does."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed with CUDA driver error {code}")

    def launch(self, kernel, grid: tuple, args: list) -> None:
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(kernel.ptx.encode())),
                    "cuModuleLoadData")
        self._check(self.lib.cuModuleGetFunction(ctypes.byref(func), module, kernel.name.encode()),
                    "cuModuleGetFunction")
        storage = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int32(int(a))
                   for a in args]
        params = (ctypes.c_void_p * len(storage))(*[ctypes.cast(ctypes.byref(s), ctypes.c_void_p) for s in storage])
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self.lib.cuLaunchKernel(func, *grid, kernel.block_x, 1, 1, kernel.shared, stream, params, None),
                    "cuLaunchKernel")
        torch.cuda.synchronize()


@guarded
def check_ptx_launch() -> None:
    from dflash2_lightning.tensorrt import plugins

    from dflash2_lightning.kernels.aot import compile_block_conv, compile_lattice_walk

    driver = _Driver()
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        kernel = compile_block_conv(name, H)  # the build GPU's arch, as the plugin compiles it
        x, base, both = conv_inputs(8, BS, H, TAPS, GROUPS, dtype)
        delta = both[:, :, 1].contiguous()
        y = torch.empty_like(x)
        scalars, grid = plugins.block_conv_launch(x.shape, base.shape, delta.shape, BS,
                                                  kernel.constants["BLOCK_ROWS"], kernel.constants["BLOCK_H"])
        driver.launch(kernel, grid, [x, base, delta, *scalars, y])
        err = (y.float() - ops.block_conv_reference(x.float(), base.float(), delta.float(), BS)).abs().max().item()
        record(f"AOT PTX block_conv {name} (sm_{kernel.arch})", err <= TOL[dtype] * 10, max_err=err)
    kernel = compile_lattice_walk("fp32", TOP_K, RANK)
    args = walk_inputs(8, BS - 1, TOP_K, RANK, V, torch.float32)
    tokens = torch.empty(8, BS - 1, dtype=torch.long, device=DEVICE)
    scalars, grid = plugins.lattice_walk_launch(args[0].shape, args[2].shape)
    driver.launch(kernel, grid, [*args, *scalars, tokens])
    record(f"AOT PTX lattice_walk fp32 (sm_{kernel.arch})", torch.equal(tokens, reference_walk(*args)))


# ----------------------------------------------------------------------------- 4. TensorRT
def single_op_graphs(directory: Path, dtype: str = "float32") -> dict[str, Path]:
    """Write ``block_conv.trt.onnx`` and ``lattice_walk.trt.onnx``: one dflash node each, dynamic batch.

    No function bodies (these are the TensorRT copies), so the parser must use the plugins.
    """
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
        [io("y", ft, ["batch", BS, H])])
    walk = helper.make_graph(
        [helper.make_node("DFlashLatticeWalk", ["cand", "unary", "proj", "anchor", "pred", "succ"], ["tokens"],
                          domain="dflash", **attrs)],
        "lattice_walk",
        [io("cand", i64, ["batch", BS - 1, TOP_K]), io("unary", ft, ["batch", BS - 1, TOP_K]),
         io("proj", ft, ["batch", BS - 1, RANK]), io("anchor", i64, ["batch"]), io("pred", ft, [V, RANK]),
         io("succ", ft, [V, RANK])],
        [io("tokens", i64, ["batch", BS - 1])])
    paths = {}
    for graph in (conv, walk):
        model = helper.make_model(graph, opset_imports=opsets)
        onnx.checker.check_model(model)
        paths[graph.name] = directory / f"{graph.name}.{dtype}.trt.onnx"
        onnx.save(model, str(paths[graph.name]))
    return paths


def _engine_inputs(name: str, dtype: torch.dtype, batch: int) -> dict:
    if name == "block_conv":
        x, base, both = conv_inputs(batch, BS, H, TAPS, GROUPS, dtype)
        return {"x": x.cpu(), "base": base.cpu(), "delta": both[:, :, 0].contiguous().cpu()}
    args = walk_inputs(batch, BS - 1, TOP_K, RANK, V, dtype)
    return {k: t.cpu() for k, t in zip(("cand", "unary", "proj", "anchor", "pred", "succ"), args)}


def _engine_reference(name: str, feed: dict) -> torch.Tensor:
    if name == "block_conv":
        return ops.block_conv_reference(feed["x"].float(), feed["base"].float(), feed["delta"].float(), BS)
    return reference_walk(*(feed[k] for k in ("cand", "unary", "proj", "anchor", "pred", "succ")))


@guarded
def check_tensorrt(out: Path, onnx_dir: Path | None, runs: int) -> dict:
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        record("TensorRT", None, reason="tensorrt is not installed (see dflash2_lightning/tensorrt/build.py for how)")
        return {}
    import tensorrt as trt

    from dflash2_lightning.tensorrt import build as to_trt
    from dflash2_lightning.tensorrt import plugins

    plugins.register_plugins()
    registry = trt.get_plugin_registry()
    for op in (plugins.BLOCK_CONV_OP, plugins.LATTICE_WALK_OP):
        creator = registry.get_creator(op, plugins.PLUGIN_VERSION, plugins.PLUGIN_NAMESPACE)
        record(f"plugin creator dflash::{op} registered", creator is not None)
    timings = {}
    for dtype_name, dtype in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        for name, path in single_op_graphs(out / "graphs", dtype_name).items():
            inputs, _ = to_trt.read_graph(path)
            shapes = to_trt.profile_shapes(inputs, (1, 8, 64), (1, 1, 1), {})
            graph = to_trt.GraphFiles(name, path, None)
            t0 = time.time()
            plan, summary = to_trt.build_engine(graph, shapes, out / "timing.cache", tf32=False, workspace_gib=0)
            engine_path = out / f"{name}.{dtype_name}.engine"
            engine_path.write_bytes(plan)
            feed = _engine_inputs(name, dtype, 8)
            got = next(iter(to_trt.run_engine(plan, feed).values()))
            want = _engine_reference(name, feed)
            if got.dtype.is_floating_point:
                err = (got.float() - want).abs().max().item()
                ok = err <= TOL[dtype] * 10
            else:
                err = 1.0 - (got == want).float().mean().item()
                ok = err == 0.0 if dtype == torch.float32 else err < 0.03
            record(f"TensorRT {name} {dtype_name}", ok and len(summary["plugin_layers"]) == 1,
                   err=err, plugin_layers=summary["plugin_layers"], build_s=round(time.time() - t0, 1),
                   tensorrt=summary["tensorrt"])
            if dtype == torch.float32:
                timings[name] = time_engine(plan, _engine_inputs(name, dtype, 1), runs), \
                    time_engine(plan, _engine_inputs(name, dtype, 8), runs)
                check_engine_without_python_plugins(engine_path, feed, want, name)
    if onnx_dir is not None:
        rc = to_trt.main(["--onnx", str(onnx_dir), "--out", str(out / "export_engines")])
        record(f"to_trt.py on {onnx_dir}", rc == 0, exit_code=rc)
    return timings


def check_engine_without_python_plugins(engine_path: Path, feed: dict, want: torch.Tensor, name: str) -> None:
    """Run the serialized engine in a new process that never imports the plugin module (AOT: no Python needed)."""
    feed_path = engine_path.with_suffix(".inputs.pt")
    torch.save(feed, feed_path)
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from dflash2_lightning.tensorrt import build; "
            "out = build.run_engine(open(sys.argv[2], 'rb').read(), torch.load(sys.argv[3])); "
            "assert 'dflash2_lightning.tensorrt.plugins' not in sys.modules; torch.save(out, sys.argv[3] + '.out')")
    proc = subprocess.run([sys.executable, "-c", code, str(REPO), str(engine_path), str(feed_path)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        record(f"engine {name} in a process without the plugin code", False, stderr=proc.stderr[-2000:])
        return
    got = next(iter(torch.load(str(feed_path) + ".out").values()))
    ok = torch.allclose(got.float(), want.float(), atol=1e-3) if got.dtype.is_floating_point else torch.equal(got, want)
    record(f"engine {name} in a process without the plugin code", ok)


# ----------------------------------------------------------------------------- 5. latency
def time_cuda(fn: Callable, runs: int, warmup: int = 20) -> float:
    """Median milliseconds of ``fn()`` over ``runs`` CUDA-event-timed calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def time_engine(plan: bytes, feed: dict, runs: int) -> float:
    import tensorrt as trt

    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    device = {k: t.to(DEVICE) for k, t in feed.items()}
    for name, tensor in device.items():
        context.set_input_shape(name, tuple(tensor.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    outputs = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
            outputs.append(torch.empty(tuple(context.get_tensor_shape(name)), dtype=torch.float32 if
                                       engine.get_tensor_dtype(name) == trt.float32 else torch.int64, device=DEVICE))
            context.set_tensor_address(name, outputs[-1].data_ptr())
    stream = torch.cuda.current_stream().cuda_stream
    return time_cuda(lambda: context.execute_async_v3(stream), runs)


@guarded
def latency(runs: int, engine_times: dict) -> None:
    from dflash2_lightning.kernels import block_conv, lattice_walk

    rows = []
    for b in (1, 8):
        x, base, both = conv_inputs(b, BS, H, TAPS, GROUPS, torch.bfloat16)
        delta = both[:, :, 1]
        ref = time_cuda(lambda: ops.block_conv_reference(x, base, delta, BS), runs)
        ker = time_cuda(lambda: block_conv.block_conv(x, base, delta, BS), runs)
        trt_ms = engine_times.get("block_conv", (None, None))[b == 8]
        rows.append({"op": "block_conv bf16", "batch": b, "reference_ms": ref, "triton_ms": ker, "tensorrt_fp32_ms": trt_ms})
        args = walk_inputs(b, BS - 1, TOP_K, RANK, V, torch.bfloat16)
        ref = time_cuda(lambda: reference_walk(*args), runs)
        loop = time_cuda(lambda: ops.lattice_walk_per_position(*args), runs)
        ker = time_cuda(lambda: lattice_walk.lattice_walk(*args), runs)
        trt_ms = engine_times.get("lattice_walk", (None, None))[b == 8]
        rows.append({"op": "lattice_walk bf16", "batch": b, "reference_ms": ref, "per_position_loop_ms": loop,
                     "triton_ms": ker, "tensorrt_fp32_ms": trt_ms})
    record("latency", True, rows=rows)
    print("\n| op | batch | reference ms | per-position loop ms | Triton ms | TensorRT (fp32 engine) ms |")
    print("|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    for r in rows:
        print(f"| {r['op']} | {r['batch']} | {fmt(r['reference_ms'])} | {fmt(r.get('per_position_loop_ms'))} | "
              f"{fmt(r['triton_ms'])} | {fmt(r['tensorrt_fp32_ms'])} |")


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    p.add_argument("--onnx", type=Path, help="an export directory to build with export/to_trt.py as well")
    p.add_argument("--runs", type=int, default=200, help="timed runs per latency figure")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    record("environment", True, torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__,
           device=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability())
    check_kernels()
    check_dispatch()
    check_ptx_launch()
    engine_times = check_tensorrt(args.out, args.onnx, args.runs) or {}
    latency(args.runs, engine_times)
    (args.out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    failed = [r["check"] for r in RESULTS if r["ok"] is False]
    print(f"\n{len(RESULTS) - len(failed)} checks passed or skipped, {len(failed)} failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
