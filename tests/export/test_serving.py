"""Engine-ready checkpoints: the loader refuses what engines would serve wrong, SERVING.md, `dflash2 check`.

The tiny geometry (conftest): hidden 32, vocab 96, 6 target layers, ids [1, 2, 4], block 4, top-k 5.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from dflash2_lightning import cli
from dflash2_lightning.errors import ConfigError
from dflash2_lightning.export.serving import SERVING_NAME
from dflash2_lightning.model import DraftModel
from dflash2_lightning.model.checkpoint import CheckpointError, load_draft, save_draft, verify_checkpoint


def edit_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        data = json.loads((directory / "config.json").read_text())
        change(data)
        (directory / "config.json").write_text(json.dumps(data))

    return apply


def edit_weights(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        state = load_file(str(directory / "model.safetensors"))
        change(state)
        save_file(state, str(directory / "model.safetensors"))

    return apply


def truncate(name: str, keep: int) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        path = directory / name
        path.write_bytes(path.read_bytes()[:keep])

    return apply


def _strip_dflash2(data: dict) -> None:
    data["architectures"] = ["DFlashDraftModel"]
    for key in ("projector_type", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        data["dflash_config"].pop(key)


def _nan(state: dict) -> None:
    state["fc.weight"][0, 0] = float("nan")


# (id, how to break a good DFlash2 checkpoint, what the refusal must say)
BROKEN = [
    (
        "llama-architecture",
        edit_config(lambda d: d.update(architectures=["LlamaForCausalLM"])),
        r"architectures=\['LlamaForCausalLM'\] is invalid: must be exactly one of \['DFlash2DraftModel', "
        r"'DFlashDraftModel'\]",
    ),
    (
        "dflash-architecture-over-dflash2-config",
        edit_config(lambda d: d.update(architectures=["DFlashDraftModel"])),
        r"architectures=\['DFlashDraftModel'\] is invalid for this checkpoint: dflash_config has DFlash2 settings",
    ),
    (
        "dflash-config-over-dflash2-weights",
        edit_config(_strip_dflash2),
        r"architectures=\['DFlashDraftModel'\] but model.safetensors holds 11 DFlash2 tensors",
    ),
    (
        "two-block-sizes",
        edit_config(lambda d: d.update(block_size=8)),
        r"block_size=8 \(top level\) disagrees with dflash_config.block_size=4",
    ),
    ("nan-weights", edit_weights(_nan), r"non-finite weights in 1 tensors: fc.weight \(1 NaN, 0 inf\)"),
    ("truncated-weights", truncate("model.safetensors", 3000), r"model.safetensors is truncated"),
    ("truncated-header", truncate("model.safetensors", 5), r"is truncated: 5 bytes"),
    ("truncated-config", truncate("config.json", 40), r"config.json is not valid JSON"),
    (
        "unsorted-layer-ids",
        edit_config(lambda d: d["dflash_config"].update(target_layer_ids=[4, 1, 2])),
        r"target_layer_ids=\[4, 1, 2\] is invalid: not in increasing order",
    ),
    (
        "last-layer-id",
        edit_config(lambda d: d["dflash_config"].update(target_layer_ids=[1, 2, 5])),
        r"target_layer_ids=\[1, 2, 5\] is invalid: .*last layer",
    ),
    (
        "string-mask-id",
        edit_config(lambda d: d["dflash_config"].update(mask_token_id="95")),
        r"dflash_config.mask_token_id='95' is invalid: must be an integer",
    ),
    (
        "output-multiplier",
        edit_config(lambda d: d["dflash_config"].update(output_multiplier=2.0)),
        r"dflash_config.output_multiplier=2.0 is not supported: vLLM and SGLang apply it",
    ),
    (
        "missing-tensor",
        edit_weights(lambda s: s.pop("layers.1.mlp_conv.base_kernel")),
        r"missing 1: layers\.1\.mlp_conv\.base_kernel",
    ),
]


@pytest.fixture
def good(tiny_draft_config, randomized_draft, tmp_path) -> Path:
    return save_draft(randomized_draft(tiny_draft_config(), seed=3), tmp_path / "draft")


@pytest.mark.parametrize("break_it, message", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_loader_refuses_each_broken_checkpoint(good, break_it, message):
    break_it(good)
    with pytest.raises((ConfigError, CheckpointError), match=message):
        load_draft(good)
    with pytest.raises((ConfigError, CheckpointError), match=message):
        verify_checkpoint(good)


@pytest.mark.parametrize("break_it, message", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_check_refuses_each_broken_checkpoint_in_one_line(good, break_it, message, capsys):
    break_it(good)
    assert cli.main(["check", "--draft", str(good)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash2: error: "), captured.err
    assert re.search(message, lines[0]), lines[0]


def test_check_passes_a_good_checkpoint_and_states_the_engine_facts(good, capsys):
    assert cli.main(["check", "--draft", str(good)]) == 0
    out = capsys.readouterr().out
    assert "DFlash2DraftModel, block_size 4, dtype float32, target_layer_ids [1, 2, 4]: loads" in out
    assert "note: [vLLM 0.33] vLLM never reads block_size=4" in out and '"num_speculative_tokens": 3' in out
    # tiny top-k 5 is not a power of two; float32 is served as float16 by SGLang's --dtype auto
    assert "warning: [SGLang 0.5.23] selector_top_k=5 is not a power of two" in out
    assert "selector_top_k=8 or 4" in out
    assert "warning: [SGLang 0.5.23] the draft is float32" in out
    assert not list(good.glob(SERVING_NAME))  # check writes nothing


def write_target(directory: Path, **overrides) -> Path:
    """A target directory as the checks read it: config.json (+ tokenizer.json), no weights."""
    config = dict(
        architectures=["Qwen3ForCausalLM"],
        num_hidden_layers=6,
        hidden_size=32,
        vocab_size=96,
        torch_dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    mask = overrides.pop("mask_id", None)
    config.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if mask is not None:
        (directory / "tokenizer.json").write_text(
            json.dumps({"added_tokens": [{"id": mask, "content": "<|MASK|>"}], "model": {"vocab": {}}})
        )
    return directory


def test_check_against_a_target_finds_every_mismatch(good, tmp_path, capsys):
    fits = write_target(tmp_path / "fits", torch_dtype="float32")
    assert cli.main(["check", "--draft", str(good), "--target", str(fits)]) == 0
    assert "error" not in capsys.readouterr().out

    other = write_target(
        tmp_path / "other",
        num_hidden_layers=4,
        hidden_size=64,
        vocab_size=128,
        mask_id=7,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    assert cli.main(["check", "--draft", str(good), "--target", str(other)]) == 1
    out = capsys.readouterr().out
    for expected in (
        "error: [all engines] hidden_size=32 but the target has 64",
        "error: [all engines] vocab_size=96 but the target has 128",
        "error: [all engines] num_target_layers=6 but the target has 4",
        "error: [all engines] target_layer_ids=[1, 2, 4] reach past layer 2",
        "warning: [all engines] rope_theta=10000 but the target's RoPE base is 1e+06",
        "error: [SGLang 0.5.23] mask_token_id=95 but the target tokenizer's <|MASK|> is id 7",
        "warning: [all engines] the draft is float32 but the target is bfloat16",
    ):
        assert expected in out, out


def _zlab_form(d: dict) -> None:
    """The published z-lab fixture's form: rope_parameters only, `dtype`, neutral multipliers, SWA layers,
    no num_target_layers; here also without is_causal, which makes vLLM serve the sliding layers causal."""
    for key in ("rope_theta", "torch_dtype", "num_target_layers", "is_causal"):
        d.pop(key)
    d.update(layer_types=["sliding_attention"] * 2, sliding_window=8, use_sliding_window=True)
    d["dflash_config"].update(output_multiplier=1.0, final_logit_softcapping=None)


def test_check_of_a_foreign_checkpoint(good, capsys):
    edit_config(_zlab_form)(good)
    assert cli.main(["check", "--draft", str(good)]) == 0
    out = capsys.readouterr().out
    assert "loads (config, tensors, values checked)" in out
    assert "does not record num_target_layers" in out
    assert "vLLM serves those layers causal" in out and 'add "is_causal": false' in out
    load_draft(good)  # the project's own loader reads it too


def test_check_names_a_missing_directory(tmp_path, capsys):
    assert cli.main(["check", "--draft", str(tmp_path / "nowhere")]) == 2
    assert "no config.json there" in capsys.readouterr().err


def commands(text: str) -> list[list[str]]:
    """The shell commands of SERVING.md's code blocks (continuation lines joined), as argv lists."""
    block, inside = "", False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if inside:
            block += line.rstrip("\\") + " " if line.endswith("\\") else line + "\n"
    return [shlex.split(c) for c in block.splitlines() if c.strip()]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("projector", ["dflash2", "dflash"])
