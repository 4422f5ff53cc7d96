"""Served τ while training: every N validations, the draft as it is then, served by ``llama-server``, and the
engine's own τ logged beside the project's replay τ.

:class:`ServedTau` is a Lightning callback named in a config (``trainer.callbacks``). On each chosen validation
(rank 0; the other ranks wait for its figures and log the same), in a temporary directory: the current weights
as an HF checkpoint (:meth:`DFlash2Module.draft_from_state`) with their acceptance record
(:func:`~dflash2_lightning.evaluate.record.make_record`), the draft as a GGUF
(:func:`~dflash2_lightning.engines.draft_gguf.export_gguf`), then ``llama-server`` on 127.0.0.1 serving it,
the record's prompts sent and the engine's counters read as ``dflash2 check-serving`` reads them
(:func:`~dflash2_lightning.engines.check_serving.check_serving`); the server is stopped afterwards, also on an
error. It logs ``val/served_tau`` and its counts (and ``val/served_replay_tau`` at the trained block) and keeps
``<run dir>/served_tau/step-<N>/``.

What cannot work is refused when the fit starts, before any step, as one ``dflash2: error:`` line; a measurement
that fails later is a warning and the training goes on. Settings, metrics and refusals in full:
docs/llama-cpp.md ("Served τ while training").
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from dflash2_lightning.errors import ConfigError, UserError, check
from dflash2_lightning.reporting import describe

if TYPE_CHECKING:
    from dflash2_lightning.engines.llama_cpp import LlamaCpp
    from dflash2_lightning.train.module import DFlash2Module

#: how configs and messages name the callback
CLASS_PATH = "dflash2_lightning.evaluate.served_tau.ServedTau"
#: the run directory's folder of every served validation's server log and figures
SERVED_DIR = "served_tau"
FIGURES_NAME = "served_tau.json"
# The options as messages name them (a config's init_args of the callback).
_OPTION = "ServedTau init_args"


class ServedTau(pl.Callback):
    """Every ``every_n_validations`` validations, the draft served in ``llama-server`` beside a GGUF of the
    target, and the engine's τ logged as ``val/served_tau`` (see the module docstring).

    Args:
        every_n_validations: serve at every N-th validation (sanity checks do not count).
        prompts: held-out prompts sent to the server (the first of the shipped evaluation prompts).
        max_new_tokens: tokens generated per prompt.
        served_block_size: the block as served: llama.cpp drafts ``served_block_size - 1`` tokens per verify
            step, ``2 <= served_block_size <= block_size`` (None: the trained block).
        target_gguf: the target as llama.cpp serves it: ``"f32"`` (llama.cpp's converter on the very weights the
            project trains against, cached: the engine's τ is the replay's), ``"shipped"`` (the target's own GGUF,
            e.g. SmolLM2 Q4_1: what a llama.cpp user runs) or the path of a GGUF of the target.
        draft_outtype: storage type of the draft GGUF's matrices (``f32``, ``f16``, ``bf16``, ``q8_0``).
        threads: llama.cpp threads (generation and batch).
        port: the server's port on 127.0.0.1 (None: a free one).
        llama_cpp_cache: the cache directory holding the pinned llama.cpp build (``make llama-cpp``; None: the
            project's cache, ``$DFLASH2_CACHE`` or ``~/.cache/dflash2-lightning``).
        startup_timeout: seconds ``llama-server`` may take to load.
        request_timeout: seconds one completion may take.
    """

    def __init__(
        self,
        every_n_validations: int = 1,
        prompts: int = 4,
        max_new_tokens: int = 32,
        served_block_size: int | None = None,
        target_gguf: str = "f32",
        draft_outtype: Literal["f32", "f16", "bf16", "q8_0"] = "f32",
        threads: int = 2,
        port: int | None = None,
        llama_cpp_cache: str | None = None,
        startup_timeout: float = 300.0,
        request_timeout: float = 600.0,
    ) -> None:
        check(every_n_validations >= 1, f"{_OPTION}.every_n_validations", every_n_validations, ">= 1")
        check(prompts >= 1, f"{_OPTION}.prompts", prompts, ">= 1")
        check(max_new_tokens >= 1, f"{_OPTION}.max_new_tokens", max_new_tokens, ">= 1")
        check(
            served_block_size is None or served_block_size >= 2,
            f"{_OPTION}.served_block_size",
            served_block_size,
            ">= 2 (one token drafted per verify step)",
        )
        check(threads >= 1, f"{_OPTION}.threads", threads, ">= 1")
        check(port is None or 1 <= port <= 65535, f"{_OPTION}.port", port, "a TCP port, 1..65535")
        check(startup_timeout > 0, f"{_OPTION}.startup_timeout", startup_timeout, "> 0 seconds")
        check(request_timeout > 0, f"{_OPTION}.request_timeout", request_timeout, "> 0 seconds")
        self.every_n_validations = every_n_validations
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.served_block_size = served_block_size
        self.target_gguf = target_gguf
        self.draft_outtype = draft_outtype
        self.threads = threads
        self.port = port
        self.llama_cpp_cache = llama_cpp_cache
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.validations = 0  # validations seen (kept in checkpoints: a resumed run keeps counting)
        self._llama: LlamaCpp | None = None
        self._gguf: Path | None = None

    # ------------------------------------------------------------------ refused before the fit trains
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse now (every rank, one ``dflash2: error:`` line) what could not be served at a validation, and
        have the target's GGUF ready (rank 0 converts it once, cached)."""
        from dflash2_lightning.data.prompts import record_prompts
        from dflash2_lightning.engines.draft_gguf import check_llama_cpp_limits
        from dflash2_lightning.engines.llama_cpp import LlamaCppError, require_llama_cpp
        from dflash2_lightning.target.load import load_geometry

        if stage not in ("fit", "validate"):  # the only stages that validate
            return
        module: DFlash2Module = pl_module  # type: ignore[assignment]
        try:
            self._llama = require_llama_cpp(self.llama_cpp_cache, ("llama-server",))
        except LlamaCppError as error:
            raise ConfigError(f"served tau ({CLASS_PATH} in trainer.callbacks) needs llama-server: {error}") from None
        spec = module.target_spec
        if spec.shard != "none":
            raise ConfigError(
                f"served tau ({CLASS_PATH}) replays the draft on the target in one process, and the target is "
                f"sharded (target.shard={spec.shard!r}): take the callback out of trainer.callbacks, or use "
                "target.shard='none'"
            )
        if self.target_gguf in ("f32", "shipped") and spec.gguf is None:
            which = "the tiny random target" if spec.tiny is not None else f"the target {spec.path}"
            raise ConfigError(
                f"served tau ({CLASS_PATH}) serves a GGUF of the target, and {which} is not a GGUF: "
                f"train against a GGUF target (target: {{gguf: ...}}), or set {_OPTION}.target_gguf to the path of "
                "the GGUF llama.cpp serves this target from"
            )
        cfg = module.draft_config
        check(
            self.served_block_size is None or self.served_block_size <= cfg.block_size,
            f"{_OPTION}.served_block_size",
            self.served_block_size,
            f"<= the trained block_size={cfg.block_size}",
        )
        check_llama_cpp_limits(cfg)
        # The prompts and their token budget must fit the target's context (a tokenisation).
        record_prompts(load_geometry(spec), None, self.prompts, self.max_new_tokens, budget=f"{_OPTION}.max_new_tokens")
        try:
            import gguf  # noqa: F401  (the draft's GGUF export and the target GGUF's vocabulary check read it)
        except ModuleNotFoundError:
            raise ConfigError(
                f"served tau ({CLASS_PATH} in trainer.callbacks) exports the draft to GGUF, which needs the gguf "
                "package, not installed here: pip install 'dflash2-lightning[gguf]' (or take the callback out)"
            ) from None
        found: str | Path | None = None
        if trainer.is_global_zero:
            try:
                found = self._target_gguf(module)
            except UserError as error:
                found = str(error)
        found = trainer.strategy.broadcast(found, src=0)
        if isinstance(found, str):
            raise ConfigError(found)
        self._gguf = found

    def _target_gguf(self, module: DFlash2Module) -> Path:
        """The target's GGUF (converted once where ``f32``), with the draft's vocabulary checked against it."""
        from dflash2_lightning.engines.draft_gguf import vocab_fields
        from dflash2_lightning.engines.llama_cpp import LlamaCppError
        from dflash2_lightning.engines.target_gguf import target_gguf

        if self.target_gguf in ("f32", "shipped"):
            try:
                path = target_gguf(module.target_spec, self.target_gguf, cache_dir=self.llama_cpp_cache)
            except LlamaCppError as error:
                raise ConfigError(f"served tau ({CLASS_PATH}): no GGUF of the target: {error}") from None
        else:
            path = Path(self.target_gguf).expanduser()
            if not path.is_file():
                raise ConfigError(
                    f"{_OPTION}.target_gguf={self.target_gguf!r} is not a file: give a GGUF of the target"
                )
        try:
            tokens = next((len(v) for k, v, _, _ in vocab_fields(path) if k == "tokenizer.ggml.tokens"), None)
        except (ValueError, OSError) as error:  # gguf's reader on a file that is not one
            raise ConfigError(
                f"{_OPTION}.target_gguf {path} is not a GGUF llama.cpp reads ({error}): give a GGUF of the target"
            ) from None
        if tokens is not None and tokens != module.draft_config.vocab_size:
            raise ConfigError(
                f"{_OPTION}.target_gguf {path} holds {tokens} tokens and the draft's vocabulary "
                f"{module.draft_config.vocab_size}: it is the GGUF of another target"
            )
        return path

    # ------------------------------------------------------------------ at the chosen validations
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.validations += 1
        if self.validations % self.every_n_validations:
            return
        module: DFlash2Module = pl_module  # type: ignore[assignment]
        state = trainer.strategy.lightning_module_state_dict()  # a collective under FSDP: every rank
        log_dir = trainer.log_dir  # a collective under DDP: every rank asks
        values: dict[str, float] | None = None
        if trainer.is_global_zero:
            step_dir = Path(log_dir or trainer.default_root_dir) / SERVED_DIR / f"step-{module.global_step:06d}"
            try:
                with torch.random.fork_rng(devices=[]):  # the training's random stream stays as it was
                    values = self.measure(module, state, step_dir)
            except Exception as error:
                rank_zero_warn(
                    f"warning: [served tau] no served tau at step {module.global_step} "
                    f"({describe(error).splitlines()[0]}); the training goes on (server log in {step_dir})"
                )
        values = trainer.strategy.broadcast(values, src=0)  # the other ranks wait for rank 0's figures
        if values:
            # Identical on every rank; sync_dist only averages equal values (and keeps Lightning quiet).
            pl_module.log_dict(values, sync_dist=True)

    def measure(self, module: DFlash2Module, state: dict[str, torch.Tensor], step_dir: Path) -> dict[str, float]:
        """Serve the draft of ``state`` and read the engine's counters; the metrics to log (see the module
        docstring). Writes ``step_dir/served_tau.json`` and the server's log there."""
        from dflash2_lightning.engines.acceptance_record import write_record
        from dflash2_lightning.engines.check_serving import check_serving, verdict_lines
        from dflash2_lightning.engines.counters import LLAMA_CPP
        from dflash2_lightning.engines.draft_gguf import export_gguf
        from dflash2_lightning.engines.llama_server import serve
        from dflash2_lightning.evaluate.record import make_record
        from dflash2_lightning.files import atomic_write_text
        from dflash2_lightning.model.checkpoint import save_draft

        assert self._gguf is not None, "setup() did not run"
        step_dir.mkdir(parents=True, exist_ok=True)
        for stale in step_dir.glob("llama-server-*.log"):  # a resumed run's earlier try at this step: other weights
            stale.unlink()
        block = module.draft_config.block_size
        served_block = self.served_block_size or block
        with tempfile.TemporaryDirectory(prefix="dflash2-served-tau-") as tmp:
            hf = save_draft(module.draft_from_state(state), Path(tmp) / "hf", dtype="float32")
            record = make_record(
                hf,
                module.target,
                num_prompts=self.prompts,
                max_new_tokens=self.max_new_tokens,
                budget=f"{_OPTION}.max_new_tokens",
            )
            write_record(record, hf)
            draft = export_gguf(hf, self._gguf, Path(tmp) / f"draft-{self.draft_outtype}.gguf", self.draft_outtype)
            extra = ["--metrics", "--spec-draft-n-max", str(served_block - 1)]
            context = max(len(p["prompt_ids"]) for p in record["prompts"]) + self.max_new_tokens + 64
            with serve(
                self._gguf,
                draft,
                threads=self.threads,
                ctx_size=context,
                port=self.port,
                extra=extra,
                startup_timeout=self.startup_timeout,
                llama=self._llama,
                log_dir=step_dir,
            ) as server:
                verdict = check_serving(server.url, record, engine=LLAMA_CPP, timeout=self.request_timeout)
                log = server.log
        counts = verdict.counts
        if counts is None or counts.tau is None:
            raise RuntimeError(f"llama-server drafted nothing for the {len(record['prompts'])} prompts (see {log})")
        values = {
            "val/served_tau": counts.tau,
            "val/served_drafted": counts.drafted,
            "val/served_accepted": counts.accepted,
            "val/served_steps": counts.steps,
        }
        if served_block == block:  # the replay measures the trained block: comparable only there
            values["val/served_replay_tau"] = float(record["expected"]["tau"])
        figures: dict[str, Any] = {
            "step": module.global_step,
            "metrics": values,
            "server": {
                "target_gguf": str(self._gguf),
                "draft_outtype": self.draft_outtype,
                "served_block_size": served_block,
                "args": extra,
                "threads": self.threads,
                "log": log.name,
            },
            "check_serving": verdict.to_json(),
            "check_serving_lines": verdict_lines(verdict),
        }
        atomic_write_text(step_dir / FIGURES_NAME, json.dumps(figures, indent=1) + "\n")
        replay = f" vs replay {values['val/served_replay_tau']:.3f}" if "val/served_replay_tau" in values else ""
        rank_zero_info(
            f"served tau at step {module.global_step}: llama.cpp {counts.tau:.3f}{replay} on {len(record['prompts'])} "
            f"prompts ({int(counts.accepted)} accepted of {int(counts.drafted)} drafted, {int(counts.steps)} verify "
            f"steps, block {served_block}); {step_dir / FIGURES_NAME}"
        )
        return values

    # ------------------------------------------------------------------ resumed runs keep counting
    def state_dict(self) -> dict[str, Any]:
        return {"validations": self.validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validations = int(state_dict.get("validations", 0))
