"""What vLLM, SGLang and llama.cpp need from a draft, checked when it is written and by ``dflash2 check``.

The facts come from reading the engines' released code (vLLM 0.33.0, SGLang 0.5.23, llama.cpp's DFlash2
runtime): the draft's **dtype** (vLLM runs it in the target's; SGLang's ``--dtype auto`` turns float32 into
float16 beside bf16 target states, so the export defaults to the target's dtype, :func:`choose_export_dtype`),
the **block size** each engine is told by hand or reads (:func:`served_block_flags`, :func:`served_block_sizes`:
a smaller value serves the draft at a smaller block), SGLang's power-of-two **selector top-k** (its CUDA walk uses
``tl.arange(0, top_k)``), and the **target fit** (hidden size, vocabulary, depth, RoPE base, ``<|MASK|>`` id).

A :class:`Finding` is an ``error`` (the engine refuses it or serves it wrong), a ``warning`` (it breaks or
silently degrades in one engine) or a ``note`` (a fact the serving command must honour). Export never fails on
them: a finished training run is always written; the findings are printed and put into ``SERVING.md``, and
``dflash2 check`` exits 1 on an error. :func:`serving_commands` are the command lines that serve a draft in each
engine (``SERVING.md``'s, and the ones ``dflash2 check-serving`` recommends). Each rule for users:
docs/checkpoint-contract.md ("Serving checks").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from shlex import quote
from types import SimpleNamespace
from typing import Any, Literal

from dflash2_lightning.config import DraftConfig, rope_theta_of

VLLM = "vLLM 0.33"
SGLANG = "SGLang 0.5.23"
LLAMA_CPP = "llama.cpp"
ALL = "all engines"
SGLANG_MASK_TOKEN = "<|MASK|>"  # SGLang's default dflash_config.mask_token, looked up in the target vocab
SERVED_DTYPES = ("bfloat16", "float16", "float32")

Level = Literal["error", "warning", "note"]


@dataclass(frozen=True)
class Finding:
    """One engine fact about a draft: what is wrong or must be honoured, in which engine, and the fix."""

    level: Level
    engine: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.level}: [{self.engine}] {self.message}" + (f" Fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class TargetInfo:
    """What the checks compare a draft against: the target's served geometry and where it lives.

    Every field may be unknown (``None``): a check that needs it is then skipped, not guessed.
    """

    path: str | None = None  # the HF directory vLLM / SGLang serve
    gguf: str | None = None  # the GGUF file llama.cpp serves
    dtype: str | None = None  # the dtype its checkpoint declares (what ``--dtype auto`` serves)
    loaded_dtype: str | None = None  # the dtype training loaded it in (used when it declares none)
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    rope_theta: float | None = None
    mask_token_vocab_id: int | None = None  # id of ``<|MASK|>`` in its tokenizer, if it has one
    tiny: bool = False  # a tiny random test target: nothing to serve

    @classmethod
    def from_dir(cls, directory: str | Path) -> TargetInfo:
        """Read a local HF model directory's ``config.json`` (and ``tokenizer.json``), not its weights."""
        from dflash2_lightning.target.hf_config import read_config_json

        directory = Path(directory).expanduser()
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(
                f"--target {directory}: no config.json there (give the target's local Hugging Face model directory)"
            )
        data = read_config_json(directory)
        nested = data.get("text_config")
        text: dict[str, Any] = nested if isinstance(nested, dict) else data
        return cls(
            path=str(directory.resolve()),
            dtype=_declared_dtype(data) or _declared_dtype(text),
            num_layers=text.get("num_hidden_layers"),
            hidden_size=text.get("hidden_size"),
            vocab_size=text.get("vocab_size"),
            rope_theta=rope_theta_of(SimpleNamespace(**text)),
            mask_token_vocab_id=_vocab_id(directory / "tokenizer.json", SGLANG_MASK_TOKEN),
        )

    @classmethod
    def from_target(cls, target: Any) -> TargetInfo:
        """From a loaded :class:`~dflash2_lightning.target.target.Target` (what ``fit`` trained against)."""
        spec = target.spec
        loaded = str(target.dtype).removeprefix("torch.")
        vocab = target.tokenizer.get_vocab() if hasattr(target.tokenizer, "get_vocab") else {}
        common = dict(
            loaded_dtype=loaded,
            num_layers=target.num_layers,
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            rope_theta=target.rope_theta,
            mask_token_vocab_id=vocab.get(SGLANG_MASK_TOKEN),
        )
        if spec is None or spec.tiny is not None:
            return cls(tiny=spec is not None, **common)
        if spec.path is not None:
            directory = Path(spec.path).expanduser().resolve()
            data = json.loads((directory / "config.json").read_text())
            return cls(path=str(directory), dtype=_declared_dtype(data), **common)
        from dflash2_lightning.target.gguf import resolve_gguf

        return cls(gguf=str(resolve_gguf(spec.gguf).resolve()), **common)

    @property
    def serving_dtype(self) -> str | None:
        """The dtype an engine runs this target in by default: the declared one, else the loaded one."""
        return self.dtype or self.loaded_dtype

    @property
    def described(self) -> str:
        where = self.path or self.gguf or ("a tiny random test target" if self.tiny else "the target")
        return where


