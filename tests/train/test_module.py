"""`DFlash2Module`: geometry from the target, the frozen target, online/offline, errors, export."""

from __future__ import annotations

import math

import pytest
import torch
from module_helpers import SMALL, Batches, grouped, quiet_trainer, random_batch
from torch.utils.data import DataLoader

from dflash2_lightning.errors import ConfigError
from dflash2_lightning.export.callback import write_acceptance_record
from dflash2_lightning.model.checkpoint import load_draft
from dflash2_lightning.target.load import load_target
from dflash2_lightning.target.spec import TargetSpec
from dflash2_lightning.train.module import DFlash2Module, NonFiniteLossError, WarmupCosine, unwrapped_name

SPEC = TargetSpec(tiny={})


@pytest.fixture(scope="module")
def module() -> DFlash2Module:
    return DFlash2Module(target=SPEC, **grouped(**SMALL))


def test_draft_geometry_comes_from_the_target(module):
    target = load_target(SPEC)
    cfg = module.draft_config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.rope_theta) == (
        target.hidden_size,
        target.vocab_size,
        target.rope_theta,
    )
    assert cfg.num_target_layers == target.num_layers and cfg.block_size == 4
    assert cfg.target_layer_ids == target.default_layer_ids(1)
    assert cfg.mask_token_id == target.mask_token_id
    assert module.hparams["draft"]["target_layer_ids"] == cfg.target_layer_ids  # resolved ids are recorded
    other = DFlash2Module(
        target=SPEC,
        draft={
            "target_layer_ids": [0, 2],
            "mask_token_id": 7,
            "projector_type": "dflash",
            "block_size": SMALL["block_size"],
        },
    )
    assert other.draft_config.target_layer_ids == [0, 2] and other.draft_config.mask_token_id == 7
    assert other.draft.candidate_selector is None


def test_target_is_frozen_and_not_part_of_the_checkpoint(module):
    assert module.target is load_target(SPEC)  # shared with the DataModule through the memo
    assert all(not name.startswith("target") for name in module.state_dict())
    assert {name.split(".")[0] for name in module.state_dict()} == {"draft"}
    assert all(not p.requires_grad for p in module.target.parameters())
    assert all(m is not module.target for m in module.modules())  # identity: Metric overloads ==
    out = module.forward_batch(random_batch(), torch.Generator().manual_seed(0))
    out.loss.backward()
    assert all(p.grad is None for p in module.target.parameters())
    assert module.draft.fc.weight.grad is not None
    module.zero_grad()


def test_offline_batch_gives_the_online_loss(module):
    """Features and the target's greedy tokens taken from the batch == the target run in the step."""
    batch = random_batch()
    target = load_target(SPEC)
    with torch.no_grad():
        out = target.features(batch["input_ids"], batch["attention_mask"], module.draft_config.target_layer_ids)
    offline = {**batch, "features": out.features, "target_next": out.logits.argmax(-1)}
    with torch.no_grad():
        a = module.forward_batch(batch, torch.Generator().manual_seed(3), walk=True)
        b = module.forward_batch(offline, torch.Generator().manual_seed(3), walk=True)
    assert torch.equal(a.loss, b.loss)
    assert torch.equal(a.reference, b.reference) and torch.equal(a.selector_tokens, b.selector_tokens)