def test_serve_help_writes_commands_with_this_checkpoints_numbers(tiny_draft_config, tmp_path, projector, capsys):
    # selector_top_k 4: a power of two (SGLang) that fits llama.cpp's lattice at hidden 32 (k * (k + 1) <= H)
    cfg = tiny_draft_config(projector_type=projector, block_size=8, selector_top_k=4)
    draft = save_draft(DraftModel(cfg), tmp_path / "draft", dtype="bfloat16")
    target = write_target(tmp_path / "target")
    assert cli.main(["serve-help", "--draft", str(draft), "--target", str(target)]) == 0
    assert f"serving instructions written to {draft / SERVING_NAME}" in capsys.readouterr().out
    text = (draft / SERVING_NAME).read_text()
    arch = "DFlash2DraftModel" if projector == "dflash2" else "DFlashDraftModel"
    assert f"`{arch}`" in text
    vllm, sglang, export, server, simple, sweep = commands(text)

    assert vllm[:3] == ["vllm", "serve", str(target.resolve())] and flag(vllm, "--dtype") == "bfloat16"
    spec = json.loads(flag(vllm, "--speculative-config"))
    assert spec == {"method": "dflash", "model": str(draft.resolve()), "num_speculative_tokens": 7}

    assert sglang[:3] == ["python", "-m", "sglang.launch_server"]
    assert flag(sglang, "--model-path") == str(target.resolve()) and flag(sglang, "--dtype") == "bfloat16"
    assert flag(sglang, "--speculative-algorithm") == "DFLASH"
    assert flag(sglang, "--speculative-draft-model-path") == str(draft.resolve())
    assert flag(sglang, "--speculative-num-draft-tokens") == "8"  # SGLang counts the anchor

    assert export[:2] == ["dflash2", "export-gguf"] and flag(export, "--draft") == str(draft.resolve())
    assert flag(export, "--target") == str(target.resolve()) and flag(export, "--out") == "draft.gguf"
    for argv, tool in ((server, "llama-server"), (simple, "llama-speculative-simple")):
        assert argv[0] == tool and flag(argv, "-md") == "draft.gguf"
        assert flag(argv, "--spec-type") == "draft-dflash" and flag(argv, "--spec-draft-n-max") == "7"
    assert "no engine problem found" in text
    assert ("walks the candidate selector" in text) == (projector == "dflash2")

    # Serving at a smaller block: the sweep that measures it, and each engine's flag at every size.
    assert sweep[:2] == ["dflash2", "eval"] and flag(sweep, "--draft") == str(draft.resolve())
    assert flag(sweep, "--target") == str(target.resolve())
    sizes = sweep[sweep.index("--served-block-sizes") + 1 : sweep.index("--replay-prompts")]
    assert sizes == [str(b) for b in range(2, 9)]
    rows = served_block_rows(text)
    assert list(rows) == list(range(2, 9))
    for b, (v, sg, lc) in rows.items():
        assert (v, sg, lc) == (
            f'"num_speculative_tokens": {b - 1}',
            f"--speculative-num-draft-tokens {b}",
            f"--spec-draft-n-max {b - 1}",
        )
    # The trained size's row says what the commands above say.
    assert rows[8] == (
        f'"num_speculative_tokens": {spec["num_speculative_tokens"]}',
        f"--speculative-num-draft-tokens {flag(sglang, '--speculative-num-draft-tokens')}",
        f"--spec-draft-n-max {flag(server, '--spec-draft-n-max')}",
    )


