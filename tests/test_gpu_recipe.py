"""The GPU check at the real recipe geometry (``configs/qwen3_8b_online.yaml``), for a lent GPU machine.

``DFLASH2_GPU_RECORD=gpu-check.json python -m pytest -m gpu -x -q`` from the source tree runs these with the
other GPU tests; each check writes its figures and its verdict into one JSON record (tests/gpu_record.py).

- :func:`test_training_step_at_recipe_geometry`: the online training step (a random Qwen3-8B-shaped target,
  the recipe's 5-layer block-16 draft, one 3072-token sample) at two anchor counts under bf16 autocast:
  tokens/s, model FLOPs utilisation, peak memory against ``dflash2 plan``'s estimate for the recipe (the tensors'
  own peak within 20% of it, the allocator's peak recorded beside it), finite gradients, and every SDPA
  backend's run and gradient agreement.
- :func:`test_drafting_latency_eager_vs_cuda_graph`: one draft step at batch 1 / 8, context 256 / 4096,
  eager vs a captured CUDA graph, whose tokens must equal eager's.
- :func:`test_gpu_fit_resumes_exactly`: ``dflash2 fit`` on one GPU in bf16-mixed with a tiny Qwen3 target,
  interrupted and resumed with ``--ckpt_path last``, equal to an uninterrupted run, and its HF export read
  back; then the same under the recipe's documented FSDP override (``DraftFSDPStrategy``: a unit per draft
  layer, float32 buffers) with the recipe's gradient clipping by norm (1.0). One GPU: FSDP falls back to
  NO_SHARD at world size 1, so this runs the wrapping, clipping, checkpoints and export, not sharding itself
  (tests/train/test_fsdp.py shards over 2 CPU processes).

``--gpu-dry-run`` runs the same functions on the CPU at a scaled-down geometry in float32 (no autocast, no
CUDA graphs, no FSDP): the record then says ``"dry_run": true`` and holds null for GPU-only figures.
tests/test_gpu_check_dry.py runs that in CI so this file does not rot. Nothing here has run on a GPU yet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from gpu_record import DRY_RUN_OPTION, GpuRecord
from memory_helpers import LiveTensorBytes
from torch import Tensor

from dflash2_lightning.config import DraftConfig
from dflash2_lightning.model import DraftModel
from dflash2_lightning.train.objective import DraftObjective, Teacher, sample_anchors

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "qwen3_8b_online.yaml"
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_dry_run]

# H200 SXM dense bf16 peak (NVIDIA's datasheet: 1979 TFLOPS with sparsity, half that dense).
PEAK_BF16_FLOPS = 989.5e12


@dataclass(frozen=True)
class Geometry:
    """Target shape, draft shape and what is measured; ``REAL`` is the recipe's, ``DRY`` a CPU-sized copy."""

    hidden: int
    vocab: int
    target_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    mask_token_id: int
    selector_rank: int
    selector_top_k: int
    seq_len: int
    anchors: tuple[int, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    iters: int
    draft_iters: int


# Qwen3-8B (its config.json: hidden 4096, 36 layers, 32/8 heads of 128, MLP 12288, vocab 151936, rope 1e6)
# and the recipe's draft (5 layers, block 16, conv 2/16, selector 256 / top-16, 256 anchors, 3072 tokens).
REAL = Geometry(
    hidden=4096,
    vocab=151936,
    target_layers=36,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=12288,
    rope_theta=1e6,
    mask_token_id=151669,
    selector_rank=256,
    selector_top_k=16,
    seq_len=3072,
    anchors=(128, 256),
    contexts=(256, 4096),
    batches=(1, 8),
    iters=3,
    draft_iters=20,
)
# The same code paths in seconds on a CPU: the draft keeps 5 layers, block 16 and conv 2/16.
DRY = Geometry(
    hidden=64,
    vocab=512,
    target_layers=8,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    rope_theta=10_000.0,
    mask_token_id=4,
    selector_rank=16,
    selector_top_k=4,
    seq_len=128,
    anchors=(4, 8),
    contexts=(32, 64),
    batches=(1, 2),
    iters=1,
    draft_iters=2,
)
BLOCK = 16


@pytest.fixture(scope="module")
def dry(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption(DRY_RUN_OPTION))


@pytest.fixture(scope="module")
def geo(dry: bool) -> Geometry:
    return DRY if dry else REAL


@pytest.fixture(scope="module")
def device(dry: bool) -> torch.device:
    return torch.device("cpu" if dry else "cuda")


def draft_config(g: Geometry) -> DraftConfig:
    return DraftConfig(
        hidden_size=g.hidden,
        vocab_size=g.vocab,
        num_target_layers=g.target_layers,
        num_hidden_layers=5,
        num_attention_heads=g.heads,
        num_key_value_heads=g.kv_heads,
        head_dim=g.head_dim,
        intermediate_size=g.intermediate,
        rope_theta=g.rope_theta,
        mask_token_id=g.mask_token_id,
        block_size=BLOCK,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=g.selector_rank,
        selector_top_k=g.selector_top_k,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@pytest.fixture(scope="module")
def target(geo: Geometry, device: torch.device, dry: bool) -> torch.nn.Module:
    """A random Qwen3-8B-shaped target (built from a config dict: nothing downloaded), in bf16 on the GPU.

    Only the layers the draft reads are built: ids [1, 9, 17, 25, 33] of 36 need layers 0..33, so 34 of 36
    (the last two only feed the target's own logits, which the online step no longer computes at every
    position). Embedding and head are the full 151936 x 4096.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ids = draft_config(geo).target_layer_ids
    cfg = Qwen3Config(
        vocab_size=geo.vocab,
        hidden_size=geo.hidden,
        intermediate_size=geo.intermediate,
        num_hidden_layers=max(ids) + 1,
        num_attention_heads=geo.heads,
        num_key_value_heads=geo.kv_heads,
        head_dim=geo.head_dim,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": geo.rope_theta},
        tie_word_embeddings=False,
    )
    dtype = torch.float32 if dry else torch.bfloat16
    default = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)  # built in place on the device: no 16 GB fp32 copy on the host
        with torch.device(device):
            hf = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return hf.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target_config_dir(geo: Geometry, dry: bool, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only the target's ``config.json`` (all its layers), as ``dflash2 plan`` reads it."""
    directory = tmp_path_factory.mktemp("target-config")
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_size": geo.hidden,
                "num_hidden_layers": geo.target_layers,
                "num_attention_heads": geo.heads,
                "num_key_value_heads": geo.kv_heads,
                "head_dim": geo.head_dim,
                "intermediate_size": geo.intermediate,
                "vocab_size": geo.vocab,
                "max_position_embeddings": 40960,
                "rope_theta": geo.rope_theta,
                "tie_word_embeddings": False,
                "torch_dtype": "float32" if dry else "bfloat16",
                "rms_norm_eps": 1e-6,
                "hidden_act": "silu",
                "attention_bias": False,
            }
        )
    )
    return directory