def llama_cpp_max_top_k(hidden_size: int) -> int:
    """The largest ``selector_top_k`` llama.cpp's selector lattice takes at ``hidden_size`` (k * (k + 1) <= H)."""
    k = 1
    while (k + 1) * (k + 2) <= hidden_size:
        k += 1
    return k


def served_block_sizes(cfg: DraftConfig) -> list[int]:
    """The block sizes a draft trained at ``cfg.block_size`` can be served at: 2 (the anchor and one draft) up
    to the trained size, and never fewer positions than the convolution's taps (``conv_kernel_size``)."""
    smallest = max(2, cfg.conv_kernel_size if cfg.is_dflash2 else 2)
    return list(range(smallest, cfg.block_size + 1))


def served_block_flags(block_size: int) -> dict[str, str]:
    """What sets the served block (anchor included) in each engine: vLLM's ``num_speculative_tokens`` (drafts,
    ``block_size - 1``), SGLang's ``--speculative-num-draft-tokens`` (``block_size``, it counts the anchor) and
    llama.cpp's ``--spec-draft-n-max`` (drafts, ``block_size - 1``; its block is ``n_max + 1`` tokens)."""
    n = block_size - 1
    return {
        VLLM: f'"num_speculative_tokens": {n}',
        SGLANG: f"--speculative-num-draft-tokens {block_size}",
        LLAMA_CPP: f"--spec-draft-n-max {n}",
    }


def choose_export_dtype(requested: str | None, target: TargetInfo | None) -> tuple[str, str]:
    """The dtype to export a draft in, and why (one sentence, printed at export and kept in SERVING.md).

    Default: the target's dtype (what its checkpoint declares; else what it was loaded in), because the
    engines run the draft beside the target: a float32 draft next to a bf16 target is wrong in SGLang,
    whose ``--dtype auto`` makes it float16 while ``fc`` receives bf16 hidden states. ``requested`` wins.
    """
    target_dtype = target.serving_dtype if target is not None else None
    if target_dtype not in SERVED_DTYPES:
        target_dtype = None
    if requested is not None:
        why = "as requested (export_dtype)"
        if target_dtype is not None and target_dtype != requested:
            why += f"; the target is {target_dtype}, which the engines will run the draft in (or fail)"
        return requested, why
    if target_dtype is None:
        return "float32", "the target's dtype is unknown"
    source = (
        "its config.json declares it"
        if target is not None and target.dtype == target_dtype
        else "the dtype it was loaded in; its checkpoint declares none"
    )
    return target_dtype, (
        f"the target's dtype ({source}), not the training dtype: the engines run the draft "
        "beside the target; set export_dtype to override"
    )