def test_autocast_head_is_cast_once_and_computes_what_autocast_computes(module):
    tgt = module.target
    _, head = module._embed_head(tgt)
    hidden = torch.randn(6, tgt.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = tgt.head(hidden)  # autocast's own cast of the frozen weight, at every call
        got = head(hidden)
        cast = module._head_cast[1]
        head(hidden)
        assert module._head_cast[1] is cast  # cast once, then reused
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    weight = tgt.hf.get_output_embeddings().weight
    with torch.no_grad():
        weight.mul_(1.0)  # same values, new version: a changed weight is cast again
    with torch.autocast("cpu", dtype=torch.bfloat16):
        head(hidden)
    assert module._head_cast[1] is not cast
    assert torch.equal(head(hidden), tgt.head(hidden))  # outside autocast: the target's own head, float32
    assert "_head_cast" not in module.__getstate__()


def test_bad_batches_fail_with_clear_messages(module):
    with pytest.raises(KeyError, match="loss_mask"):
        module.forward_batch({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, None)
    with pytest.raises(ConfigError, match="seq_len.*multiple of block_size=4"):
        module.forward_batch(random_batch(seq=10), None)
    bad = {**random_batch(), "features": torch.zeros(2, 16, 3)}
    with pytest.raises(ValueError, match=r"expected \[2, 16, 64\]"):
        module.forward_batch(bad, None)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"conv_kernel_size": 5}, "conv_kernel_size"),
        ({"conv_group_size": 5}, "conv_group_size"),
        ({"selector_top_k": 0}, "selector_top_k"),
        ({"target_layer_ids": [9]}, "target_layer_ids"),
        ({"lr": 0.0}, "lr"),
        ({"warmup_ratio": 1.5}, "warmup_ratio"),
        ({"dpace_alpha": 2.0}, "dpace_alpha"),
        ({"selector_lr_scale": 0.0}, "selector_lr_scale"),
    ],
)
def test_bad_geometry_and_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DFlash2Module(target=SPEC, **grouped(**{**SMALL, **kwargs}))


def test_missing_target_is_a_clear_error():
    with pytest.raises(ConfigError, match="target is missing"):
        DFlash2Module(target=None)