def planned_step(geo: Geometry, dry: bool, anchors: int, target_config_dir: Path) -> dict[str, int]:
    """The plan's items (bytes by name) for the recipe on one device at ``anchors``, at this geometry."""
    from dflash2_lightning.train.plan_command import plan_of

    argv = [
        "--config",
        str(RECIPE),
        "--model.init_args.target.path",
        str(target_config_dir),
        "--model.init_args.objective.num_anchors",
        str(anchors),
        "--trainer.devices",
        "1",
        "--data.init_args.seq_len",
        str(geo.seq_len),
        "--model.init_args.draft.selector_rank",
        str(geo.selector_rank),
        "--model.init_args.draft.selector_top_k",
        str(geo.selector_top_k),
        "--model.init_args.draft.mask_token_id",
        str(geo.mask_token_id),
        "--plan.device_memory",
        "141GB",
    ]
    if dry:
        argv += [
            "--trainer.accelerator",
            "cpu",
            "--trainer.precision",
            "32",
            "--model.init_args.target.dtype",
            "float32",
        ]
    return {item.name: item.bytes for item in plan_of(argv).memory}


def embed_head(target: torch.nn.Module) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """The target's embedding and head as the draft uses them (as DFlash2Module's, without its head cache)."""
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    # fp32 embeddings for the fp32 draft; the head's matmul runs in bf16 under autocast (fp32 in the dry mode).
    return (lambda ids: F.embedding(ids, emb).float()), (lambda h: F.linear(h, head))


def target_features(target: torch.nn.Module, ids: Tensor, layer_ids: list[int]) -> Tensor:
    """Hidden states after each of ``layer_ids`` (no head), concatenated: the online step's features."""
    with torch.no_grad():
        hidden = target.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    return torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)


