"""`dflash2 eval --engine llama.cpp`: τ, acceptance and speed in llama.cpp beside the project's own loop."""

from __future__ import annotations

import json

import pytest
from llamacpp_helpers import llama_cpp_or_skip


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
    code = eval_main(
        [
            "--draft",
            str(trained_smollm2_draft),
            "--target",
            "smollm2",
            "--out",
            str(out),
            "--max-prompts",
            "4",
            "--max-new-tokens",
            "48",
            "--paths",
            "selector",
            "--no-estimate",
            "--engine",
            "torch",
            "llama.cpp",
            "--llama-target",
            "f32",
            "--no-progress",
            "--threads",
            "2",
        ]
    )
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
    from transformers import AutoTokenizer

    from dflash2_lightning.data.prompts import EVAL_PROMPTS, encode_prompt, read_prompts
    from dflash2_lightning.target.load import hf_dir_of
    from dflash2_lightning.target.spec import TargetSpec

    tok = AutoTokenizer.from_pretrained(str(hf_dir_of(TargetSpec(gguf="smollm2"))))
    prompts = [encode_prompt(tok, m) for m in read_prompts(EVAL_PROMPTS, 2)]
    section = evaluate_llama_cpp(
        trained_smollm2_draft,
        {"gguf": "smollm2"},
        prompts,
        32,
        target_gguf="shipped",
        stop_token_ids=[2],
        work_dir=tmp_path,
        draft_outtype="q8_0",
    )
    assert section["target_gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert section["speculative"]["verify_steps"] > 0 and section["speculative"]["lossless"]


@pytest.mark.parametrize("n_max", [0, 4])
def test_draft_n_max_outside_the_block_is_a_clear_error(tiny_draft_config, randomized_draft, tmp_path, n_max):
    """Before anything is built or served: the bad value, the field and the bound from the draft's block."""
    from dflash2_lightning.evaluate.llama_cpp import evaluate_llama_cpp
    from dflash2_lightning.model.checkpoint import save_draft

    draft = save_draft(randomized_draft(tiny_draft_config()), tmp_path / "hf")  # block_size 4
    with pytest.raises(ValueError, match=rf"draft_n_max={n_max} .*block_size=4.* 1 <= draft_n_max <= 3"):
        evaluate_llama_cpp(draft, {"gguf": "smollm2"}, [[1, 2]], 8, draft_n_max=n_max, work_dir=tmp_path)


@pytest.mark.parametrize("p_min", [-0.1, 1.0])
def test_draft_p_min_outside_0_1_is_a_clear_error(tiny_draft_config, randomized_draft, tmp_path, p_min):
    from dflash2_lightning.evaluate.llama_cpp import evaluate_llama_cpp
    from dflash2_lightning.model.checkpoint import save_draft

    draft = save_draft(randomized_draft(tiny_draft_config()), tmp_path / "hf")
    with pytest.raises(ValueError, match=rf"draft_p_min={p_min} is out of range: 0 <= draft_p_min < 1"):
        evaluate_llama_cpp(draft, {"gguf": "smollm2"}, [[1, 2]], 8, draft_p_min=p_min, work_dir=tmp_path)
