"""`DraftFSDPStrategy` (dflash2_lightning/train/fsdp.py) on CPU: what torch and Lightning allow there.

Lightning refuses FSDP on a CPU accelerator, but torch's FSDP wraps a module on CPU processes under gloo. So
two spawned processes (world size 2, so parameters really are 1-D shards; one process would fall back to
NO_SHARD) wrap a real :class:`DFlash2Module` with the strategy's own settings (its wrap policy, its mixed
precision, ``use_orig_params``, full sharding) and report what they saw; the tests assert on the reports.
Only ``device_id`` differs from a GPU run (the CPU here, the rank's GPU there). The Lightning fit itself,
with this strategy, runs only in the GPU check (tests/test_gpu_recipe.py).
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from module_helpers import grouped
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from dflash2_lightning.errors import ConfigError
from dflash2_lightning.model.backbone import DraftLayer
from dflash2_lightning.target.spec import TargetSpec
from dflash2_lightning.train.fsdp import DraftFSDPPrecision, DraftFSDPStrategy
from dflash2_lightning.train.module import DFlash2Module, unwrapped_name

WORLD = 2
LAYERS = 3
MAX_NORM = 1e-3  # far below the gradients' norm: clipping must act
LR = 1e-2  # one AdamW step at weight_decay 0.1: a parameter in the wrong group moves by LR * 0.1 * itself
SETTINGS = dict(
    block_size=4,
    conv_group_size=16,
    selector_rank=8,
    selector_top_k=8,
    num_anchors=4,
    num_hidden_layers=LAYERS,
    weight_decay=0.1,
)


def build_module() -> DFlash2Module:
    torch.manual_seed(0)
    return DFlash2Module(target=TargetSpec(tiny={}), **grouped(**SETTINGS))


def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (2, 16), generator=gen)
    return {
        "input_ids": ids,
        "loss_mask": torch.ones(2, 16, dtype=torch.bool),
        "attention_mask": torch.ones(2, 16, dtype=torch.bool),
    }


def loss_of(module: DFlash2Module, call: Any) -> torch.Tensor:
    """The training loss of :func:`batch`, computed by ``call()`` with ``module.forward`` redirected to it (as
    Lightning redirects ``training_step`` through the FSDP root's forward, which gathers the root's weights)."""
    module.forward = types.MethodType(
        lambda self: self.forward_batch(batch(), torch.Generator().manual_seed(1)).loss, module
    )
    try:
        return call()
    finally:
        del module.forward


def group_names(module: DFlash2Module) -> dict[str, set[str]]:
    """Each AdamW group's parameters as unwrapped names."""
    names = {id(p): unwrapped_name(n) for n, p in module.draft.named_parameters()}
    return {g["name"]: {names[id(p)] for p in g["params"]} for g in module.parameter_groups()}


def wrap(module: DFlash2Module, strategy: DraftFSDPStrategy) -> FullyShardedDataParallel:
    """What ``strategy._setup_model`` builds, with the CPU as the device."""
    return FullyShardedDataParallel(
        module,
        mixed_precision=strategy.mixed_precision_config,
        sharding_strategy=strategy.sharding_strategy,
        device_id=torch.device("cpu"),
        **strategy.kwargs,
    )


