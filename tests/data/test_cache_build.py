"""The offline feature cache built by every rank: the same bytes as one process, one failure stops all, resumable.

Two CPU processes under ``torch.distributed`` (gloo) build through the DataModule's own hooks (``prepare_data``
then ``setup``, as Lightning calls them) and are compared file by file, manifest included, with a build by this
process alone. One thread per process: the tiny target's matmuls then round the same way everywhere.
"""

from __future__ import annotations

import json
import multiprocessing
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_ranks import file_rendezvous

from dflash2_lightning.data.cache_build import DONE, build_dir_of
from dflash2_lightning.data.datamodule import DraftDataModule
from dflash2_lightning.data.feature_cache import MANIFEST
from dflash2_lightning.data.options import OfflineOptions
from dflash2_lightning.data.ranks import PeerFailedError
from dflash2_lightning.data.records import DataError
from dflash2_lightning.errors import ReportedByAnotherRank
from dflash2_lightning.reporting import run_command
from dflash2_lightning.target.spec import TargetSpec
from dflash2_lightning.target.target import Target

RECORDS = [
    {"text": f"Sample {i}: the numbers {i}, {i + 1} and {i + 2} follow each other. " * (1 + i % 3)} for i in range(13)
]
BATCH = 2  # 10 training rows -> 5 batches, 3 validation rows -> 2 batches: 7 in all, 4 and 3 per rank
BATCHES = 7
WAIT_S = 120  # a rank that is still alive after this is stuck: the test fails instead of hanging


def write_data(directory: Path) -> str:
    path = directory / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return str(path)


def data_module(data: str, cache: Path, target: TargetSpec | None = None) -> DraftDataModule:
    return DraftDataModule(
        target or TargetSpec(tiny={}),
        train_files=[data],
        seq_len=64,
        block_size=8,
        batch_size=4,
        mode="offline",
        target_layer_ids=[1, 3],
        val_fraction=0.2,
        offline=OfflineOptions(cache_dir=str(cache), teacher_top_k=3, cache_batch_size=BATCH),
    )