def step_flops(cfg: DraftConfig, seq: int, anchors: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward, the usual 6ND convention) of the draft.

    Forward, per matmul 2 x rows x in x out: fc (S x 5H -> H); per layer the context's K/V projections (S rows),
    the block's Q/K/V/O and SwiGLU MLP (Q = anchors x block rows), attention scores and values over the keys
    a block may see (its anchor's prefix, S/2 on average for uniform anchors, plus the block); the head on the
    supervised slots (anchors x (block - 1)). The selector and the convolutions (< 1%) are left out, and so is
    the frozen target's forward (timed separately: it is not the draft's work).
    """
    h, q, kv = cfg.hidden_size, anchors * cfg.block_size, cfg.num_key_value_heads * cfg.head_dim
    qd = cfg.num_attention_heads * cfg.head_dim
    fwd = 2 * seq * len(cfg.target_layer_ids) * h * h
    per_layer = (
        2 * seq * h * 2 * kv
        + 2 * q * h * (qd + 2 * kv)
        + 2 * q * qd * h
        + 2 * q * 3 * h * cfg.intermediate_size
        + 2 * 2 * q * (seq / 2 + cfg.block_size) * qd
    )
    fwd += cfg.num_hidden_layers * per_layer + 2 * anchors * (cfg.block_size - 1) * h * cfg.vocab_size
    return 3.0 * fwd


def test_training_step_at_recipe_geometry(
    geo: Geometry,
    device: torch.device,
    dry: bool,
    target: torch.nn.Module,
    target_config_dir: Path,
    gpu_record: GpuRecord,
) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = draft_config(geo)
    torch.manual_seed(1)
    draft = DraftModel(cfg).to(device)  # fp32 master weights, as bf16-mixed keeps them
    embed, head = embed_head(target)
    ids = torch.randint(0, geo.vocab, (1, geo.seq_len), device=device)
    mask_cpu = torch.ones(1, geo.seq_len, dtype=torch.bool)
    mask_cpu[:, : geo.seq_len // 8] = False  # a prompt: the blocks start in the response, as in chat data
    mask = mask_cpu.to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not dry)

    sync(device)
    t0 = time.perf_counter()
    with autocast:
        features = target_features(target, ids, cfg.target_layer_ids).float()
    sync(device)
    target_s = time.perf_counter() - t0  # first call: includes warm-up, so timed again below
    sync(device)
    t0 = time.perf_counter()
    with autocast:
        features = target_features(target, ids, cfg.target_layer_ids).float()
    sync(device)
    target_s = time.perf_counter() - t0

    def step(n: int) -> Tensor:
        """One forward + backward of the objective at ``n`` anchors (the same anchors every call)."""
        objective = DraftObjective(
            token_loss="ce",
            position_weighting="decay",
            decay_gamma=7.0,
            selector_loss_alpha=1.0,
            gold_outside_topk="insert_last",
            num_anchors=n,
        )
        anchors = tuple(t.to(device) for t in sample_anchors(mask_cpu, BLOCK, n, torch.Generator().manual_seed(0)))
        draft.zero_grad(set_to_none=True)
        with autocast:
            out = objective(draft, embed, head, ids, mask, features, Teacher(), anchors=anchors)
        out.loss.backward()
        return out.loss.detach()

    def grads() -> dict[str, Tensor]:
        return {k: p.grad.detach().float().clone() for k, p in draft.named_parameters() if p.grad is not None}

    def finite(gs: dict[str, Tensor]) -> bool:
        return bool(gs) and all(bool(torch.isfinite(g).all()) for g in gs.values())

    per_anchors: dict[str, Any] = {}
    geometry = {
        "seq_len": geo.seq_len,
        "hidden": geo.hidden,
        "vocab": geo.vocab,
        "draft_layers": 5,
        "block": BLOCK,
        "target_layers_built": max(cfg.target_layer_ids) + 1,
        "target_layers_full": geo.target_layers,
    }

    def record(passed: bool, **more: Any) -> None:
        """The check's entry as it stands, written at once (a later failure or the time cap keeps it)."""
        gpu_record.check(
            "training_step",
            passed=passed,
            geometry=geometry,
            precision="float32" if dry else "bf16 autocast, fp32 weights",
            anchors=per_anchors,
            target_dtype=str(next(target.parameters()).dtype).removeprefix("torch."),
            peak_bf16_flops_assumed=None if dry else PEAK_BF16_FLOPS,
            **more,
        )

    ok = True
    for n in geo.anchors:
        step(n)  # warm-up (kernel selection, autotuning, allocator)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(geo.iters):
            loss = step(n)
        sync(device)
        step_s = (time.perf_counter() - t0) / geo.iters
        gs = grads()
        flops = step_flops(cfg, geo.seq_len, n)
        allocated_peak = None if dry else torch.cuda.max_memory_allocated()
        entry: dict[str, Any] = {
            "draft_step_ms": 1e3 * step_s,
            "target_forward_ms": 1e3 * target_s,
            "tokens_per_s_draft_step": geo.seq_len / step_s,
            "tokens_per_s_online_step": geo.seq_len / (step_s + target_s),
            "model_tflop_per_step": flops / 1e12,
            "mfu": None if dry else flops / step_s / PEAK_BF16_FLOPS,
            "peak_memory_gib": None if dry else allocated_peak / 2**30,
            "loss": float(loss),
            "grads_finite": finite(gs),
            "params_with_grad": len(gs),
        }
        per_anchors[str(n)] = entry
        ok &= entry["grads_finite"] and bool(torch.isfinite(loss))
        record(passed=False, in_progress=True)  # the timings are kept should the plan's comparison fail
        # The plan against one more (untimed) step: the tensors' own peak, as tests/train/test_plan.py measures it on CPU
        # fits, and on the GPU the caching allocator's peak of the timed steps. The plan counts all 36 target
        # layers; the step holds the layers built here, so the target's real bytes replace that item.
        try:
            plan = planned_step(geo, dry, n, target_config_dir)
        except Exception as err:  # a finding (a missing package, a plan that cannot read the recipe): recorded
            entry["plan_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            ok = False
            record(passed=False, in_progress=True)
            continue
        target_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
        draft_bytes = sum(p.numel() * p.element_size() for p in draft.parameters())
        planned = target_bytes + sum(
            plan.get(name, 0)
            for name in (
                "draft weights",
                "gradients",
                "head in the compute dtype",
                "features for the step",
                "draft activations",
                "logits and loss",
                "draft weights, autocast copies",
            )
        )
        with LiveTensorBytes() as tensors:
            tensors.track(*target.parameters(), *draft.parameters(), features, ids, mask)
            step(n)
        entry.update(
            {
                "planned_step_gib": planned / 2**30,
                "tensor_peak_gib": tensors.peak / 2**30,
                "tensor_peak_vs_plan": tensors.peak / planned,
                "peak_memory_vs_plan": None if dry else allocated_peak / planned,
                "plan_counts_the_drafts_weights": plan["draft weights"] == draft_bytes,
            }
        )
        # Within 20% of the measured tensor peak, as the plan is held on CPU fits (tests/train/test_plan.py). The dry
        # geometry's step is a few MB, where the plan's fixed terms weigh more (measured: the plan 20% over the
        # tensors at 4 anchors, 11% at 8), so it is held to 25% there.
        ok &= entry["plan_counts_the_drafts_weights"]
        ok &= abs(planned - tensors.peak) <= (0.25 if dry else 0.2) * tensors.peak
        record(passed=False, in_progress=True)

    # Every SDPA backend forced in turn at the larger anchor count: which run (the draft's dense bool mask
    # rules out flash), and how far each one's gradients are from the math backend's.
    n = max(geo.anchors)
    step(n)
    default = grads()
    backends: dict[str, Any] = {}
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ):
        try:
            with sdpa_kernel([backend]):
                loss = step(n)
        except RuntimeError as err:  # "No available kernel": this backend refuses these inputs
            backends[backend.name] = {"ran": False, "error": str(err).strip().splitlines()[0][:300]}
            continue
        gs = grads()
        backends[backend.name] = {
            "ran": True,
            "loss": float(loss),
            "grads_finite": finite(gs),
            "equals_default": all(torch.equal(gs[k], default[k]) for k in default),
            "_grads": gs,
        }
    reference = backends["MATH"].get("_grads")
    for b in backends.values():
        gs = b.pop("_grads", None)
        if gs is not None and reference is not None:
            num = sum(float((gs[k] - reference[k]).pow(2).sum()) for k in reference)
            den = sum(float(reference[k].pow(2).sum()) for k in reference)
            b["grad_rel_diff_vs_math"] = (num / max(den, 1e-30)) ** 0.5
    chosen = [name for name, b in backends.items() if b.get("equals_default")]
    # bf16 accumulates in another order per backend; 0.1 catches a wrong kernel, not rounding.
    tol = 1e-4 if dry else 0.1
    agree = all(
        b["grads_finite"] and b.get("grad_rel_diff_vs_math", float("inf")) < tol for b in backends.values() if b["ran"]
    )
    ok &= backends["MATH"]["ran"] and agree and finite(default)
    record(passed=ok, in_progress=False, sdpa_backends=backends, sdpa_default_equals=chosen)
    assert ok, {"anchors": per_anchors, "sdpa_backends": backends}


