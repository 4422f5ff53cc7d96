"""An online fit with the target sharded (``target.shard: fsdp``) under 2-process DDP (gloo, CPU) takes the same
steps as the same fit with the target whole: every rank's loss at every step equal.

The draft is data-parallel (DDP) in both; only the target differs (whole on each process, or each decoder layer
an FSDP2 unit over the two), so the losses must match bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import run_ranks
from hf_families import save_tiny_hf
from lightning.pytorch import Callback, Trainer, seed_everything

from dflash2_lightning.data.datamodule import DraftDataModule
from dflash2_lightning.export.callback import ExportOnFitEnd
from dflash2_lightning.target.spec import TargetSpec
from dflash2_lightning.train.module import DFlash2Module

STEPS = 3
WARM = {"init_from_target": True, "selector_init": "target_embedding"}  # the warm starts that read the target
DRAFT = {"block_size": 4, "num_hidden_layers": 1, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 64}


class LossFile(Callback):
    """Each rank's training loss at every step, written to ``directory/{tag}.rank{r}.json`` (spawned processes)."""

    def __init__(self, directory: Path, tag: str) -> None:
        self.directory, self.tag, self.losses = directory, tag, []

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: Trainer, module: Any) -> None:
        path = self.directory / f"{self.tag}.rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"losses": self.losses, "sharded": module.target.sharded}))


def fit_on_rank(rank: int, spec: TargetSpec, root: Path, tag: str, experimental: dict[str, Any]) -> None:
    """One of two DDP ranks (gloo, CPU) fitting. Rank 0's export at the end asks for an acceptance record only when
    sharded: skipped there with a warning (the record's target forwards on rank 0 alone would wait for rank 1 forever)."""
    seed_everything(0)
    export = {"acceptance_prompts": 2 if spec.shard == "fsdp" else 0, "dir": str(root / f"{tag}-hf")}
    module = DFlash2Module(
        target=spec, draft=DRAFT, objective={"num_anchors": 6}, export=export, experimental=experimental
    )
    data = DraftDataModule(
        target=spec,
        max_samples=24,
        val_fraction=0.0,
        seq_len=32,
        block_size=4,
        batch_size=2,
        target_layer_ids=module.draft_config.target_layer_ids,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=STEPS,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=str(root),
        callbacks=[LossFile(root, tag), ExportOnFitEnd()],
    )
    trainer.fit(module, datamodule=data)


@pytest.mark.slow
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm-start"])
def test_a_sharded_target_fits_like_a_whole_one(tmp_path: Path, warm: bool) -> None:
    """warm-start: the draft starts from the target's layers and embedding (init_from_target, selector_init), which a
    sharded target gives in the module's setup, before DDP copies rank 0's draft to the other."""
    directory = str(save_tiny_hf("llama", tmp_path / "llama", seed=2))
    experimental = WARM if warm else {}
    run_ranks(fit_on_rank, TargetSpec(path=directory), tmp_path, "whole", experimental, directory=tmp_path)
    run_ranks(
        fit_on_rank, TargetSpec(path=directory, shard="fsdp"), tmp_path, "sharded", experimental, directory=tmp_path
    )
    for rank in range(2):
        whole = json.loads((tmp_path / f"whole.rank{rank}.json").read_text())
        sharded = json.loads((tmp_path / f"sharded.rank{rank}.json").read_text())
        assert not whole["sharded"] and sharded["sharded"]
        assert len(whole["losses"]) == STEPS
        assert sharded["losses"] == whole["losses"], rank
    assert (
        json.loads((tmp_path / "whole.rank0.json").read_text())["losses"]
        != json.loads((tmp_path / "whole.rank1.json").read_text())["losses"]
    )  # each rank its own batches
    assert (tmp_path / "sharded-hf" / "config.json").is_file()  # the end-of-fit export, on rank 0
    assert not (tmp_path / "sharded-hf" / "acceptance.json").exists()


def warm_worker(rank: int, init: str, out: str, directory: str) -> None:
    """Rank ``rank``'s drafts, whole and sharded target, with and without the warm start, each from seed 0."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # transformers binds each process to its local device by it
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        drafts = {}
        for shard in ("none", "fsdp"):
            for warm in (False, True):
                torch.manual_seed(0)
                spec = TargetSpec(path=directory, shard=shard)  # type: ignore[arg-type]
                module = DFlash2Module(target=spec, draft=DRAFT, experimental=WARM if warm else {})
                module.setup("fit")  # what Lightning calls once the DataModule has loaded the target
                module.setup("fit")  # and again for another stage: the warm start runs once
                drafts[(shard, warm)] = {k: v.clone() for k, v in module.draft.state_dict().items()}
        torch.save(drafts, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_warm_start_from_a_sharded_target_equals_the_whole_targets(tmp_path: Path) -> None:
    """init_from_target and selector_init='target_embedding' with the target sharded over 2 gloo processes: the
    draft bit for bit the draft warm-started from the whole target, on each process."""
    directory = str(save_tiny_hf("llama", tmp_path / "llama", seed=3))
    mp.spawn(warm_worker, args=(f"file://{tmp_path / 'init'}", str(tmp_path), directory), nprocs=2, join=True)
    for rank in range(2):
        drafts = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for warm in (False, True):
            whole, sharded = drafts[("none", warm)], drafts[("fsdp", warm)]
            assert whole.keys() == sharded.keys()
            unequal = [k for k in whole if not torch.equal(whole[k], sharded[k])]
            assert not unequal, (rank, warm, unequal)
        cold, warm_started = drafts[("none", False)], drafts[("none", True)]
        changed = {k for k in cold if not torch.equal(cold[k], warm_started[k])}
        assert any(k.startswith("layers.0.") for k in changed) and "fc.weight" in changed, changed
        assert any("codebook" in k for k in changed), changed  # the selector's, from the embedding