def test_warmup_cosine_schedule():
    schedule = WarmupCosine(warmup=4, total=14, min_ratio=0.1)
    assert [schedule(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule(4) == 1.0 and math.isclose(schedule(9), 0.55) and math.isclose(schedule(14), 0.1)
    assert math.isclose(schedule(100), 0.1)


def test_a_resume_with_more_steps_follows_the_new_schedule(tmp_path):
    """Extending a finished run (a larger max_steps on resume) stretches the cosine to the new total; it does
    not keep the checkpoint's total and train on at the final rate."""
    loader = DataLoader(Batches([{k: v[0] for k, v in random_batch(seed=i).items()} for i in range(4)]), batch_size=2)
    options = grouped(lr=1e-2, warmup_ratio=0.0, min_lr_ratio=0.0, **SMALL)
    first = quiet_trainer(tmp_path, max_steps=2)
    first.fit(DFlash2Module(target=SPEC, **options), train_dataloaders=loader)
    assert first.optimizers[0].param_groups[0]["lr"] == 0.0  # the end of a cosine to 0: the old total was 2
    first.save_checkpoint(tmp_path / "two.ckpt")
    saved = {k: v.clone() for k, v in first.lightning_module.draft.state_dict().items()}
    resumed = quiet_trainer(tmp_path, max_steps=6)
    model = DFlash2Module(target=SPEC, **options)
    resumed.fit(model, train_dataloaders=loader, ckpt_path=tmp_path / "two.ckpt")
    assert resumed.global_step == 6
    assert any(not torch.equal(saved[k], v) for k, v in model.draft.state_dict().items())  # it trained (lr > 0)
    assert not any(resumed.lr_scheduler_configs[0].scheduler.state_dict()["lr_lambdas"])  # no total saved
    # after 6 of 6 steps the stretched cosine is at its end; at step 4 of it, lr was still well above 0
    assert math.isclose(resumed.lr_scheduler_configs[0].scheduler.lr_lambdas[0](4), WarmupCosine(0, 6, 0.0)(4))


def test_non_finite_loss_names_the_step_and_batch(tmp_path):
    model = DFlash2Module(target=SPEC, **grouped(**SMALL))
    target = load_target(SPEC)
    rows = []
    for i in range(3):
        sample = {k: v[0] for k, v in random_batch(seed=i).items()}
        with torch.no_grad():
            feats = target.features(sample["input_ids"][None], None, model.draft_config.target_layer_ids).features[0]
        if i == 2:
            feats = feats.clone()
            feats[3] = float("nan")  # a corrupt offline cache row
        rows.append({**sample, "features": feats})
    loader = DataLoader(Batches(rows), batch_size=1)
    with pytest.raises(NonFiniteLossError, match="global step 2, batch index 2"):
        quiet_trainer(tmp_path, max_steps=5).fit(model, train_dataloaders=loader)


def test_training_steps_then_export(tmp_path):
    """A few real steps: the loss moves, the HF checkpoint equals the trained draft."""
    model = DFlash2Module(target=SPEC, **grouped(export_dir=str(tmp_path / "hf"), lr=1e-2, warmup_ratio=0.0, **SMALL))
    before = {k: v.clone() for k, v in model.draft.state_dict().items()}
    loader = DataLoader(Batches([{k: v[0] for k, v in random_batch(seed=i).items()} for i in range(4)]), batch_size=2)
    quiet_trainer(tmp_path, max_steps=3, gradient_clip_val=1.0).fit(model, train_dataloaders=loader)
    exported = load_draft(tmp_path / "hf")
    state = model.draft.state_dict()
    assert exported.config == model.draft_config
    assert all(torch.equal(exported.state_dict()[k], state[k]) for k in state)
    assert any(not torch.equal(before[k], state[k]) for k in state)
    # The acceptance record beside the export: the exported draft's T=0 replay on 8 held-out prompts.
    from dflash2_lightning.engines.acceptance_record import read_record, weights_digest

    record = read_record(tmp_path / "hf")
    assert record["expected"]["prompts"] == 8 and len(record["prompts"]) == 8
    assert record["expected"]["tau"] >= 1.0 and record["draft"]["weights_sha256"] == weights_digest(tmp_path / "hf")


def test_a_fit_that_writes_no_record_removes_the_previous_runs(tmp_path):
    """export.acceptance_prompts 0 after an earlier export into the same directory (a resume): the earlier
    acceptance.json describes other weights, so it goes, rather than stand beside the new ones."""
    from dflash2_lightning.engines.acceptance_record import RECORD_NAME

    hf = tmp_path / "hf"
    loader = DataLoader(Batches([{k: v[0] for k, v in random_batch(seed=i).items()} for i in range(4)]), batch_size=2)
    first = DFlash2Module(target=SPEC, **grouped(export_dir=str(hf), lr=1e-2, warmup_ratio=0.0, **SMALL))
    quiet_trainer(tmp_path, max_steps=1).fit(first, train_dataloaders=loader)
    assert (hf / RECORD_NAME).is_file()
    groups = grouped(export_dir=str(hf), lr=1e-2, warmup_ratio=0.0, **SMALL)
    groups["export"]["acceptance_prompts"] = 0
    quiet_trainer(tmp_path, max_steps=2).fit(DFlash2Module(target=SPEC, **groups), train_dataloaders=loader)
    assert (hf / "model.safetensors").is_file() and not (hf / RECORD_NAME).exists()


def test_a_recipes_mask_token_outside_the_targets_vocabulary_names_the_setting_and_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"^--model.init_args.draft.mask_token_id=151669 is invalid: must satisfy "
        r"0 <= mask_token_id < vocab_size=512; the Qwen3 recipes reserve that id .*"
        r"delete mask_token_id from the config's draft settings",
    ):
        DFlash2Module(target=SPEC, **grouped(**SMALL, mask_token_id=151669))


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_selector_lr_scale_gives_the_selector_its_own_rate(tmp_path, scale):
    """Scaled: the selector's parameters (and only they) train at scale x lr through the schedule."""
    model = DFlash2Module(target=SPEC, **grouped(lr=1e-2, warmup_ratio=0.0, selector_lr_scale=scale, **SMALL))
    loader = DataLoader(Batches([{k: v[0] for k, v in random_batch(seed=i).items()} for i in range(4)]), batch_size=2)
    trainer = quiet_trainer(tmp_path, max_steps=2)
    trainer.fit(model, train_dataloaders=loader)
    groups = {g["name"]: g for g in trainer.optimizers[0].param_groups}
    selector = {id(p) for p in model.draft.candidate_selector.parameters()}
    if scale == 1.0:
        assert set(groups) == {"decay", "no_decay"}
        return
    assert set(groups) == {"decay", "no_decay", "selector"}
    assert {id(p) for p in groups["selector"]["params"]} == selector
    assert not selector & {id(p) for g in ("decay", "no_decay") for p in groups[g]["params"]}
    assert groups["decay"]["lr"] < 1e-2  # the cosine schedule moved both rates, keeping their ratio
    assert math.isclose(groups["selector"]["lr"], scale * groups["decay"]["lr"])


@pytest.mark.parametrize("warm", [False, True])
def test_normalized_features_are_folded_into_fc_at_export(tmp_path, warm):
    """Training on unit-RMS features: the exported draft computes the same context on raw features."""
    model = DFlash2Module(
        target=SPEC,
        **grouped(
            export_dir=str(tmp_path / "hf"),
            lr=1e-2,
            warmup_ratio=0.0,
            normalize_features=True,
            init_from_target=warm,
            **SMALL,
        ),
    )
    target = load_target(SPEC)
    batch = random_batch(seed=9)
    with torch.no_grad():
        raw = target.features(batch["input_ids"], None, model.draft_config.target_layer_ids).features
        before = model.draft.context_kv(raw, torch.arange(raw.shape[1]).expand(2, -1)).layers[0].keys.clone()
    loader = DataLoader(Batches([{k: v[0] for k, v in random_batch(seed=i).items()} for i in range(4)]), batch_size=2)
    quiet_trainer(tmp_path, max_steps=2).fit(model, train_dataloaders=loader)
    scale = model.feature_scale
    assert bool(model.feature_scale_ready) and not torch.allclose(scale, torch.ones_like(scale))
    exported = load_draft(tmp_path / "hf")
    pos = torch.arange(raw.shape[1]).expand(2, -1)
    with torch.no_grad():
        ours = model.draft.context_kv(raw * scale, pos).layers[0]
        theirs = exported.context_kv(raw, pos).layers[0]
    torch.testing.assert_close(theirs.keys, ours.keys, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(theirs.values, ours.values, rtol=1e-4, atol=1e-5)
    if warm:  # measuring the scale did not change the warm-started function (only training did)
        fresh = DFlash2Module(target=SPEC, **grouped(normalize_features=True, init_from_target=True, **SMALL)).train()
        fresh.forward_batch(batch, torch.Generator().manual_seed(0))
        with torch.no_grad():
            after = fresh.draft.context_kv(raw * fresh.feature_scale, pos).layers[0].keys
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


def test_selector_init_target_embedding() -> None:
    module = DFlash2Module(target=SPEC, **grouped(selector_init="target_embedding", **SMALL))
    selector = module.draft.candidate_selector
    assert torch.equal(selector.predecessor_codebook, selector.successor_codebook)
    assert selector.successor_codebook.abs().sum() > 0 and selector.hidden_projection.weight.abs().sum() == 0
    with pytest.raises(ConfigError, match="needs draft.projector_type='dflash2'"):
        DFlash2Module(target=SPEC, **grouped(selector_init="target_embedding", projector_type="dflash", **SMALL))
    with pytest.raises(ConfigError, match="selector_init.*'bigram'"):
        DFlash2Module(target=SPEC, **grouped(selector_init="bigram", **SMALL))


def test_parameter_groups_are_decided_on_the_unwrapped_shapes():
    """FSDP (use_orig_params) hands every parameter over as a flat 1-D shard under a prefixed name: the
    decay / no-decay split must stay the one of the unwrapped draft, not put everything in no_decay."""
    import copy

    from torch import nn

    model = DFlash2Module(target=SPEC, **grouped(weight_decay=0.1, **SMALL))
    id_to_name = {id(p): n for n, p in model.draft.named_parameters()}
    before = {g["name"]: sorted(id_to_name[id(p)] for p in g["params"]) for g in model.parameter_groups()}
    assert before["decay"] and before["no_decay"]
    assert "fc.weight" in before["decay"] and "norm.weight" in before["no_decay"]
    assert all(n.endswith("base_kernel") for n in before["no_decay"] if model._param_dims[n] >= 2)

    class Wrapped(nn.Module):  # what FSDP's name mangling looks like: the draft under _fsdp_wrapped_module
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self._fsdp_wrapped_module = inner

    flat = copy.deepcopy(model)
    with torch.no_grad():
        for p in flat.draft.parameters():
            p.data = p.data.flatten()  # a 1-D shard, as FSDP's use_orig_params views are
    flat.draft = Wrapped(flat.draft)
    assert all(p.dim() == 1 for p in flat.draft.parameters())
    flat_names = {id(p): unwrapped_name(n) for n, p in flat.draft.named_parameters()}
    after = {g["name"]: sorted(flat_names[id(p)] for p in g["params"]) for g in flat.parameter_groups()}
    assert after == before


def test_online_greedy_labels_without_the_full_logits():
    """Online with hard labels, the target's head runs only on the positions the blocks read, in chunks: the
    labels, reference, loss and gradients are exactly those of the old path (argmax of all [B, S, V] logits),
    and no [B, S, V] tensor is ever formed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dflash2_lightning.train.module import source_rows
    from dflash2_lightning.train.objective import Teacher, sample_anchors

    model = DFlash2Module(target=SPEC, **grouped(**{**SMALL, "labels": "target", "num_anchors": 3}))
    batch = random_batch(seq=48, batch=3, seed=4)
    batch["loss_mask"][1, :30] = False  # a prompt: sample 1's first positions are read by no block
    target = model.target
    assert target.greedy_from_hidden
    out = model.forward_batch(batch, torch.Generator().manual_seed(7))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.draft.named_parameters() if p.grad is not None}
    model.zero_grad()

    # The old path: every position's logits, then their argmax; the same anchors.
    with torch.no_grad():
        full = target.features(batch["input_ids"], batch["attention_mask"], model.draft_config.target_layer_ids)
    embed, head = model._embed_head(target)
    anchors = sample_anchors(batch["loss_mask"], 4, 3, torch.Generator().manual_seed(7))
    old = model.objective(
        model.draft,
        embed,
        head,
        batch["input_ids"],
        batch["loss_mask"],
        full.features,
        Teacher(greedy=full.logits.max(-1).indices),
        batch["attention_mask"],
        anchors=anchors,
    )
    old.loss.backward()
    assert torch.equal(out.blocks.anchors, old.blocks.anchors)
    assert torch.equal(out.blocks.labels, old.blocks.labels) and torch.equal(out.reference, old.reference)
    assert torch.equal(out.loss, old.loss) and torch.equal(out.slot_loss, old.slot_loss)
    assert all(torch.equal(grads[n], p.grad) for n, p in model.draft.named_parameters() if p.grad is not None)
    model.zero_grad()

    # greedy_at: exactly the full argmax where asked, -1 elsewhere; the head's outputs are chunks, never [B, S, V].
    vocab, (b, s) = target.vocab_size, batch["input_ids"].shape
    rows = source_rows(*anchors, s, 4)
    assert 0 < rows.numel() < b * s

    matmuls = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.linear}

    class VocabWide(TorchDispatchMode):  # every matmul output as wide as the vocabulary: the head's
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.overloadpacket in matmuls and result.shape[-1] == vocab:
                self.sizes.append(result.numel())
            return result

    with VocabWide() as seen:
        part = target.features(
            batch["input_ids"],
            batch["attention_mask"],
            model.draft_config.target_layer_ids,
            logits=False,
            last_hidden=True,
        )
        greedy = target.greedy_at(part.last_hidden, rows, chunk_elements=16 * vocab)
    assert seen.sizes and max(seen.sizes) <= 16 * vocab and sum(seen.sizes) < b * s * vocab
    flat = greedy.view(-1)
    assert torch.equal(flat[rows], full.logits.max(-1).indices.view(-1)[rows])
    assert (flat[torch.ones(b * s, dtype=torch.bool).index_fill_(0, rows, False)] == -1).all()


def test_an_acceptance_record_that_cannot_be_made_is_a_warning(tmp_path):
    """The export is complete before the record: its failure warns, names the command to write it later."""
    model = DFlash2Module(target=SPEC, **grouped(**SMALL))
    with pytest.warns(
        UserWarning,
        match=r"^warning: \[export\] no acceptance record beside .*missing \(.*config\.json "
        r"not found.*\); write it with `dflash2 acceptance-record --draft",
    ):
        write_acceptance_record(model, tmp_path / "missing")
    assert not (tmp_path / "missing").exists()