def test_feature_capture_at_recipe_geometry(
    geo: Geometry, device: torch.device, dry: bool, target: torch.nn.Module, gpu_record: GpuRecord
) -> None:
    """Target.features' capture (hooks on the layers the draft reads) against ``output_hidden_states`` (every state
    kept) on the recipe's target and sample (1 x 3072, bf16): the same features and final hidden state bit for bit,
    and each one's peak beyond what was allocated before it (the allocator's on a GPU; the tensors' own, as
    benchmarks/bench_features.py counts them on the meta device, everywhere)."""
    from dflash2_lightning.target.capture import capture_features

    layer_ids = list(draft_config(geo).target_layer_ids)
    ids = torch.randint(0, geo.vocab, (1, geo.seq_len), device=device)

    def kept_all() -> tuple[Tensor, Tensor]:
        out = target(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1), out.hidden_states[-1]

    def hooks() -> tuple[Tensor, Tensor]:
        got = capture_features(target, ids, None, layer_ids, logits=False, last_hidden=True)
        assert got.last_hidden is not None
        return got.features, got.last_hidden

    results: dict[str, tuple[Tensor, Tensor]] = {}
    peaks: dict[str, dict[str, float | None]] = {}
    tensor_peaks: dict[str, float] = {}
    for name, fn in (("output_hidden_states", kept_all), ("hooks", hooks)):
        with torch.no_grad():
            fn()  # warm-up (kernel selection, allocator)
            sync(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with LiveTensorBytes() as tensors:
                tensors.track(*target.parameters(), *target.buffers(), ids)
                base = tensors.live
                results[name] = fn()
                sync(device)
                tensor_peak = tensors.peak - base
        allocated = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
        tensor_peaks[name] = tensor_peak / 2**30
        peaks[name] = {
            "tensor_peak_gib": tensor_peak / 2**30,
            "allocated_peak_gib": None if allocated is None else allocated / 2**30,
        }
    equal = all(torch.equal(a, b) for a, b in zip(results["output_hidden_states"], results["hooks"], strict=True))
    saved = tensor_peaks["output_hidden_states"] - tensor_peaks["hooks"]
    gpu_record.check(
        "feature_capture",
        passed=equal and (dry or saved > 0),
        in_progress=False,
        layer_ids=layer_ids,
        target_layers_built=max(layer_ids) + 1,
        tokens=geo.seq_len,
        bitwise_equal=equal,
        peaks=peaks,
        tensor_peak_saved_gib=saved,
    )
    assert equal, "the hooks' features differ from output_hidden_states'"
    # At the dry geometry the draft reads most of the few layers built: there is nothing to save.
    assert dry or saved > 0, peaks


def test_drafting_latency_eager_vs_cuda_graph(
    geo: Geometry, device: torch.device, dry: bool, target: torch.nn.Module, gpu_record: GpuRecord
) -> None:
    cfg = draft_config(geo)
    dtype = torch.float32 if dry else torch.bfloat16  # served in the export dtype (bf16)
    torch.manual_seed(2)
    draft = DraftModel(cfg).to(device, dtype).eval()
    emb, lm = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    embed = lambda t: F.embedding(t, emb).to(dtype)
    head = lambda h: F.linear(h.to(lm.dtype), lm)
    rows: dict[str, Any] = {}
    ok = True
    for b in geo.batches:
        for c in geo.contexts:
            key = f"batch{b}_context{c}"
            with torch.no_grad():
                feats = torch.randn(b, c, len(cfg.target_layer_ids) * geo.hidden, device=device, dtype=dtype)
                positions = torch.arange(c, device=device).expand(b, c)
                context = draft.context_kv(feats, positions)  # computed once: a server appends to it
                anchor = torch.randint(0, geo.vocab, (b,), device=device)
                # The first block position as a device tensor, as a server keeps it: a Python int would be
                # copied from pageable host memory inside the graph capture, which CUDA forbids.
                start = torch.full((b, 1), c, dtype=torch.long, device=device)

                def step() -> Tensor:
                    return draft.draft_block(anchor, context, embed, head, start=start)

                for _ in range(3):
                    eager = step()
                sync(device)
                t0 = time.perf_counter()
                for _ in range(geo.draft_iters):
                    step()
                sync(device)
                row: dict[str, Any] = {
                    "eager_ms": 1e3 * (time.perf_counter() - t0) / geo.draft_iters,
                    "graph_ms": None,
                    "graph_equals_eager": None,
                    "graph_error": None,
                }
                if not dry:
                    try:
                        side = torch.cuda.Stream()
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):  # warm-up off the capture stream, as the CUDA graph docs ask
                            for _ in range(3):
                                step()
                        torch.cuda.current_stream().wait_stream(side)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            captured = step()
                        graph.replay()
                        torch.cuda.synchronize()
                        row["graph_equals_eager"] = bool(torch.equal(captured, eager))
                        t0 = time.perf_counter()
                        for _ in range(geo.draft_iters):
                            graph.replay()
                        torch.cuda.synchronize()
                        row["graph_ms"] = 1e3 * (time.perf_counter() - t0) / geo.draft_iters
                    except Exception as err:  # a capture failure is a finding: recorded, then the check fails
                        row["graph_error"] = f"{type(err).__name__}: {str(err).strip()[:300]}"
                    ok &= row["graph_equals_eager"] is True
                row["tokens_shape"] = list(eager.shape)
                ok &= list(eager.shape) == [b, BLOCK - 1]
                rows[key] = row
                gpu_record.check("drafting_latency", passed=False, in_progress=True, steps=rows)  # kept if cut short
    gpu_record.check(
        "drafting_latency",
        passed=ok,
        in_progress=False,
        dtype=str(dtype).removeprefix("torch."),
        method=None if dry else "torch.cuda.CUDAGraph capture of draft_block",
        steps=rows,
    )
    assert ok, rows