def engine_findings(
    cfg: DraftConfig, target: TargetInfo | None = None, raw: dict[str, Any] | None = None
) -> list[Finding]:
    """Every engine fact about ``cfg`` (optionally against ``target`` and the raw ``config.json``)."""
    found: list[Finding] = []
    n = cfg.block_size - 1
    found.append(
        Finding(
            "note",
            VLLM,
            f"vLLM never reads block_size={cfg.block_size}: it sizes the query block and the "
            f"convolution from 1 + num_speculative_tokens: {n} serves the trained block, a smaller value a "
            "smaller block (measure it first: dflash2 eval --served-block-sizes), a larger one runs the draft "
            'off its training layout silently. It also needs "method": "dflash" (guessed only when the path contains '
            "'dflash') and Model Runner V2 (the default; do not set VLLM_USE_V2_MODEL_RUNNER=0).",
            f'--speculative-config \'{{"method": "dflash", "num_speculative_tokens": {n}, ...}}\'',
        )
    )
    found.append(
        Finding(
            "note",
            SGLANG,
            f"SGLang reads the draft-token count from dflash_config.block_size={cfg.block_size} "
            "(it counts the anchor); an override re-sizes the block and the convolution with only a warning "
            "(a smaller one serves a smaller block: measure it first with dflash2 eval --served-block-sizes).",
            f"omit --speculative-num-draft-tokens or pass {cfg.block_size}",
        )
    )
    if cfg.is_dflash2 and cfg.selector_top_k & (cfg.selector_top_k - 1):
        up = 1 << (cfg.selector_top_k - 1).bit_length()
        found.append(
            Finding(
                "warning",
                SGLANG,
                f"selector_top_k={cfg.selector_top_k} is not a power of two: SGLang's CUDA "
                "selector-walk kernel uses tl.arange(0, top_k) and fails to compile (vLLM and llama.cpp pad).",
                f"retrain with selector_top_k={up} or {up >> 1} to serve with SGLang",
            )
        )
    if cfg.is_dflash2 and cfg.hidden_size < cfg.selector_top_k * (cfg.selector_top_k + 1):
        fits = llama_cpp_max_top_k(cfg.hidden_size)
        found.append(
            Finding(
                "warning",
                LLAMA_CPP,
                f"selector_top_k={cfg.selector_top_k} is too large for llama.cpp at hidden_size "
                f"{cfg.hidden_size}: its selector lattice needs hidden_size >= top_k * (top_k + 1) = "
                f"{cfg.selector_top_k * (cfg.selector_top_k + 1)}, so dflash2 export-gguf refuses this draft.",
                f"retrain with selector_top_k <= {fits} to serve it with llama.cpp",
            )
        )
    found += _dtype_findings(cfg, target)
    if raw is not None:
        found += _raw_config_findings(cfg, raw)
    if target is not None:
        found += _target_findings(cfg, target)
    return found


def _dtype_findings(cfg: DraftConfig, target: TargetInfo | None) -> list[Finding]:
    dtype = cfg.torch_dtype
    if dtype not in SERVED_DTYPES:
        return [
            Finding(
                "warning",
                ALL,
                f"torch_dtype={dtype}: vLLM and SGLang serve bfloat16, float16 or float32 drafts only.",
                "re-export in the target's dtype (dflash2 check --target shows it)",
            )
        ]
    target_dtype = target.serving_dtype if target is not None else None
    if target_dtype in SERVED_DTYPES and target_dtype != dtype:
        return [
            Finding(
                "warning",
                ALL,
                f"the draft is {dtype} but the target is {target_dtype}: vLLM runs the "
                f"draft in {target_dtype} anyway; SGLang with --dtype auto runs it in "
                f"{'float16' if dtype == 'float32' else dtype} and feeds fc {target_dtype} hidden "
                "states without a cast.",
                f"re-export with export_dtype={target_dtype}, or serve both with --dtype {target_dtype}",
            )
        ]
    if dtype == "float32" and target_dtype is None:
        return [
            Finding(
                "warning",
                SGLANG,
                "the draft is float32: SGLang's --dtype auto serves it as float16, "
                "and a bf16 target then feeds fc bf16 hidden states without a cast.",
                "pass --dtype <the target's dtype> to SGLang, or re-export in the target's dtype",
            )
        ]
    return []


def _raw_config_findings(cfg: DraftConfig, raw: dict[str, Any]) -> list[Finding]:
    """Facts only the raw config.json shows (checkpoints this project did not write)."""
    found = []
    layer_types = raw.get("layer_types") or []
    if (
        "is_causal" not in raw
        and "causal" not in (raw.get("dflash_config") or {})
        and any(t == "sliding_attention" for t in layer_types)
    ):
        found.append(
            Finding(
                "warning",
                VLLM,
                "layer_types has sliding_attention layers and config.json sets "
                "neither is_causal nor dflash_config.causal: vLLM serves those layers causal, "
                "while DFlash drafts are non-causal inside the block.",
                'add "is_causal": false to config.json',
            )
        )
    if raw.get("num_target_layers") is None:
        found.append(
            Finding(
                "note",
                ALL,
                "config.json does not record num_target_layers, so the bound "
                f"max(target_layer_ids)={max(cfg.target_layer_ids or [0])} <= num_target_layers - 2 "
                "could not be checked.",
                "run dflash2 check --target <target dir>",
            )
        )
    return found


