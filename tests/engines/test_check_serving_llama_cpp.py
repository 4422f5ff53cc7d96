"""`dflash2 check-serving` against the real llama-server (the pinned build) on 127.0.0.1.

The pair: SmolLM2-135M-Instruct as the target (its f32 GGUF: the very weights the project runs) and a
one-layer DFlash2 draft trained briefly for it (the shared ``trained_smollm2_draft`` fixture), its
acceptance record written on 4 held-out prompts x 32 tokens. Served as SERVING.md says, the engine agrees
with the record; each deliberately broken deployment is caught with exit 1 and its cause named:

- the draft served with fewer drafted tokens than its block (``--spec-draft-n-max 1``),
- the GGUF of another draft (a random one of the same geometry),
- another target (the same model with another final norm: another revision, same vocabulary),
- no draft at all.

Exactly the deployment SERVING.md recommends (the shipped Q4_1 target GGUF, ``--spec-draft-n-max 3 --metrics``)
is checked against the same llama-server without the draft (``--reference-url``): lossless, it agrees, though
llama.cpp's Q4_1 kernels may pick otherwise than the record at near ties; another draft's GGUF still disagrees.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import randomize_draft_
from llamacpp_helpers import llama_cpp_or_skip, smollm2_draft_config

from dflash2_lightning import cli

PROMPTS, TOKENS = 4, 32
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(trained_smollm2_draft, tmp_path_factory) -> dict:
    """The draft with its record, the target's f32 GGUF, the draft's GGUF and the GGUFs of the broken cases."""
    from dflash2_lightning.engines.acceptance_record import write_record
    from dflash2_lightning.engines.draft_gguf import export_gguf
    from dflash2_lightning.engines.target_gguf import target_gguf
    from dflash2_lightning.evaluate.record import make_record
    from dflash2_lightning.model import DraftModel
    from dflash2_lightning.model.checkpoint import save_draft

    llama_cpp_or_skip()
    work = tmp_path_factory.mktemp("check-serving")
    draft = work / "draft"
    shutil.copytree(trained_smollm2_draft, draft)
    record = make_record(draft, {"gguf": "smollm2"}, num_prompts=PROMPTS, max_new_tokens=TOKENS)
    write_record(record, draft)
    lo = record["expected"]["interval"][0]
    assert lo is not None and lo > 1.03, f"the draft accepts too little to tell drafts apart: {record['expected']}"
    target = target_gguf({"gguf": "smollm2"}, "f32")
    other = save_draft(randomize_draft_(DraftModel(smollm2_draft_config()), seed=5), work / "other")
    return {
        "draft": draft,
        "record": record,
        "target": target,
        "gguf": export_gguf(draft, target, work / "draft.gguf"),
        "other_gguf": export_gguf(other, target, work / "other.gguf"),
        "other_target": other_revision(target, work / "other-target.gguf"),
        "work": work,
    }


def other_revision(target: Path, out: Path) -> Path:
    """The target GGUF with its final norm scaled per channel: the same vocabulary and layers (the draft's
    features are unchanged), other greedy outputs, as another revision of the model would give."""
    import gguf
    import numpy as np

    shutil.copyfile(target, out)
    reader = gguf.GGUFReader(str(out), "r+")
    norm = next(t for t in reader.tensors if t.name == "output_norm.weight")
    norm.data[:] = norm.data * np.random.default_rng(0).uniform(0.2, 3.0, norm.data.shape).astype(norm.data.dtype)
    del reader  # flush the memory map
    return out


def check(
    pair: dict, capsys, model: Path, draft: Path | None, *server_args: str, reference: str | None = None
) -> tuple[int, str]:
    from dflash2_lightning.engines.llama_server import serve

    with serve(model, draft, threads=2, ctx_size=512, extra=list(server_args), log_dir=pair["work"]) as server:
        more = ["--reference-url", reference] if reference is not None else []
        code = cli.main(["check-serving", "--server", server.url, "--draft", str(pair["draft"]), *more])
    out = capsys.readouterr().out
    print(out)  # shown with -s and on failure
    return code, out


def test_a_correctly_served_pair_agrees(pair, capsys):
    """SERVING.md's command: the whole block drafted, --metrics; outputs equal, tau within the interval."""
    code, out = check(pair, capsys, pair["target"], pair["gguf"], "--spec-draft-n-max", "3", "--metrics")
    e = pair["record"]["expected"]
    assert code == 0, out
    assert f"{PROMPTS}/{PROMPTS} equal to the target's greedy continuation" in out
    assert "drafted tokens per verify step (configured: 3; the block drafts 3)" in out
    assert f"vs expected {e['tau']:.2f} [{e['interval'][0]:.2f}, {e['interval'][1]:.2f}]" in out and "(within)" in out
    assert "verdict: AGREE" in out