# --------------------------------------------------------------------------- a GPU fit and its resume
STEPS, CRASH_AT, EVERY = 4, 2, 2
# Lightning 2.6.6's own FSDPPrecision.clip_grad_by_norm message: DraftFSDPStrategy must never show it.
FSDP_REFUSES_CLIPPING = "`gradient_clip_algorithm='norm'` is currently not supported"
FSDP_ON_CPU = (
    "not run: DraftFSDPStrategy requires a GPU accelerator (tests/test_gpu_recipes_on_cpu.py pins that "
    "refusal; tests/train/test_fsdp.py tests its pieces on CPU)"
)


def fit_config(directory: Path, dry: bool) -> Path:
    """The recipe on one device: the CPU rehearsal's overrides (tiny Qwen3 target, small data), then one GPU."""
    from test_gpu_recipes_on_cpu import rehearsal_config

    directory.mkdir(parents=True, exist_ok=True)
    path, config = rehearsal_config(RECIPE, directory)
    trainer = config["trainer"]
    trainer.update(
        accelerator="cpu" if dry else "gpu",
        devices=1,
        strategy="auto",
        max_steps=STEPS,
        val_check_interval=EVERY,
        num_sanity_val_steps=0,  # sanity validation is not what is checked
        precision="32-true" if dry else "bf16-mixed",
        # bit-exact resume on a GPU needs deterministic kernels (the recipe's commented option)
        deterministic=not dry,
    )
    trainer["callbacks"][0]["init_args"]["every_n_train_steps"] = EVERY
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_fit(config: Path, *extra: str, crash_at: int | None = None) -> subprocess.CompletedProcess:
    """``python -m dflash2_lightning fit``: from the source tree, no installed entry point needed."""
    from test_gpu_recipes_on_cpu import environment

    env = environment(config.parent, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env["PYTHONPATH"]])
    if crash_at is not None:
        env["DFLASH2_TEST_CRASH_AT"] = str(crash_at)
    return subprocess.run(
        [sys.executable, "-m", "dflash2_lightning", "fit", "--config", str(config), *extra],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def export_check(directory: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The run's HF export (``<run>/hf``), read back by the strict loader: the last checkpoint's weights."""
    from dflash2_lightning.model.checkpoint import load_draft

    found = list(directory.glob("runs/*/*/hf"))
    if len(found) != 1:
        return {"loads": False, "error": f"{len(found)} export directories"}
    try:
        exported = load_draft(found[0]).state_dict()
    except Exception as err:  # a finding: recorded, then the check fails
        return {"loads": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}
    # fc is left out: the export folds a feature scale into it when features are normalised.
    names = [k for k in state if k.startswith("draft.") and not k.startswith("draft.fc.")]
    equal = all(
        torch.equal(exported[k[len("draft.") :]], state[k].to(exported[k[len("draft.") :]].dtype)) for k in names
    )
    return {"loads": True, "tensors": len(exported), "equals_last_checkpoint": equal}


def last_state(directory: Path) -> dict[str, Any]:
    path = next(directory.glob("runs/*/*/checkpoints/last.ckpt"))
    return torch.load(path, map_location="cpu", weights_only=False)


def tail(done: subprocess.CompletedProcess) -> str:
    return (done.stdout[-1500:] + "\n" + done.stderr[-4000:]).strip()


def resume_check(root: Path, dry: bool, *extra: str) -> dict[str, Any]:
    """An uninterrupted run against one interrupted at CRASH_AT and resumed: their final draft weights."""
    whole = run_fit(fit_config(root / "whole", dry), *extra)
    if whole.returncode != 0:
        return {"passed": False, "failed": "uninterrupted run", "exit": whole.returncode, "output": tail(whole)}
    config = fit_config(root / "resumed", dry)
    first = run_fit(config, *extra, crash_at=CRASH_AT)
    if f"simulated crash at step {CRASH_AT}" not in first.stderr:
        return {"passed": False, "failed": "interrupted run", "exit": first.returncode, "output": tail(first)}
    second = run_fit(config, *extra, "--ckpt_path", "last")
    if second.returncode != 0:
        return {"passed": False, "failed": "resumed run", "exit": second.returncode, "output": tail(second)}
    a, b = last_state(root / "whole"), last_state(root / "resumed")
    names = [k for k in a["state_dict"] if k.startswith("draft.")]
    diff = max(float((a["state_dict"][k].float() - b["state_dict"][k].float()).abs().max()) for k in names)
    exact = all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in names) and set(names) == {
        k for k in b["state_dict"] if k.startswith("draft.")
    }
    export = export_check(root / "whole", a["state_dict"])
    return {
        "passed": exact
        and a["global_step"] == b["global_step"] == STEPS
        and export.get("equals_last_checkpoint") is True,
        "steps": STEPS,
        "crash_at": CRASH_AT,
        "global_step": [a["global_step"], b["global_step"]],
        "tensors": len(names),
        "max_abs_weight_diff": diff,
        "bit_exact": exact,
        "export": export,
    }


def test_gpu_fit_resumes_exactly(tmp_path: Path, dry: bool, gpu_record: GpuRecord) -> None:
    single = resume_check(tmp_path / "single", dry)
    gpu_record.check("fit_resume", passed=False, in_progress=True, single_device=single)  # kept if FSDP is cut short
    if dry:
        fsdp: dict[str, Any] = {"passed": None, "ran": False, "reason": FSDP_ON_CPU}
    else:
        from test_gpu_recipes_on_cpu import fsdp_override

        override = fsdp_override(RECIPE)  # the recipe's documented override, as a user pastes it
        fsdp = {"override": override, **resume_check(tmp_path / "fsdp", dry, *override)}
        # Were clipping still refused (Lightning's own plugin), the record names it rather than a traceback.
        fsdp["refused_norm_clipping"] = FSDP_REFUSES_CLIPPING in fsdp.get("output", "")
    gpu_record.check(
        "fit_resume",
        passed=single["passed"] and fsdp["passed"] is not False,
        in_progress=False,
        accelerator="cpu" if dry else "gpu",
        precision="32-true" if dry else "bf16-mixed",
        deterministic=not dry,
        gradient_clip_val=1.0,
        single_device=single,
        fsdp=fsdp,
    )
    assert single["passed"], single
    if fsdp.get("refused_norm_clipping"):
        pytest.fail(
            "FSDP refused the recipe's norm clipping (gradient_clip_val 1.0) under Lightning's FSDP "
            f"precision plugin: {fsdp['output'][-1500:]}",
            pytrace=False,
        )
    assert fsdp["passed"] is not False, fsdp
