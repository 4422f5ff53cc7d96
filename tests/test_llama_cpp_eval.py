"""`dflash2 eval --engine llama.cpp`: τ, acceptance and speed in llama.cpp beside the project's own loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llamacpp_helpers import llama_cpp_or_skip

from dflash2_lightning.threads import fast_bf16_matmuls

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained_smollm2_draft(tmp_path_factory) -> Path:
    """A SmolLM2 draft trained briefly (the quickstart recipe, 60 online steps on the built-in corpus).

    In float32 where the CPU emulates bf16 (as the quickstart chooses there): the config's bf16-mixed
    online steps take minutes each on such a CPU."""
    llama_cpp_or_skip()  # before the training: a skipped test should not pay for it
    run = tmp_path_factory.mktemp("fit")
    cmd = [sys.executable, "-m", "dflash2_lightning", "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
           "--trainer.max_steps", "60", "--trainer.val_check_interval", "60", "--data.init_args.train_files", "null",
           "--data.init_args.mode", "online", "--data.init_args.seq_len", "128"]
    if not fast_bf16_matmuls():
        cmd += ["--trainer.precision", "32-true"]
    done = subprocess.run(cmd, cwd=run, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    hf = next(run.glob("runs/quickstart/train/hf"))
    assert (hf / "model.safetensors").is_file()
    return hf


@pytest.mark.slow
def test_llama_cpp_accepts_what_the_project_loop_accepts(trained_smollm2_draft, tmp_path):
    """Greedy, f32 target GGUF of the same weights: per prompt, llama.cpp's accepted drafts equal the loop's.

    Tolerance: a prompt may differ by at most 2 accepted drafts and all but one prompt must be equal.
    Why any can differ: llama.cpp and torch sum in other orders, so at a near tie of the draft's (or the
    target's) top two logits the argmax flips; one flip changes that cycle's accepted length and shifts
    every later anchor of the prompt.
    """
    from dflash2_lightning.evaluate.command import eval_main

    llama_cpp_or_skip()
    out = tmp_path / "eval"
    code = eval_main(["--draft", str(trained_smollm2_draft), "--target", "smollm2", "--out", str(out),
                      "--max-prompts", "4", "--max-new-tokens", "48", "--paths", "selector", "--no-estimate",
                      "--engine", "torch", "llama.cpp", "--llama-target", "f32", "--no-progress", "--threads", "2"])
    report = json.loads((out / "eval.json").read_text())
    section = report["llama.cpp"]
    assert code == 0  # the project loop is lossless
    assert section["speculative"]["lossless"], section["speculative"]["mismatched_prompts"]
    assert section["decoding"] == "selector walk" and section["threads"] == 2 and len(section["loadavg"]["start"]) == 3
    spec = section["speculative"]
    assert spec["verify_steps"] > 0 and spec["drafted"] > 0 and len(spec["accept"]) == 3
    assert spec["tau"] == pytest.approx(1 + spec["accepted"] / spec["verify_steps"])
    assert spec["accept"] == sorted(spec["accept"], reverse=True)  # P(first k accepted) falls with k
    assert section["target_only"]["tokens_per_second"] > 0 and spec["tokens_per_second"] > 0
    vs = section["accepted_vs_project"]
    assert vs["path"] == "selector" and sum(vs["project"]) > 0, vs  # a draft that accepts something
    assert vs["max_abs_diff"] <= 2 and vs["equal_prompts"] >= len(vs["project"]) - 1, vs
    assert (out / "acceptance.png").stat().st_size > 0


@pytest.mark.slow
def test_shipped_quantised_target_runs(trained_smollm2_draft, tmp_path):
    """What a llama.cpp user runs: the shipped Q4_1 SmolLM2 GGUF with the exported draft (q8_0)."""
    from dflash2_lightning.evaluate.llama_cpp import evaluate_llama_cpp

    llama_cpp_or_skip()
    from dflash2_lightning.data.prompts import EVAL_PROMPTS, encode_prompt, read_prompts
    from transformers import AutoTokenizer

    from dflash2_lightning.target.spec import TargetSpec
    from dflash2_lightning.target.load import hf_dir_of

    tok = AutoTokenizer.from_pretrained(str(hf_dir_of(TargetSpec(gguf="smollm2"))))
    prompts = [encode_prompt(tok, m) for m in read_prompts(EVAL_PROMPTS, 2)]
    section = evaluate_llama_cpp(trained_smollm2_draft, {"gguf": "smollm2"}, prompts, 32, target_gguf="shipped",
                                 stop_token_ids=[2], work_dir=tmp_path, draft_outtype="q8_0")
    assert section["target_gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert section["speculative"]["verify_steps"] > 0 and section["speculative"]["lossless"]


@pytest.mark.parametrize("n_max", [0, 4])
def test_draft_n_max_outside_the_block_is_a_clear_error(tiny_draft_config, randomized_draft, tmp_path, n_max):
    """Before anything is built or served: the bad value, the field and the bound from the draft's block."""
    from dflash2_lightning.export.checkpoint import save_draft
    from dflash2_lightning.evaluate.llama_cpp import evaluate_llama_cpp

    draft = save_draft(randomized_draft(tiny_draft_config()), tmp_path / "hf")  # block_size 4
    with pytest.raises(ValueError, match=rf"draft_n_max={n_max} .*block_size=4.* 1 <= draft_n_max <= 3"):
        evaluate_llama_cpp(draft, {"gguf": "smollm2"}, [[1, 2]], 8, draft_n_max=n_max, work_dir=tmp_path)


@pytest.mark.parametrize("p_min", [-0.1, 1.0])
def test_draft_p_min_outside_0_1_is_a_clear_error(tiny_draft_config, randomized_draft, tmp_path, p_min):
    from dflash2_lightning.export.checkpoint import save_draft
    from dflash2_lightning.evaluate.llama_cpp import evaluate_llama_cpp

    draft = save_draft(randomized_draft(tiny_draft_config()), tmp_path / "hf")
    with pytest.raises(ValueError, match=rf"draft_p_min={p_min} is out of range: 0 <= draft_p_min < 1"):
        evaluate_llama_cpp(draft, {"gguf": "smollm2"}, [[1, 2]], 8, draft_p_min=p_min, work_dir=tmp_path)