def served_block_rows(text: str) -> dict[int, tuple[str, str, str]]:
    """SERVING.md's table of served block sizes: per size, the vLLM, SGLang and llama.cpp settings."""
    rows = {}
    for line in text.split("## Serving at a smaller block", 1)[1].splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].split(" ")[0].isdigit():
            rows[int(cells[0].split(" ")[0])] = (cells[1], cells[2], cells[3])
    return rows


def test_serving_md_serves_no_block_below_the_convolution(tiny_draft_config, tmp_path):
    """A draft with a 3-tap convolution is served at blocks 3 .. trained; a DFlash draft (no convolution) from 2."""
    from dflash2_lightning.engines.rules import served_block_sizes
    from dflash2_lightning.export.serving import serving_markdown

    wide = tiny_draft_config(block_size=6, conv_kernel_size=3)
    assert served_block_sizes(wide) == [3, 4, 5, 6]
    assert list(served_block_rows(serving_markdown(wide, tmp_path))) == [3, 4, 5, 6]
    plain = tiny_draft_config(block_size=6, conv_kernel_size=3, projector_type="dflash")
    assert list(served_block_rows(serving_markdown(plain, tmp_path))) == [2, 3, 4, 5, 6]


def test_serve_help_takes_its_options_from_a_config_file(good, tmp_path, capsys):
    """check and serve-help share one options group; --print-config writes what --config reads back."""
    out = tmp_path / "from-config.md"
    argv = ["serve-help", "--draft", str(good), "--out", str(out)]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--print-config"])
    assert exit_.value.code == 0
    config = tmp_path / "serve-help.yaml"
    config.write_text(capsys.readouterr().out)
    assert yaml.safe_load(config.read_text()) == {"out": str(out), "draft": str(good), "target": None}
    assert cli.main(["serve-help", "--config", str(config)]) == 0
    assert out.is_file() and f"written to {out}" in capsys.readouterr().out
    config.write_text(f"draft: {good}\n")
    assert cli.main(["check", "--config", str(config)]) == 0
    assert "loads (config, tensors, values checked)" in capsys.readouterr().out


def test_serve_help_out_and_unknown_target(good, tmp_path, capsys):
    out = tmp_path / "elsewhere" / "HOWTO.md"
    assert cli.main(["serve-help", "--draft", str(good), "--out", str(out)]) == 0
    text = out.read_text()
    assert "replace TARGET below" in text and "vllm serve TARGET" in text
    assert "**warning** [SGLang 0.5.23] selector_top_k=5 is not a power of two" in text
    printed = capsys.readouterr().out
    assert "selector_top_k=5" in printed and f"written to {out}" in printed