def test_fewer_drafted_tokens_than_the_block_are_caught(pair, capsys):
    code, out = check(pair, capsys, pair["target"], pair["gguf"], "--spec-draft-n-max", "1", "--metrics")
    assert code == 1, out
    assert "verdict: DISAGREE — llama.cpp drafts 1 token per verify step; this draft's block drafts 3" in out
    assert "`--spec-draft-n-max` is 1; the block needs 3" in out
    assert "--spec-draft-n-max 3 --metrics" in out  # SERVING.md's command


def test_the_gguf_of_another_draft_is_caught(pair, capsys):
    code, out = check(pair, capsys, pair["target"], pair["other_gguf"], "--spec-draft-n-max", "3", "--metrics")
    assert code == 1, out
    assert f"{PROMPTS}/{PROMPTS} equal" in out  # lossless all the same: the target is right
    assert "verdict: DISAGREE — served tau" in out and "is below the expected" in out
    assert "the GGUF is not this draft's" in out


def test_another_target_is_caught(pair, capsys):
    code, out = check(pair, capsys, pair["other_target"], pair["gguf"], "--spec-draft-n-max", "3", "--metrics")
    assert code == 1, out
    assert "verdict: DISAGREE — served outputs differ from the target's greedy continuation" in out
    assert "the target GGUF is quantised" in out and "convert_hf_to_gguf.py TARGET --outtype f32" in out


def test_a_server_without_the_draft_is_caught(pair, capsys):
    code, out = check(pair, capsys, pair["target"], None)
    assert code == 1, out
    assert "verdict: DISAGREE — llama.cpp drafted no token" in out
    assert "-md draft.gguf --spec-type draft-dflash" in out


def test_the_recommended_quantised_deployment_is_judged_against_the_engine_alone(pair, capsys):
    """SERVING.md's deployment as a user runs it: the shipped Q4_1 target GGUF, the draft exported against it,
    ``--spec-draft-n-max 3 --metrics``; the reference is the same llama-server and target without ``-md``."""
    from dflash2_lightning.engines.draft_gguf import export_gguf
    from dflash2_lightning.engines.llama_server import serve
    from dflash2_lightning.target.gguf import resolve_gguf

    shipped = resolve_gguf("smollm2")
    gguf = export_gguf(pair["draft"], shipped, pair["work"] / "draft-q4_1.gguf")
    with serve(shipped, None, threads=2, ctx_size=512, log_dir=pair["work"]) as alone:
        code, out = check(pair, capsys, shipped, gguf, "--spec-draft-n-max", "3", "--metrics", reference=alone.url)
        assert code == 0, out
        assert f"{PROMPTS}/{PROMPTS} equal to the same engine's outputs without the draft ({alone.url})" in out
        assert "losslessness judged by the engine without the draft" in out
        assert re.search(rf"record: \d/{PROMPTS} equal to the record's greedy continuation", out), out
        assert "(within)" in out and "verdict: AGREE (the engine's outputs with the draft equal its own" in out

        code, out = check(
            pair, capsys, shipped, pair["other_gguf"], "--spec-draft-n-max", "3", "--metrics", reference=alone.url
        )
        assert code == 1, out  # lossless all the same: the acceptance is another draft's
        assert f"{PROMPTS}/{PROMPTS} equal to the same engine's outputs without the draft" in out
        assert "verdict: DISAGREE — served tau" in out and "is below the expected" in out


def test_the_quickstart_checks_its_own_draft_and_reuses_the_verdict(pair, tmp_path, capsys):
    """The quickstart's serving check (what `dflash2 quickstart` runs after its evaluation when llama.cpp is
    built): llama-server beside the target's f32 GGUF, SERVING.md's flags, the record's first prompts."""
    from dflash2_lightning.engines.acceptance_record import RECORD_NAME
    from dflash2_lightning.quickstart.report import Reporter
    from dflash2_lightning.quickstart.run import QuickstartOptions, Stamps, serving_check
    from dflash2_lightning.target.load import load_target
    from dflash2_lightning.target.spec import TargetSpec

    target = load_target(TargetSpec(gguf="smollm2"))
    opts = QuickstartOptions(check_prompts=2)
    rep, stamps = Reporter(5), Stamps(tmp_path)
    result = serving_check(rep, opts, tmp_path, target, pair["draft"], pair["draft"] / RECORD_NAME, stamps)
    printed = capsys.readouterr().out
    assert result["agree"], printed
    assert result["target_gguf"] == str(pair["target"]) and result["expected"]["prompts"] == 2
    assert "check-serving (llama.cpp, target SmolLM2-135M-Instruct" in printed and ": agree" in printed
    assert f"served tau {result['served']['tau']:.2f} vs expected {result['expected']['tau']:.2f}" in printed
    assert json.loads((tmp_path / "eval" / "serving-check.json").read_text())["agree"]
    again = serving_check(rep, opts, tmp_path, target, pair["draft"], pair["draft"] / RECORD_NAME, stamps)
    assert again == json.loads(json.dumps(result)) and "(reused)" in capsys.readouterr().out
