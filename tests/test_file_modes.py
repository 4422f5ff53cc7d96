"""Every file a run or an export writes gets the mode the umask gives: an engine running as another user reads it.

``mkstemp`` makes private ``0600`` files and ``mkdtemp`` ``0700`` directories; writers that replace their
temporary file (``safetensors``) drop any mode set before writing. The walk below covers a whole offline
``fit`` (HF checkpoint, SERVING.md, Lightning checkpoints, metrics, plots, TensorBoard, the feature cache)
and the ONNX export, under two umasks so that a hard-coded mode cannot pass.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from test_cli import small_config

from dflash2_lightning import cli, files
from dflash2_lightning.export.onnx.export import export_drafter, random_embedding_and_head
from dflash2_lightning.model import DraftModel
from dflash2_lightning.model.checkpoint import load_draft, save_draft


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def wrong_modes(root: Path, umask: int) -> list[str]:
    """Every path under ``root`` whose permission bits differ from what ``open`` / ``mkdir`` would give."""
    bad = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        if mode != want:
            bad.append(f"{path.relative_to(root.parent)}: {oct(mode)} (want {oct(want)})")
    return bad


def test_atomic_writers_give_umask_modes(tmp_path, umask, tiny_draft_config):
    files.atomic_write_text(tmp_path / "out" / "a.txt", "x")
    files.atomic_write(tmp_path / "out" / "b.bin", lambda tmp: Path(tmp).write_bytes(b"y"))
    save_draft(DraftModel(tiny_draft_config()), tmp_path / "out" / "hf")  # safetensors rewrites its temp file
    assert wrong_modes(tmp_path / "out", umask) == []
    assert files.file_mode() == 0o666 & ~umask and files.dir_mode() == 0o777 & ~umask


def test_every_file_of_an_offline_fit_and_an_onnx_export(tmp_path, umask, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dflash2"])
    config = small_config(tmp_path, mode="offline", cache_dir=str(tmp_path / "cache"), teacher_top_k=8)
    cli.main(["fit", "--config", str(config)])
    run = tmp_path / "runs" / "tiny" / "default"
    written = {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}
    for name in (
        "hf/model.safetensors",
        "hf/config.json",
        "hf/SERVING.md",
        "checkpoints/last.ckpt",
        "metrics.csv",
        "acceptance.png",
        "hparams.yaml",
        "config.yaml",
    ):
        assert name in written, sorted(written)
    assert (tmp_path / "cache" / "manifest.json").is_file()
    assert wrong_modes(tmp_path / "runs", umask) == []
    assert wrong_modes(tmp_path / "cache", umask) == []

    draft = load_draft(run / "hf")
    embed, head = random_embedding_and_head(draft.config.vocab_size, draft.config.hidden_size)
    export_drafter(draft, embed, head, tmp_path / "onnx", graphs=("context",))
    assert any(p.suffix == ".onnx" for p in (tmp_path / "onnx").iterdir())
    assert wrong_modes(tmp_path / "onnx", umask) == []
