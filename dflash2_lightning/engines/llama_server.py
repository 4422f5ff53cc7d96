"""Running ``llama-server`` from the pinned llama.cpp build (:mod:`dflash2_lightning.engines.llama_cpp`) and
stopping it.

:func:`serve` runs it on 127.0.0.1 for a ``with`` block (a target GGUF, optionally a DFlash/DFlash2 draft
GGUF) and stops it afterwards: the OpenAI-compatible server of ``dflash2 regen --server``, ``dflash2 eval
--engine llama.cpp``, the quickstart's serving check and the tests.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash2_lightning.engines.llama_cpp import LlamaCpp, LlamaCppError, require_llama_cpp


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running ``llama-server``: its base URL (``.../v1`` is the OpenAI API) and process."""

    url: str
    process: subprocess.Popen
    log: Path
    repack: bool = True  # False when it runs with --no-repack (see serve)

    @property
    def openai_url(self) -> str:
        return self.url + "/v1"


# llama.cpp 11434's CPU weight repacking (Q4_0/Q4_1 -> its AVX512/AMX layouts) segfaults while loading on some
# CPUs: seen on a 2-core Xeon with AMX for the shipped Q4_1 SmolLM2, every time, where --no-repack loads it.
NO_REPACK = "--no-repack"
_CRASH_SIGNALS = (-11, -4, -7)  # SIGSEGV, SIGILL, SIGBUS: a crash, not a refusal


@contextmanager
def serve(
    model: str | os.PathLike,
    draft: str | os.PathLike | None = None,
    threads: int = 2,
    ctx_size: int = 4096,
    parallel: int = 1,
    port: int | None = None,
    extra: Sequence[str] = (),
    startup_timeout: float = 300.0,
    llama: LlamaCpp | None = None,
    log_dir: str | os.PathLike | None = None,
) -> Iterator[Server]:
    """Run ``llama-server`` on 127.0.0.1 for the ``with`` block, then stop it (SIGTERM, then SIGKILL).

    ``draft`` adds a DFlash/DFlash2 GGUF draft (``--spec-type draft-dflash``). Waits until ``/health``
    answers 200; if the server exits or does not come up within ``startup_timeout`` seconds, raises
    :class:`LlamaCppError` with the tail of its log. A server that crashes (SIGSEGV/SIGILL/SIGBUS) while
    loading is started once more with ``--no-repack`` (``Server.repack`` is then False, and a note goes to
    stderr): llama.cpp's weight repacking crashes on some CPUs.
    """
    llama = llama or require_llama_cpp()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="llama-server-"))
    args = [
        "-m",
        str(model),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(ctx_size),
        "-np",
        str(parallel),
        "--no-webui",
    ]
    if draft is not None:
        args += ["-md", str(draft), "--spec-type", "draft-dflash"]
    args += list(extra)
    try:
        server = _start(llama, args, port or free_port(), startup_timeout, log_dir)
    except _Crashed as crash:
        if NO_REPACK in args:
            raise LlamaCppError(str(crash)) from None
        print(
            f"dflash2: llama-server crashed while loading (exit {crash.returncode}); starting it again with "
            f"{NO_REPACK} (llama.cpp's weight repacking crashes on some CPUs)",
            file=sys.stderr,
        )
        server = _start(llama, args + [NO_REPACK], port or free_port(), startup_timeout, log_dir)
    try:
        yield server
    finally:
        stop(server.process)


class _Crashed(LlamaCppError):
    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def _start(llama: LlamaCpp, args: list[str], port: int, startup_timeout: float, log_dir: Path) -> Server:
    """``llama-server`` with ``args`` on ``port``, once ``/health`` answers 200 (or an error with its log)."""
    log = log_dir / f"llama-server-{port}.log"
    cmd = [str(llama.tool("llama-server")), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = Server(f"http://127.0.0.1:{port}", process, log, repack=NO_REPACK not in args)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            code = process.poll()
            if code is not None:
                message = f"llama-server exited with {code} while starting ({' '.join(cmd)}):\n{_tail(log)}"
                if code in _CRASH_SIGNALS:
                    raise _Crashed(message, code)
                raise LlamaCppError(message)
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return server
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise LlamaCppError(
                    f"llama-server did not answer /health within {startup_timeout:.0f} s:\n{_tail(log)}"
                )
            time.sleep(0.5)
    except BaseException:
        stop(process)
        raise


def stop(process: subprocess.Popen, timeout: float = 15.0) -> None:
    """Terminate ``process`` (and wait for it); kill it if it does not exit within ``timeout`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""
