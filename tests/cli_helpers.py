"""``dflash2 ARGS`` run in the test's own process, shaped like :func:`subprocess.run`'s result.

``cli.main`` is the function the installed script calls; run here with the command's environment, working
directory and captured output it returns the same exit status, stdout and stderr for anything that does not need
a process of its own (a refusal, a plan), without a new interpreter's ~5 s of imports on 2 cores. Tests that
train, send signals, show ``--debug`` tracebacks or read the warnings a user sees run the installed script.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def run_here(
    args: list[str], cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``dflash2 ARGS`` by ``cli.main`` in this process; environment, directory, argv and torch's threads restored."""
    import torch

    from dflash2_lightning import cli

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd, saved_argv, threads = dict(os.environ), os.getcwd(), sys.argv, torch.get_num_threads()
    os.environ.update(env or {})
    os.environ.pop("DFLASH2_DEBUG", None)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = ["dflash2"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(args)
            except SystemExit as exit_:  # --help, or a command's own exit
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        torch.set_num_threads(threads)  # an action sets torch's threads as its --threads says
    return subprocess.CompletedProcess(["dflash2", *args], code or 0, out.getvalue(), err.getvalue())
