"""Preemption and dead ranks, with real processes: ``dflash2 fit`` on one process and on two DDP ranks over gloo.

SIGTERM (to the launcher, to a child rank, to every process as a scheduler sends it) and SIGUSR1 (SLURM's requeue
warning) stop every rank at the next step boundary with a checkpoint of that step, end every process, exit with
``128 + signal`` and print one line with the step and the resuming command; each chain of interruptions, resumed
with that command, ends equal to an uninterrupted run (every metrics row, every weight). A rank killed with SIGKILL
is one line naming it, exit 2. The processes' ends are checked with a generous wait (a hang guard, not a timing).
The pieces (the resume command, exit wording, the peer-failure test) are checked in-process at the end.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dflash2_lightning.errors import ReportedByAnotherRank
from dflash2_lightning.reporting import run_command
from dflash2_lightning.train.launcher import describe_exit, is_peer_failure, peer_failure_words, stop_signal_of
from dflash2_lightning.train.preemption import STOP, FitInterrupted, resume_command

REPO = Path(__file__).resolve().parents[2]
DFLASH2 = Path(sys.executable).parent / "dflash2"
STEPS = 12
EVERY = 4  # validation and last.ckpt every EVERY steps: a validation is due after steps 4 and 8
HANG_GUARD_S = 60  # every process must be gone within this after the signal (it takes a few seconds)
FIT_TIMEOUT_S = 600


# ---------------------------------------------------------------------------------------------- running fits
def write_config(directory: Path, devices: int) -> Path:
    """The tiny config at STEPS steps, on ``devices`` CPU processes (DDP over gloo for 2), with the tests' inert
    helpers: pauses (preemption_helpers), a stalling validation and checkpoint writer (kill_helpers)."""
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(
        max_steps=STEPS,
        val_check_interval=EVERY,
        limit_val_batches=1,
        log_every_n_steps=1,
        enable_progress_bar=False,
        devices=devices,
        plugins=[{"class_path": "kill_helpers.StallingCheckpointIO"}],
    )
    if devices > 1:
        trainer["strategy"] = {
            "class_path": "lightning.pytorch.strategies.DDPStrategy",
            "init_args": {"process_group_backend": "gloo"},
        }
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = str(directory / "runs")
    trainer["logger"][0]["init_args"]["flush_logs_every_n_steps"] = 1
    trainer["callbacks"][0]["init_args"]["every_n_train_steps"] = EVERY
    trainer["callbacks"] += [
        {"class_path": "preemption_helpers.PauseAtStep"},
        {"class_path": "preemption_helpers.PauseInSetup"},
        {"class_path": "kill_helpers.StallingValidation"},
    ]
    config["data"]["init_args"]["max_samples"] = 64
    config["model"]["init_args"]["export"] = {"acceptance_prompts": 0}
    path = directory / "fit.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def environment(directory: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("DFLASH2_TEST_", "SLURM_")) and k != "DFLASH2_DEBUG"
    }
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "DFLASH2_CACHE": str(directory / "cache"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def child_processes(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


class Fit:
    """One ``dflash2 fit`` of ``work``'s config in its own session: its processes, its pauses, how it ended."""

    def __init__(self, work: Path, *extra: str, ranks: int = 1, **env: str) -> None:
        if not DFLASH2.exists():
            pytest.fail(f"{DFLASH2} not found: install the package first (pip install -e .)")
        self.work, self.ranks = work, ranks
        self.mark, self.release_file = work / "paused", work / "release"
        for old in [*work.glob("paused*"), self.release_file, work / "validating", work / "writing"]:
            old.unlink(missing_ok=True)
        env = {"DFLASH2_TEST_PAUSE_MARK": str(self.mark), "DFLASH2_TEST_PAUSE_RELEASE": str(self.release_file), **env}
        self.command = [str(DFLASH2), "fit", "--config", str(work / "fit.yaml"), *extra]
        self.proc = subprocess.Popen(
            self.command,
            cwd=work,
            env=environment(work, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.pids: list[int] = [self.proc.pid]

    def wait_for(self, *paths: Path) -> None:
        """Wait until every path exists (the fit reached the moment), then note the child ranks' pids."""
        deadline = time.monotonic() + FIT_TIMEOUT_S
        while not all(p.exists() for p in paths):
            if self.proc.poll() is not None:
                _, err = self.proc.communicate()
                pytest.fail(f"the fit ended (exit {self.proc.returncode}) before {paths}:\n{err[-4000:]}")
            assert time.monotonic() < deadline, f"{paths} never appeared"
            time.sleep(0.02)
        self.pids = [self.proc.pid, *child_processes(self.proc.pid)]
        assert len(self.pids) == self.ranks, f"expected {self.ranks} rank processes, found {self.pids}"

    def wait_for_pause(self) -> None:
        self.wait_for(*(Path(f"{self.mark}.{rank}") for rank in range(self.ranks)))

    def send(self, signum: int, to: str = "launcher") -> None:
        """``to``: ``launcher`` (rank 0), ``child`` (rank 1) or ``all`` (the whole process group, as a scheduler)."""
        if to == "all":
            os.killpg(self.proc.pid, signum)
        else:
            os.kill(self.pids[0] if to == "launcher" else self.pids[1], signum)

    def release(self) -> None:
        self.release_file.write_text("go")

    def end(self) -> subprocess.CompletedProcess:
        """Wait for the launcher to exit and every rank process to be gone (the hang guard), then return how it
        ended."""
        try:
            out, err = self.proc.communicate(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            alive = [pid for pid in self.pids if process_running(pid)]
            os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            out, err = self.proc.communicate()
            pytest.fail(f"processes {alive} still running {HANG_GUARD_S} s after the signal:\n{err[-4000:]}")
        deadline = time.monotonic() + HANG_GUARD_S
        while any(process_running(pid) for pid in self.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in self.pids if process_running(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"rank processes {left} outlived the launcher by {HANG_GUARD_S} s"
        return subprocess.CompletedProcess(self.command, self.proc.returncode, out, err)


def run_to_end(work: Path, *extra: str, ranks: int = 1) -> subprocess.CompletedProcess:
    fit = Fit(work, *extra, ranks=ranks)
    try:
        out, err = fit.proc.communicate(timeout=FIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(fit.proc.pid, signal.SIGKILL)
        out, err = fit.proc.communicate()
        pytest.fail(f"dflash2 fit hung for {FIT_TIMEOUT_S} s:\n{err[-4000:]}")
    assert fit.proc.returncode == 0, f"exit {fit.proc.returncode}:\n{err[-4000:]}"
    return subprocess.CompletedProcess(fit.command, 0, out, err)


def the_error_line(done: subprocess.CompletedProcess) -> str:
    """The one ``dflash2: error:`` line of a run, and nothing that reads as a bug."""
    lines = [line for line in done.stderr.splitlines() if line.startswith("dflash2: error:")]
    assert len(lines) == 1, done.stderr[-4000:]
    for bad in ("Traceback", "this is a bug", "internal error", "Received SIGTERM"):
        assert bad not in done.stderr, done.stderr[-4000:]
    return lines[0]


def run_dir(work: Path) -> Path:
    return work / "runs" / "tiny" / "default"


def checkpoint_step(work: Path) -> int:
    return torch.load(run_dir(work) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)[
        "global_step"
    ]


def assert_interrupted(done: subprocess.CompletedProcess, work: Path, signum: int, step: int) -> str:
    """Exit ``128 + signum``, one line naming the signal, the step and the command, and a checkpoint of that step."""
    assert done.returncode == 128 + signum, f"exit {done.returncode}:\n{done.stderr[-4000:]}"
    line = the_error_line(done)
    name = signal.Signals(signum).name
    resume = f"dflash2 fit --config {work / 'fit.yaml'} --ckpt_path last"
    assert line.startswith(
        f"dflash2: error: fit interrupted by {name} at step {step} of {STEPS}: "
        f"checkpoint of step {step} saved to {run_dir(work) / 'checkpoints' / 'last.ckpt'}"
    ), line
    assert line.endswith(f"; resume with: {resume}"), line
    assert checkpoint_step(work) == step
    assert not [p for p in work.rglob("*.tmp")], "a temporary file was left behind"
    return line


def metrics_rows(work: Path) -> Counter:
    with open(run_dir(work) / "metrics.csv", newline="") as f:
        return Counter(frozenset((k, v) for k, v in row.items() if v) for row in csv.DictReader(f))


def assert_same_run(work: Path, reference: Path) -> None:
    """Every metrics row (train losses, validation values, same steps, once) and every weight equal."""
    got, want = metrics_rows(work), metrics_rows(reference)

    def steps(rows: Counter) -> list[str]:
        return sorted(dict(r).get("step", "") for r in rows)

    assert got == want, f"rows missing at steps {steps(want - got)}, extra at steps {steps(got - want)}"
    a, b = (
        torch.load(run_dir(w) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
        for w in (work, reference)
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reference_run(factory: Any, name: str, ranks: int) -> Path:
    work = factory.mktemp(name)
    write_config(work, ranks)
    done = run_to_end(work, ranks=ranks)
    assert f"fit finished at step {STEPS}" in done.stdout
    return work


@pytest.fixture(scope="module")
def straight_one_rank(tmp_path_factory: Any) -> Path:
    """An uninterrupted single-process run: what every interrupted-and-resumed single-process chain must equal."""
    return reference_run(tmp_path_factory, "straight1", 1)


@pytest.fixture(scope="module")
def straight_two_ranks(tmp_path_factory: Any) -> Path:
    """An uninterrupted two-rank DDP run."""
    return reference_run(tmp_path_factory, "straight2", 2)


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.slow
def test_one_process_stopped_three_times_resumes_exactly(tmp_path: Path, straight_one_rank: Path) -> None:
    """SIGTERM while a checkpoint is being written (at a step after which a validation is due), SIGUSR1 under
    SLURM (the job is requeued), SIGTERM during a validation: each stops at a step boundary with a checkpoint of
    it; resumed each time with the printed command, the run ends equal to an uninterrupted one."""
    write_config(tmp_path, 1)
    resume = ("--ckpt_path", "last")

    # 1. SIGTERM while ModelCheckpoint writes step 4's checkpoint: that write completes, then the fit stops at
    #    that step, before the validation due after it (the resumed run runs it first).
    fit = Fit(tmp_path, DFLASH2_TEST_MARK=str(tmp_path / "writing"), DFLASH2_TEST_STALL="1")
    fit.wait_for(tmp_path / "writing")
    fit.send(signal.SIGTERM)
    assert_interrupted(fit.end(), tmp_path, signal.SIGTERM, 4)

    # 2. SIGUSR1 under SLURM (auto-requeue) during step 7: the fit stops at the end of it and requeues the job.
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    slurm = {
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NAME": "fit",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "127.0.0.1",
        "PATH": f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}",
    }
    fit = Fit(tmp_path, *resume, DFLASH2_TEST_PAUSE_AT="6", **slurm)
    fit.wait_for_pause()
    fit.send(signal.SIGUSR1)
    fit.release()
    line = assert_interrupted(fit.end(), tmp_path, signal.SIGUSR1, 7)
    assert "SLURM job 4242 requeued" in line
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]

    # 3. SIGTERM during the validation after step 8: it finishes, step 9 trains, and the fit stops there.
    fit = Fit(
        tmp_path,
        *resume,
        DFLASH2_TEST_VAL_MARK=str(tmp_path / "validating"),
        DFLASH2_TEST_VAL_STEP="8",
        DFLASH2_TEST_VAL_STALL="120",
        DFLASH2_TEST_VAL_RELEASE=str(tmp_path / "release"),
    )
    fit.wait_for(tmp_path / "validating")
    fit.send(signal.SIGTERM)
    fit.release()
    assert_interrupted(fit.end(), tmp_path, signal.SIGTERM, 9)

    done = run_to_end(tmp_path, *resume)
    assert f"fit finished at step {STEPS}" in done.stdout
    assert_same_run(tmp_path, straight_one_rank)


@pytest.mark.slow
def test_a_second_sigterm_ends_the_fit_at_once(tmp_path: Path) -> None:
    """The first SIGTERM waits for the step to end; a second one ends the process at once (here the step is held
    for 120 s), by the signal itself, saying that no checkpoint of the step was taken."""
    write_config(tmp_path, 1)
    fit = Fit(tmp_path, DFLASH2_TEST_PAUSE_AT="2")
    fit.wait_for_pause()
    fit.send(signal.SIGTERM)
    time.sleep(1)  # handled by now (two pending SIGTERMs would merge into one)
    assert fit.proc.poll() is None  # still inside step 2: the first signal only asked for a stop
    fit.send(signal.SIGTERM)
    done = fit.end()
    assert done.returncode == -signal.SIGTERM, done.stderr[-4000:]
    line = the_error_line(done)
    assert "a second signal (SIGTERM)" in line and "without a checkpoint of this step" in line, line
    assert line.endswith(f"resume with: dflash2 fit --config {tmp_path / 'fit.yaml'} --ckpt_path last"), line
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.slow
def test_sigterm_before_training_stops_at_once(tmp_path: Path) -> None:
    """During setup (here held for 120 s) there is no step to finish: the fit stops at once, saves nothing."""
    write_config(tmp_path, 1)
    fit = Fit(tmp_path, DFLASH2_TEST_SETUP_MARK=str(tmp_path / "setup"))
    fit.wait_for(tmp_path / "setup")
    fit.send(signal.SIGTERM)
    done = fit.end()
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-4000:]
    line = the_error_line(done)
    assert line.startswith("dflash2: error: fit interrupted by SIGTERM before training started"), line
    assert not list(tmp_path.rglob("*.ckpt"))


# ---------------------------------------------------------------------------------------------- two DDP ranks
@pytest.mark.slow
def test_two_ranks_stopped_every_way_resume_exactly(tmp_path: Path, straight_two_ranks: Path) -> None:
    """Two DDP ranks, interrupted five ways in a row and resumed each time with the printed command: SIGTERM to rank 0
    (the launcher), to rank 1 only, to every process (as a scheduler sends it): both ranks stop at the same step
    with its checkpoint and every process ends; SIGKILL to rank 1 while rank 0 goes on into a collective, then to
    rank 0: one line naming the rank, every process ends, the last complete checkpoint is kept. The chain ends
    equal to an uninterrupted run."""
    write_config(tmp_path, 2)
    resume = f"resume with: dflash2 fit --config {tmp_path / 'fit.yaml'} --ckpt_path last"
    for pause, to in ((1, "launcher"), (4, "child"), (6, "all")):
        fit = Fit(tmp_path, *(("--ckpt_path", "last") if pause > 1 else ()), ranks=2, DFLASH2_TEST_PAUSE_AT=str(pause))
        fit.wait_for_pause()
        fit.send(signal.SIGTERM, to=to)
        fit.release()
        assert_interrupted(fit.end(), tmp_path, signal.SIGTERM, pause + 1)

    # A dead child: rank 0's next collective fails; it names rank 1 and ends.
    fit = Fit(tmp_path, "--ckpt_path", "last", ranks=2, DFLASH2_TEST_PAUSE_AT="9")
    fit.wait_for_pause()
    fit.send(signal.SIGKILL, to="child")
    fit.release()
    done = fit.end()
    assert done.returncode == 2, done.stderr[-4000:]
    line = the_error_line(done)
    assert line.startswith(f"dflash2: error: rank 1 (pid {fit.pids[1]}) was killed by SIGKILL at step 9: "), line
    assert line.endswith(resume), line
    assert checkpoint_step(tmp_path) == 8  # ModelCheckpoint's, every 4 steps

    # A dead launcher: rank 1 sees it gone (its collective fails, or its watcher notices) and says so.
    fit = Fit(tmp_path, "--ckpt_path", "last", ranks=2, DFLASH2_TEST_PAUSE_AT="10")
    fit.wait_for_pause()
    fit.send(signal.SIGKILL, to="launcher")
    fit.release()
    done = fit.end()
    assert done.returncode == -signal.SIGKILL  # the launcher itself; rank 1 printed the line on the shared stderr
    line = the_error_line(done)
    assert line.startswith(
        f"dflash2: error: rank 0 (pid {fit.pids[0]}), the process that launched this node's ranks, died at step 10: "
    ), line
    assert line.endswith(resume), line
    assert checkpoint_step(tmp_path) == 8

    done = run_to_end(tmp_path, "--ckpt_path", "last", ranks=2)
    assert f"fit finished at step {STEPS}" in done.stdout
    assert_same_run(tmp_path, straight_two_ranks)


@pytest.mark.slow
def test_a_child_killed_while_rank_0_computes_is_reported_by_the_watcher(tmp_path: Path) -> None:
    """Rank 0 is busy (held at step 2 for 120 s, outside any collective) when rank 1 is killed: its watcher reports
    the dead rank in one line and ends the fit within seconds, instead of leaving it to a collective timeout."""
    write_config(tmp_path, 2)
    fit = Fit(tmp_path, ranks=2, DFLASH2_TEST_PAUSE_AT="2")
    fit.wait_for_pause()
    fit.send(signal.SIGKILL, to="child")
    done = fit.end()
    assert done.returncode == 2, done.stderr[-4000:]
    line = the_error_line(done)
    assert line.startswith(f"dflash2: error: rank 1 (pid {fit.pids[1]}) was killed by SIGKILL at step 2: "), line
    assert line.endswith(f"resume with: dflash2 fit --config {tmp_path / 'fit.yaml'} --ckpt_path last"), line


# ---------------------------------------------------------------------------------------------- the pieces
def test_the_resume_command_replaces_any_ckpt_path_with_last() -> None:
    assert resume_command(["fit", "--config", "a b.yaml"]) == "dflash2 fit --config 'a b.yaml' --ckpt_path last"
    assert (
        resume_command(["fit", "--ckpt_path", "x.ckpt", "--debug", "--trainer.max_steps", "5"])
        == "dflash2 fit --trainer.max_steps 5 --ckpt_path last"
    )
    assert resume_command(["fit", "--ckpt_path=last", "-c", "c.yaml"]) == "dflash2 fit -c c.yaml --ckpt_path last"


def test_an_interrupted_fit_exits_with_128_plus_the_signal_in_one_line(capsys: Any) -> None:
    def stopped(signum: int) -> Any:
        def run(_: list[str]) -> None:
            raise RuntimeError("Lightning's teardown") from FitInterrupted(
                signum,
                "dflash2 fit -c c.yaml --ckpt_path last",
                step=7,
                max_steps=10,
                checkpoint="r/last.ckpt",
                saved=True,
            )

        return run

    assert run_command(stopped(signal.SIGTERM), []) == 143
    assert run_command(stopped(signal.SIGUSR1), []) == 138
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"dflash2: error: fit interrupted by {name} at step 7 of 10: checkpoint of step 7 saved to "
        "r/last.ckpt; resume with: dflash2 fit -c c.yaml --ckpt_path last"
        for name in ("SIGTERM", "SIGUSR1")
    ]

    def quiet(_: list[str]) -> None:  # another rank of the same stop: same status, nothing printed
        raise ReportedByAnotherRank("fit interrupted", exit_status=143)

    assert run_command(quiet, []) == 143
    assert capsys.readouterr().err == ""


def test_dead_peers_and_exit_statuses_are_recognised() -> None:
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:46822: "
        "Connection reset by peer. This is typically caused by a remote worker hanging"
    )
    wrapped = ValueError("teardown")
    wrapped.__context__ = gloo
    assert is_peer_failure(gloo) and is_peer_failure(wrapped)
    assert peer_failure_words(wrapped) == "gloo: Connection reset by peer"
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(143) == "was stopped by SIGTERM (exit status 143)"
    assert describe_exit(2) == "exited with status 2"
    # A child that a stop signal ended (before training, or a second signal) is an interruption, not a death.
    assert stop_signal_of(143) == stop_signal_of(-15) == signal.SIGTERM and stop_signal_of(138) == signal.SIGUSR1
    assert stop_signal_of(-9) is None and stop_signal_of(2) is None


def test_the_stop_request_records_once_and_restores_the_handlers() -> None:
    """Under a fit's handlers a first SIGTERM during training is only recorded; before training it raises; the
    handlers a caller had are back afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    with STOP.watching("dflash2 fit --ckpt_path last"):
        assert signal.getsignal(signal.SIGTERM) == STOP.handle
        with pytest.raises(FitInterrupted, match="before training started"):
            STOP.handle(signal.SIGTERM, None)
        STOP.reset()
        STOP.phase = STOP.TRAINING
        STOP.handle(signal.SIGUSR1, None)
        assert STOP.signum == signal.SIGUSR1
    assert signal.getsignal(signal.SIGTERM) == before
    STOP.reset()