class CountingFeatures:
    """Patches :meth:`Target.features` to count calls and, optionally, fail at call ``fail_at``."""

    def __init__(self, monkeypatch: Any = None, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self.calls, self.fail_at, self.error, self.real = 0, fail_at, error, Target.features
        counter = self

        def features(target: Target, *args: Any, **kwargs: Any) -> Any:
            counter.calls += 1
            if counter.calls == counter.fail_at:
                raise counter.error
            return counter.real(target, *args, **kwargs)

        if monkeypatch is not None:
            monkeypatch.setattr(Target, "features", features)
        else:
            Target.features = features  # a spawned worker: nothing to restore


def worker(
    rank: int, init: str, data: str, cache: str, out: str, fail_rank: int | None, target: TargetSpec | None
) -> None:
    """One rank of a 2-process gloo job: build the cache through the hooks; write what happened to ``out``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    counter = CountingFeatures(
        fail_at=2 if rank == fail_rank else None, error=DataError(f"injected failure on rank {rank}")
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        dm = data_module(data, Path(cache), target)
        dm.prepare_data()  # under DDP: builds nothing (Lightning runs it on one rank while the others wait)
        assert counter.calls == 0, "prepare_data computed features under torch.distributed"
        dm.setup("fit")
        result.update(ok=True, train=len(dm.train_dataset), val=len(dm.val_dataset))
    except BaseException as error:
        result.update(
            ok=False,
            kind=type(error).__name__,
            message=str(error),
            cause=type(error.__cause__).__name__,
            traceback=traceback.format_exc()[-3000:],
        )
    result["calls"] = counter.calls
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_two_ranks(
    tmp_path: Path, data: str, cache: Path, fail_rank: int | None = None, target: TargetSpec | None = None
) -> list[dict[str, Any]]:
    # The ranks meet through a file: a port picked here could be handed to another socket before rank 0 binds it.
    init = file_rendezvous(tmp_path)
    out = tmp_path / "outcome"
    out.mkdir(exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=worker, args=(r, init, data, str(cache), str(out), fail_rank, target)) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(WAIT_S)
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not stuck, f"ranks {stuck} still running after {WAIT_S} s: a rank waits forever"
    assert [p.exitcode for p in procs] == [0, 0]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def one_process_build(data: str, cache: Path, target: TargetSpec | None = None) -> DraftDataModule:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dm = data_module(data, cache, target)
        dm.prepare_data()
        dm.setup("fit")
    finally:
        torch.set_num_threads(threads)
    return dm


def contents(cache: Path) -> dict[str, bytes]:
    found = {str(f.relative_to(cache)): f.read_bytes() for f in sorted(cache.rglob("*")) if f.is_file()}
    assert MANIFEST in found and "train/features.npy" in found and "val/teacher_topk_indices.npy" in found
    return found


def assert_same_cache(cache: Path, reference: Path) -> None:
    mine, theirs = contents(cache), contents(reference)
    assert sorted(mine) == sorted(theirs)
    differ = [name for name in theirs if mine[name] != theirs[name]]
    assert not differ, f"files differ from the one-process build: {differ}"


def resume_and_compare(monkeypatch, data: str, cache: Path, reference: Path) -> tuple[DraftDataModule, int]:
    """Finish the build of ``cache``, then build ``reference`` uninterrupted and assert the two are the same bytes.
    Returns the resumed data module and how many batches the resume computed."""
    counter = CountingFeatures(monkeypatch)
    resumed = one_process_build(data, cache)
    calls = counter.calls
    monkeypatch.setattr(Target, "features", counter.real)
    one_process_build(data, reference)
    assert_same_cache(cache, reference)
    return resumed, calls


def test_two_ranks_build_the_same_bytes_as_one_process(tmp_path):
    data = write_data(tmp_path)
    reference = tmp_path / "one"
    one_process_build(data, reference)
    outcome = run_two_ranks(tmp_path, data, tmp_path / "two")
    assert all(o["ok"] for o in outcome), outcome
    assert [(o["train"], o["val"]) for o in outcome] == [(10, 3), (10, 3)]
    assert [o["calls"] for o in outcome] == [4, 3]  # batches 0, 2, 4, 6 and 1, 3, 5: each rank its own shard
    assert_same_cache(tmp_path / "two", reference)
    assert not build_dir_of(tmp_path / "two").exists()


def test_a_failure_on_one_rank_stops_both_and_the_build_resumes(tmp_path, monkeypatch):
    data = write_data(tmp_path)
    cache = tmp_path / "cache"
    outcome = run_two_ranks(tmp_path, data, cache, fail_rank=1)
    failed, reporter = outcome[1], outcome[0]
    # Rank 0 reports rank 1's error in rank 1's words; rank 1 exits quietly (the user reads one line).
    assert not reporter["ok"] and reporter["kind"] == PeerFailedError.__name__, reporter
    assert reporter["message"] == "injected failure on rank 1"
    assert not failed["ok"] and failed["kind"] == ReportedByAnotherRank.__name__, failed
    assert failed["message"] == "injected failure on rank 1" and failed["cause"] == "DataError"
    assert reporter["calls"] <= 3  # stopped at the exchange after the failed batch, not at the end of its shard
    assert not cache.exists() and not list(tmp_path.rglob(MANIFEST))  # nothing looks complete
    done = sorted(p.name for p in (build_dir_of(cache) / DONE).iterdir())
    assert done and len(done) < BATCHES, done

    # One process resumes the two ranks' build: only the missing batches, and the same bytes as an uninterrupted build.
    resumed, calls = resume_and_compare(monkeypatch, data, cache, tmp_path / "reference")
    assert calls == BATCHES - len(done)
    assert len(resumed.train_dataset) == 10 and not build_dir_of(cache).exists()


def test_an_interrupted_build_resumes_and_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    data = write_data(tmp_path)
    cache = tmp_path / "cache"
    CountingFeatures(monkeypatch, fail_at=4, error=KeyboardInterrupt("killed"))
    with pytest.raises(KeyboardInterrupt):
        one_process_build(data, cache)
    assert not cache.exists() and not list(tmp_path.rglob(MANIFEST))
    build = build_dir_of(cache)
    assert sorted(p.name for p in (build / DONE).iterdir()) == ["train.0-2", "train.2-4", "train.4-6"]

    _, calls = resume_and_compare(monkeypatch, data, cache, tmp_path / "reference")
    assert calls == BATCHES - 3  # the three finished batches were kept


def test_a_build_for_other_settings_is_discarded_not_resumed(tmp_path, monkeypatch):
    data = write_data(tmp_path)
    cache = tmp_path / "cache"
    CountingFeatures(monkeypatch, fail_at=3, error=KeyboardInterrupt("killed"))
    with pytest.raises(KeyboardInterrupt):
        one_process_build(data, cache)
    assert len(list((build_dir_of(cache) / DONE).iterdir())) == 2
    counter = CountingFeatures(monkeypatch)
    dm = data_module(data, cache)
    dm.target_layer_ids = [2]  # other features: the rows already written are not these
    dm.setup("fit")
    assert counter.calls == BATCHES
    assert json.loads((cache / MANIFEST).read_text())["target_layer_ids"] == [2]


def test_features_that_overflow_float16_are_an_error_raised_from_the_writer(tmp_path, monkeypatch):
    data = write_data(tmp_path)
    real = Target.features

    def huge(target: Target, *args: Any, **kwargs: Any) -> Any:
        out = real(target, *args, **kwargs)
        return out._replace(features=out.features * 1e6)  # beyond float16's 65504

    monkeypatch.setattr(Target, "features", huge)
    with pytest.raises(
        DataError,
        match=r"target features overflow float16 \(max \|x\| = [0-9.e+]+\); "
        r"set feature_dtype='float32'",
    ):
        one_process_build(data, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() and not list(tmp_path.rglob(MANIFEST))
    assert not list((build_dir_of(tmp_path / "cache") / DONE).iterdir())  # no batch of infinities marked done


def test_a_failure_reported_by_rank_0_is_one_line(capsys):
    """What each process of a failed build prints: rank 0 the error, the others nothing (exit 2 all the same)."""

    def fail(error: Exception):
        def command(argv: list[str]) -> None:
            raise error

        return command

    assert run_command(fail(PeerFailedError("injected failure on rank 1")), []) == 2
    assert capsys.readouterr().err == "dflash2: error: injected failure on rank 1\n"
    quiet = ReportedByAnotherRank("injected failure on rank 1")
    quiet.__cause__ = DataError("injected failure on rank 1")
    assert run_command(fail(quiet), []) == 2
    assert capsys.readouterr().err == ""
