"""Run a function on N spawned CPU processes joined in one gloo group, as ``torchrun`` would start them for Lightning.

Why not ``Trainer(strategy="ddp_spawn")`` in the test's process: Lightning picks the rendezvous port by binding
port 0 and letting it go, then leaves ``MASTER_PORT`` in the pytest worker's environment for every later job; any
socket on the machine (another test's ranks, a ``llama-server``) may be handed that port meanwhile. And its ranks
exit with the gloo group still open, so a rank's teardown can race its peer's exit (Lightning's own CI reruns
such tests on ``terminated with signal SIGABRT``). Here the ranks meet through a file (no port), each sets the
variables an external launcher sets (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``), so a ``Trainer(strategy="ddp")``
in it joins the group instead of launching processes, and after the work every rank waits for the others and
closes the group before it exits. A rank that dies prints every thread's stack (faulthandler) to the test's stderr.
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, init: str, work: Callable[..., None], args: tuple[Any, ...]) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        work(rank, *args)
        dist.barrier()  # every rank done before any closes its sockets
    finally:
        dist.destroy_process_group()


def file_rendezvous(directory: Path) -> str:
    """An ``init_method`` for one group: a file store in a new folder under ``directory`` (no port to pick)."""
    return f"file://{tempfile.mkdtemp(prefix='gloo-', dir=directory)}/init"


def run_ranks(work: Callable[..., None], *args: Any, directory: Path, world: int = 2) -> None:
    """``work(rank, *args)`` on ``world`` spawned processes (gloo over :func:`file_rendezvous`); returns when all
    have ended, raises if any failed. ``work`` and ``args`` must pickle."""
    mp.spawn(_rank_main, args=(world, file_rendezvous(directory), work, args), nprocs=world, join=True)