def _target_findings(cfg: DraftConfig, target: TargetInfo) -> list[Finding]:
    found = []

    def mismatch(field: str, draft: Any, real: Any, why: str, fix: str) -> None:
        if real is not None and draft != real:
            found.append(Finding("error", ALL, f"{field}={draft} but the target has {real}: {why}", fix))

    mismatch(
        "hidden_size",
        cfg.hidden_size,
        target.hidden_size,
        "the draft reads the target's hidden states, embedding and head, so it cannot load beside it.",
        "train the draft for this target",
    )
    mismatch(
        "vocab_size",
        cfg.vocab_size,
        target.vocab_size,
        "vLLM then expects a draft-to-target vocabulary map this draft does not have, and the selector's "
        "codebooks index the target vocabulary.",
        "train the draft for this target",
    )
    mismatch(
        "num_target_layers",
        cfg.num_target_layers,
        target.num_layers,
        "target_layer_ids were chosen for another depth (another target?).",
        "train the draft for this target",
    )
    if target.num_layers is not None and max(cfg.target_layer_ids or [0]) > target.num_layers - 2:
        found.append(
            Finding(
                "error",
                ALL,
                f"target_layer_ids={cfg.target_layer_ids} reach past layer "
                f"{target.num_layers - 2} of this {target.num_layers}-layer target (SGLang never "
                "captures the last layer; vLLM hands over its pre-norm residual).",
                "train the draft for this target",
            )
        )
    if target.rope_theta is not None and abs(cfg.rope_theta - target.rope_theta) > 1e-6 * target.rope_theta:
        found.append(
            Finding(
                "warning",
                ALL,
                f"rope_theta={cfg.rope_theta:g} but the target's RoPE base is "
                f"{target.rope_theta:g}: context positions are rotated differently than in training.",
                f"set rope_theta to {target.rope_theta:g} in config.json if the draft was trained "
                "with the target's base; else retrain",
            )
        )
    if target.mask_token_vocab_id is not None and target.mask_token_vocab_id != cfg.mask_token_id:
        found.append(
            Finding(
                "error",
                SGLANG,
                f"mask_token_id={cfg.mask_token_id} but the target tokenizer's "
                f"{SGLANG_MASK_TOKEN} is id {target.mask_token_vocab_id}: SGLang refuses to load it.",
                f"train with mask_token_id={target.mask_token_vocab_id}",
            )
        )
    return found


def _declared_dtype(config: dict[str, Any]) -> str | None:
    value = config.get("torch_dtype") or config.get("dtype")
    return str(value).removeprefix("torch.") if value else None


def _vocab_id(tokenizer_json: Path, token: str) -> int | None:
    """The id of ``token`` in a ``tokenizer.json`` (added tokens first), without loading a tokenizer."""
    if not tokenizer_json.is_file():
        return None
    data = json.loads(tokenizer_json.read_text())
    for added in data.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    vocab = (data.get("model") or {}).get("vocab")
    return int(vocab[token]) if isinstance(vocab, dict) and token in vocab else None


def serving_commands(
    block_size: int, dtype: str, draft_dir: str | os.PathLike, target: TargetInfo | None = None
) -> dict[str, list[str]]:
    """The exact serving command lines SERVING.md recommends for a draft of ``block_size`` stored in ``dtype``,
    per engine (``VLLM``, ``SGLANG``, ``LLAMA_CPP``): ``num_speculative_tokens = block_size - 1`` for vLLM,
    the draft-token count ``block_size`` for SGLang, ``--spec-draft-n-max block_size - 1`` for llama.cpp."""
    draft = str(Path(draft_dir).resolve())
    n, bs = block_size - 1, block_size
    target = target or TargetInfo()
    # Both GPU engines should run draft and target in the target's dtype (vLLM does it anyway).
    served = next((d for d in (target.serving_dtype, dtype) if d in SERVED_DTYPES), "auto")
    hf_target = target.path or "TARGET"
    return {
        VLLM: [
            f"vllm serve {quote(hf_target)} --dtype {served} \\",
            "  --speculative-config "
            + quote(json.dumps({"method": "dflash", "model": draft, "num_speculative_tokens": n})),
        ],
        SGLANG: [
            f"python -m sglang.launch_server --model-path {quote(hf_target)} --dtype {served} \\",
            f"  --speculative-algorithm DFLASH --speculative-draft-model-path {quote(draft)} \\",
            f"  --speculative-num-draft-tokens {bs}",
        ],
        LLAMA_CPP: [
            f"dflash2 export-gguf --draft {quote(draft)} "
            f"--target {quote(target.path or target.gguf or 'TARGET')} --out draft.gguf",
            f"llama-server -m {quote(target.gguf or 'target.gguf')} -md draft.gguf --spec-type draft-dflash "
            f"--spec-draft-n-max {n} --metrics",
        ],
    }
