"""DraftDataModule: parsing, loss masks, skipping, validation, and the offline feature cache."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from module_helpers import data_args

from dflash2_lightning.data.datamodule import DraftDataModule
from dflash2_lightning.data.encode import encode_chat, encode_records
from dflash2_lightning.data.feature_cache import MANIFEST
from dflash2_lightning.data.records import DataError, held_out_by_prompt, prompt_key
from dflash2_lightning.errors import ConfigError
from dflash2_lightning.target.load import load_target
from dflash2_lightning.target.spec import TargetSpec
from dflash2_lightning.target.target import Target

TINY = TargetSpec(tiny={})
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "And 4 plus 4?"},
    {"role": "assistant", "content": "8."},
]


@pytest.fixture(scope="module")
def tok():
    return load_target(TINY).tokenizer


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def spans(ids: torch.Tensor | list, mask) -> list[list[int]]:
    """Runs of consecutive supervised token ids."""
    out, run = [], []
    for i, m in zip(list(ids), list(mask)):
        if m:
            run.append(int(i))
        elif run:
            out.append(run)
            run = []
    return out + ([run] if run else [])


def module(tmp_path: Path, records: list | None = None, **kw) -> DraftDataModule:
    files = [write_jsonl(tmp_path / "train.jsonl", records)] if records is not None else None
    kw.setdefault("seq_len", 64)
    kw.setdefault("block_size", 8)
    kw.setdefault("batch_size", 4)
    return DraftDataModule(TINY, train_files=files, **data_args(**kw))


# ---------------------------------------------------------------------- arguments
def test_seq_len_must_be_a_multiple_of_block_size():
    with pytest.raises(ConfigError, match=r"seq_len=100 is invalid.*block_size=16"):
        DraftDataModule(TINY, seq_len=100, block_size=16)


def test_lightning_cli_style_arguments_parse_into_the_module():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(DraftDataModule, "data")
    cfg = parser.parse_object(
        {"data": {"target": {"tiny": {"num_hidden_layers": 2}}, "seq_len": 32, "block_size": 8, "mode": "offline"}}
    )
    dm = parser.instantiate(cfg)["data"]
    assert isinstance(dm, DraftDataModule)
    assert dm.target == TargetSpec(tiny={"num_hidden_layers": 2}) and dm.mode == "offline"


# ---------------------------------------------------------------------- parsing and loss masks
def test_text_is_supervised_everywhere(tmp_path, tok):
    text = "The capital of Japan is Tokyo."
    dm = module(tmp_path, [{"text": text}] * 2, val_fraction=0.0)
    dm.setup()
    row = dm.train_dataset[0]
    n = int(row["attention_mask"].sum())
    assert torch.equal(row["loss_mask"], row["attention_mask"])
    assert tok.decode(row["input_ids"][:n]) == text
    assert (row["input_ids"][n:] == tok.pad_token_id).all()


def test_chat_supervises_only_assistant_turns(tok):
    ids, mask = encode_chat(tok, CHAT)
    decoded = [tok.decode(run) for run in spans(ids, mask)]
    assert decoded == ["2 plus 3 is 5.<|im_end|>", "8.<|im_end|>"]
    rendered = tok.apply_chat_template(CHAT, tokenize=False)
    assert tok.decode(ids) == rendered


# Renders the final assistant turn differently (a Qwen3-style empty think block), so prefixes are inconsistent.
THINK_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m.content + '<|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
MARKER_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{%- generation %}{{ m.content + '<|im_end|>' }}{%- endgeneration %}{{ '\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
)


@pytest.mark.parametrize("template", [THINK_TEMPLATE, MARKER_TEMPLATE], ids=["content-search", "generation-markers"])
def test_chat_templates_without_consistent_prefixes(tok, template):
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>", chat_template=template
    )
    ids, mask = encode_chat(other, CHAT)
    assert [other.decode(run) for run in spans(ids, mask)] == ["2 plus 3 is 5.<|im_end|>", "8.<|im_end|>"]


def test_sharegpt_equals_messages(tmp_path):
    sharegpt = {
        "conversations": [
            {"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
            for m in CHAT
        ]
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    dm_a = module(tmp_path / "a", [{"messages": CHAT}], val_fraction=0.0)
    dm_b = module(tmp_path / "b", [sharegpt], val_fraction=0.0)
    dm_a.setup()
    dm_b.setup()
    for key in ("input_ids", "loss_mask", "attention_mask"):
        assert torch.equal(dm_a.train_dataset[0][key], dm_b.train_dataset[0][key])
    assert 0 < dm_a.train_dataset[0]["loss_mask"].sum() < dm_a.train_dataset[0]["attention_mask"].sum()


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "ok"', "invalid JSON"),
        ('{"txt": "x"}', "expected a key 'text', 'messages' or 'conversations'"),
        ('{"messages": [{"role": "user"}]}', "turn 0 must be an object"),
        ('{"conversations": [{"from": "alien", "value": "x"}]}', "unknown ShareGPT role"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, "", line])
    dm = DraftDataModule(TINY, train_files=[path], seq_len=32, block_size=8)
    with pytest.raises(DataError, match=rf"bad\.jsonl:3: .*{message}"):
        dm.setup()


def test_samples_without_supervision_are_skipped_and_counted(tmp_path, caplog):
    long_user = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    records = [
        {"text": "kept one"},
        {"text": ""},
        {"messages": [{"role": "user", "content": "no answer"}]},
        long_user,
        {"messages": CHAT},
    ]
    dm = module(tmp_path, records, val_fraction=0.0)
    with caplog.at_level(logging.WARNING, logger="dflash2_lightning.data.datamodule"):
        dm.setup()
    assert dm.skipped_samples == 3
    assert len(dm.train_dataset) == 2
    assert "skipped 3 of 5 samples" in caplog.text


def test_cut_keeps_a_partial_assistant_turn(tok):
    ids, mask = encode_chat(tok, CHAT)
    first = mask.index(True)
    arrays, skipped = encode_records(tok, [("x:1", {"messages": CHAT})], seq_len=first + 2)
    assert skipped == 0 and arrays["input_ids"].shape == (1, first + 2)
    assert arrays["input_ids"][0].tolist() == ids[: first + 2]
    assert arrays["attention_mask"].all() and arrays["loss_mask"].sum() == 2


# ---------------------------------------------------------------------- built-in corpus, splits, batches
def test_builtin_corpus_split_is_deterministic_and_disjoint():
    a = DraftDataModule(TINY, seq_len=32, block_size=8, max_samples=200, val_fraction=0.1)
    b = DraftDataModule(TINY, seq_len=32, block_size=8, max_samples=200, val_fraction=0.1)
    a.setup()
    b.setup()
    for split in ("train_dataset", "val_dataset"):
        assert np.array_equal(getattr(a, split).array("input_ids"), getattr(b, split).array("input_ids"))
    assert len(a.train_dataset) + len(a.val_dataset) + a.skipped_samples == 200 and len(a.val_dataset) == 20
    records = a._records()
    assert not {w for w, _ in records["train"]} & {w for w, _ in records["val"]}


def test_online_batch_layout():
    dm = DraftDataModule(TINY, seq_len=32, block_size=8, batch_size=4, max_samples=40)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "loss_mask", "attention_mask"}
    assert batch["input_ids"].shape == (4, 32) and batch["input_ids"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.bool and batch["attention_mask"].dtype == torch.bool
    assert not (batch["loss_mask"] & ~batch["attention_mask"]).any()


# ---------------------------------------------------------------------- offline cache
RECORDS = [{"text": f"Sample {i}: the numbers {i}, {i + 1} and {i + 2} follow each other."} for i in range(10)] + [
    {"messages": CHAT}
]


def offline(tmp_path: Path, **kw) -> DraftDataModule:
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    kw.setdefault("target_layer_ids", [1, 3])
    return module(tmp_path, RECORDS, mode="offline", seq_len=64, val_fraction=0.2, **kw)


def test_offline_batch_matches_online_features(tmp_path):
    dm = offline(tmp_path, teacher_top_k=3, feature_dtype="float32")
    dm.prepare_data()
    dm.setup()
    batch = next(iter(dm.val_dataloader()))
    tgt = dm.target_model
    out = tgt.features(batch["input_ids"], batch["attention_mask"], [1, 3])
    valid = batch["attention_mask"]
    assert batch["features"].shape == (2, 64, 2 * tgt.hidden_size) and batch["features"].dtype == tgt.dtype
    torch.testing.assert_close(batch["features"][valid], out.features[valid], rtol=0, atol=1e-5)
    assert (batch["features"][~valid] == 0).all()
    assert torch.equal(batch["target_next"][valid], out.logits.argmax(-1)[valid])
    values, indices = out.logits.topk(3, dim=-1)
    assert batch["teacher_topk_indices"].dtype == torch.long
    assert torch.equal(batch["teacher_topk_indices"][valid], indices[valid])
    torch.testing.assert_close(batch["teacher_topk_values"][valid], values[valid])


def test_float16_features_are_close_and_memory_mapped(tmp_path):
    dm = offline(tmp_path)
    dm.setup()
    assert isinstance(dm.train_dataset.array("features"), np.memmap)
    assert dm.train_dataset.array("features").dtype == np.float16
    row = dm.train_dataset[0]
    out = dm.target_model.features(row["input_ids"][None], row["attention_mask"][None], [1, 3])
    valid = row["attention_mask"]
    torch.testing.assert_close(row["features"][valid], out.features[0][valid], rtol=2e-3, atol=2e-3)


def test_bf16_autocast_features_are_their_own_cache_and_close(tmp_path):
    exact = offline(tmp_path, feature_dtype="float32", cache_dir=None)
    fast = offline(tmp_path, feature_dtype="float32", feature_autocast="bf16", cache_dir=None)
    assert fast.manifest()["feature_autocast"] == "bf16" and "feature_autocast" not in exact.manifest()
    assert fast.cache_path() != exact.cache_path()  # never mistaken for the float32 cache (nor it for this one)
    exact.cache_dir, fast.cache_dir = str(tmp_path / "fp32"), str(tmp_path / "bf16")
    for dm in (exact, fast):
        dm.prepare_data()
        dm.setup()
    a, b = exact.train_dataset[0], fast.train_dataset[0]
    valid = a["attention_mask"]
    assert not torch.equal(a["features"][valid], b["features"][valid])  # really computed in bf16
    torch.testing.assert_close(b["features"][valid], a["features"][valid], rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="feature_autocast='fp8'.*'none' or 'bf16'"):
        offline(tmp_path, feature_autocast="fp8")


def test_offline_cache_is_built_once_then_reused(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = Target.features

    def counting(self, *a, **k):
        calls["n"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(Target, "features", counting)
    first = offline(tmp_path)
    first.prepare_data()
    first.setup()
    assert calls["n"] > 0
    built = calls["n"]
    second = offline(tmp_path)
    second.prepare_data()
    second.setup()
    assert calls["n"] == built  # the second module read the cache, never the target
    assert torch.equal(second.train_dataset[0]["features"], first.train_dataset[0]["features"])


def test_crash_midway_leaves_no_complete_looking_cache(tmp_path, monkeypatch):
    real = Target.features
    calls = {"n": 0}

    def crash_on_second(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated crash")
        return real(self, *a, **k)

    monkeypatch.setattr(Target, "features", crash_on_second)
    dm = offline(tmp_path, batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        dm.prepare_data()
    assert not (tmp_path / "cache").exists()
    assert not list(tmp_path.glob("**/" + MANIFEST))
    monkeypatch.setattr(Target, "features", real)
    dm = offline(tmp_path, batch_size=2)
    dm.setup()
    assert (tmp_path / "cache" / MANIFEST).is_file() and len(dm.train_dataset) == 9


def test_manifest_mismatch_names_the_field(tmp_path):
    offline(tmp_path).setup()
    with pytest.raises(DataError, match=r"target_layer_ids: cache has \[1, 3\], this run has \[2\].*Delete"):
        offline(tmp_path, target_layer_ids=[2]).setup()
    path = tmp_path / "train.jsonl"
    with pytest.raises(DataError, match=r"data: cache has"):
        dm = offline(tmp_path)
        path.write_text(path.read_text().replace("Sample 3", "Example 3"))
        dm.setup()


def test_foreign_directory_is_not_mistaken_for_a_cache(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="has no manifest.json"):
        offline(tmp_path).setup()


def test_validation_holds_out_whole_prompts():
    """A greedy and sampled responses to one prompt land in the same split: validation measures unseen prompts."""
    prompts = [f"question {i}" for i in range(20)]
    records = [
        (
            f"f:{3 * i + k}",
            {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": f"answer {k} to {p}"}]},
        )
        for i, p in enumerate(prompts)
        for k in range(3)
    ]
    held = held_out_by_prompt(records, n_val=5)
    assert len(held) == 6  # rounded up to two whole prompts
    key = {i: r["messages"][0]["content"] for i, (_, r) in enumerate(records)}
    assert not {key[i] for i in held} & {key[i] for i in range(len(records)) if i not in held}
    assert held == held_out_by_prompt(records, n_val=5)  # fixed
    one_prompt = [r for r in records if r[1]["messages"][0]["content"] == "question 0"]
    assert len(held_out_by_prompt(one_prompt, n_val=1)) == 1  # one prompt: single records, never all of them
    assert held_out_by_prompt(records[:6], n_val=6) != set(range(6))  # the last group always trains
    assert prompt_key("plain text") == "plain text"


# ---------------------------------------------------------------------- worker processes
def test_forked_workers_are_a_known_hang_before_python_3_11_8():
    from dflash2_lightning.data.workers import fork_deadlock_risk

    risk = fork_deadlock_risk((3, 11, 7), "fork")
    assert risk is not None and "Python 3.11.7" in risk and "gh-112275" in risk and "num_workers 0" in risk
    assert fork_deadlock_risk((3, 11, 8), "fork") is None and fork_deadlock_risk((3, 12, 1), "fork") is None
    assert fork_deadlock_risk((3, 11, 7), "spawn") is None and fork_deadlock_risk((3, 11, 7), "forkserver") is None


def test_setup_warns_where_workers_can_hang(monkeypatch):
    import dflash2_lightning.data.datamodule as datamodule

    monkeypatch.setattr(datamodule, "fork_deadlock_risk", lambda: "Python 3.11.7 can deadlock (gh-112275)")
    with pytest.warns(UserWarning, match=r"^warning: \[data\] num_workers=2: Python 3.11.7 can deadlock"):
        DraftDataModule(TINY, seq_len=32, block_size=8, max_samples=20, num_workers=2).setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DraftDataModule(TINY, seq_len=32, block_size=8, max_samples=20, num_workers=0).setup()  # no workers: silent