def worker(rank: int, init: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        report: dict[str, Any] = {}
        # The unwrapped reference: its loss, gradient norm and groups.
        reference = build_module()
        ref_loss = loss_of(reference, lambda: reference())
        ref_loss.backward()
        report["reference_loss"] = float(ref_loss)
        report["reference_grad_norm"] = float(
            torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in reference.draft.parameters() if p.grad is not None])
            )
        )
        report["reference_groups"] = group_names(reference)
        torch.nn.utils.clip_grad_norm_(reference.draft.parameters(), MAX_NORM)
        torch.optim.AdamW(reference.parameter_groups(), lr=LR).step()
        report["reference_state"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}

        # Lightning's stock precision config under bf16-mixed: what the draft's buffers would become.
        stock = build_module()
        lightning_mp = FSDPPrecision("bf16-mixed").mixed_precision_config
        stock_wrapped = FullyShardedDataParallel(
            stock, mixed_precision=lightning_mp, device_id=torch.device("cpu"), use_orig_params=True
        )
        loss_of(stock, lambda: stock_wrapped())
        report["stock_inv_freq_dtype"] = str(stock.draft.rotary.inv_freq.dtype)

        strategy = DraftFSDPStrategy()
        strategy.precision_plugin = FSDPPrecision("bf16-mixed")  # as the Trainer hands it over
        module = build_module()
        inv_freq = module.draft.rotary.inv_freq.clone()
        wrapped = wrap(module, strategy)
        units = [m for m in wrapped.modules() if isinstance(m, FullyShardedDataParallel)]
        report["units"] = [type(u.module).__name__ for u in units]
        report["shard_dims"] = {unwrapped_name(n): p.dim() for n, p in module.draft.named_parameters()}
        report["groups"] = group_names(module)  # decided on the sharded parameters, as configure_optimizers does
        loss = loss_of(module, lambda: wrapped())
        report["loss"] = float(loss)
        report["inv_freq_dtype"] = str(module.draft.rotary.inv_freq.dtype)
        report["inv_freq_equal"] = bool(torch.equal(module.draft.rotary.inv_freq, inv_freq))
        loss.backward()

        # Clipping by norm through the strategy's precision plugin (what Lightning calls for gradient_clip_val).
        plugin = strategy.precision_plugin
        plugin.root = wrapped
        local = torch.stack([p.grad.float().pow(2).sum() for p in wrapped.parameters() if p.grad is not None]).sum()
        dist.all_reduce(local)
        report["grad_norm_before"] = float(local.sqrt())
        plugin.clip_grad_by_norm(None, MAX_NORM)
        local = torch.stack([p.grad.float().pow(2).sum() for p in wrapped.parameters() if p.grad is not None]).sum()
        dist.all_reduce(local)
        report["grad_norm_after"] = float(local.sqrt())
        torch.optim.AdamW(module.parameter_groups(), lr=LR).step()  # on the shards, groups as configure_optimizers

        # The full state dict gathered on rank 0, as the HF export reads it (offload_to_cpu=False: the CPU is the
        # device here; Lightning offloads to it from the GPUs).
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FullyShardedDataParallel.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, config):
            state = wrapped.state_dict()
        report["state"] = {k: v.detach().clone() for k, v in state.items()}
        torch.save(report, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's report of the wrapped module (two processes, gloo, ~20 s on 2 busy cores)."""
    directory = tmp_path_factory.mktemp("fsdp")
    mp.spawn(worker, args=(f"file://{directory / 'init'}", str(directory)), nprocs=WORLD, join=True)
    return [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_one_fsdp_unit_per_draft_layer(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert report["units"] == ["DFlash2Module"] + ["DraftLayer"] * LAYERS  # the root, then one per layer


def test_parameters_are_sharded_yet_groups_equal_the_unwrapped_modules(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert set(report["shard_dims"].values()) == {1}  # every parameter a 1-D shard
        groups, reference = report["groups"], report["reference_groups"]
        assert groups == reference
        assert "fc.weight" in groups["decay"]
        assert any(n.endswith("input_layernorm.weight") for n in groups["no_decay"])
        assert any(n.endswith("base_kernel") for n in groups["no_decay"])
        # A p.dim() < 2 rule on these shards would have exempted every parameter from weight decay.
        assert {n for n, d in report["shard_dims"].items() if d < 2} == groups["decay"] | groups["no_decay"]


def test_buffers_stay_float32_where_lightnings_bf16_mixed_casts_them(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert report["stock_inv_freq_dtype"] == "torch.bfloat16"  # the failure this strategy avoids
        assert report["inv_freq_dtype"] == "torch.float32" and report["inv_freq_equal"]


def test_the_wrapped_loss_equals_the_unwrapped_one(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert report["loss"] == pytest.approx(report["reference_loss"], rel=1e-5)


def test_clipping_by_norm_acts_on_the_norm_over_all_shards(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        # Before clipping: the shards' norm (all ranks) is the unwrapped module's norm (both ranks ran one batch).
        assert report["grad_norm_before"] == pytest.approx(report["reference_grad_norm"], rel=1e-4)
        assert report["grad_norm_before"] > 10 * MAX_NORM
        assert report["grad_norm_after"] == pytest.approx(MAX_NORM, rel=1e-3)


def test_a_clipped_step_on_the_shards_gathers_to_the_unwrapped_modules_step(reports: list[dict[str, Any]]) -> None:
    """Clipping, then one AdamW step with the weight-decay groups, on the shards; the full state dict gathered on
    rank 0 has the unwrapped names and the unwrapped module's weights after the same clipped step."""
    state, reference = reports[0]["state"], reports[0]["reference_state"]
    assert reports[1]["state"] == {}  # rank 0 alone gathers (and writes the export)
    assert set(state) == set(reference)
    initial = build_module().state_dict()
    # Every tensor moved; the predecessor codebook (zero gradient while the successor codebook is zero) by
    # weight decay alone, so a decayed parameter in the no-decay group fails here.
    assert all(not torch.equal(state[k], initial[k]) for k in initial if k.startswith("draft."))
    for k in reference:
        torch.testing.assert_close(state[k], reference[k], rtol=1e-5, atol=1e-6, msg=k)
    # What the end-of-fit export does with it (DFlash2Module.draft_from_state): the served names, loaded strictly.
    build_module().draft_from_state(state)


# ---------------------------------------------------------------- the strategy's settings (one process)
def test_the_strategy_wraps_draft_layers_and_keeps_float32() -> None:
    strategy = DraftFSDPStrategy()
    policy = strategy.kwargs["auto_wrap_policy"]
    assert isinstance(policy, ModuleWrapPolicy) and policy._module_classes == {DraftLayer}
    assert strategy.kwargs["use_orig_params"] is True
    for precision in ("32-true", "bf16-mixed", "16-mixed"):
        strategy.precision_plugin = FSDPPrecision(precision)
        assert isinstance(strategy.precision_plugin, DraftFSDPPrecision)
        assert strategy.precision_plugin.precision == precision
        mp_config = strategy.mixed_precision_config
        assert (mp_config.param_dtype, mp_config.reduce_dtype, mp_config.buffer_dtype) == (torch.float32,) * 3
        assert mp_config.cast_root_forward_inputs is False


def test_the_wrapped_root_is_what_the_plugin_clips(monkeypatch: pytest.MonkeyPatch) -> None:
    root = object()
    monkeypatch.setattr("lightning.pytorch.strategies.FSDPStrategy._setup_model", lambda self, model: root)
    strategy = DraftFSDPStrategy()
    strategy.precision_plugin = FSDPPrecision("bf16-mixed")
    assert strategy._setup_model(torch.nn.Linear(1, 1)) is root and strategy.precision_plugin.root is root


def test_normalize_features_is_refused_before_wrapping() -> None:
    module = torch.nn.Module()
    module.register_buffer("feature_scale", torch.ones(4))  # what experimental.normalize_features adds
    with pytest.raises(ConfigError, match="normalize_features is not supported with DraftFSDPStrategy"):
        DraftFSDPStrategy()._setup_model(module)


def test_lightnings_own_fsdp_precision_refuses_norm_clipping() -> None:
    """Why the strategy brings its own plugin: Lightning 2.6.6's raises on gradient_clip_val."""
    with pytest.raises(MisconfigurationException, match="gradient_clip_algorithm='norm'"):
        FSDPPrecision("bf16-mixed").clip_grad_by_norm(None, 1.0)
    with pytest.raises(RuntimeError, match="before the model was wrapped"):
        DraftFSDPPrecision("bf16-mixed").clip_grad_by_norm(None, 1.0)


def test_clipping_with_a_root_that_is_not_the_fsdp_unit_says_so() -> None:
    """A model that came to the strategy already wrapped leaves a plain root: clipping names that, in one line."""
    plugin = DraftFSDPPrecision("bf16-mixed")
    plugin.root = torch.nn.Linear(1, 1)
    with pytest.raises(RuntimeError, match=r"needs the FSDP root unit.*already wrapped \(Linear\)"):
        plugin.clip_grad_by_norm(None, 1.0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
def test_the_batch_keeps_its_dtype_where_lightnings_fsdp_plugin_casts_it_to_float32(precision: str) -> None:
    """Offline bf16 features and teacher logits reach the step in bf16 (as under DDP), not doubled to float32."""
    batch = {
        "features": torch.ones(2, 3, dtype=torch.bfloat16),
        "logits": torch.ones(2, dtype=torch.float16),
        "input_ids": torch.ones(2, dtype=torch.long),
    }
    if precision != "32-true":  # the reason for the override: Lightning's own plugin casts under mixed precision
        assert FSDPPrecision(precision).convert_input(batch)["features"].dtype == torch.float32
    converted = DraftFSDPPrecision(precision).convert_input(batch)
    assert {k: v.dtype for k, v in converted.items()} == {k: v.dtype for k, v in batch.items()}


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_half_true_precisions_are_refused(precision: str) -> None:
    with pytest.raises(ConfigError, match=f"trainer.precision='{precision}' is invalid with DraftFSDPStrategy"):
        DraftFSDPStrategy().precision_plugin = FSDPPrecision(precision)


@pytest.mark.parametrize("fixed", ["mixed_precision", "auto_wrap_policy"])
def test_settings_the_strategy_fixes_are_refused(fixed: str) -> None:
    with pytest.raises(ConfigError, match=f"trainer.strategy.init_args.{fixed} is set by DraftFSDPStrategy"):
        DraftFSDPStrategy(**{fixed: {DraftLayer}})


def test_a_cpu_accelerator_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="requires a GPU accelerator, but received accelerator='cpu'"):
        Trainer(accelerator="cpu", devices=1, strategy=DraftFSDPStrategy(), logger=False)
