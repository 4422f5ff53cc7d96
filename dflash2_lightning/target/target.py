"""The frozen target model with its tokenizer: the teacher and feature source of a draft.

The draft uses the target's ``embed_tokens`` and ``lm_head`` through :meth:`Target.embed` and
:meth:`Target.head`; they are frozen and never trained by the draft. :func:`~dflash2_lightning.target.load.load_target`
builds one per spec, from a local HF directory, a GGUF file or a tiny random model.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from dflash2_lightning.config import DraftConfig, default_target_layer_ids, rope_theta_of
from dflash2_lightning.errors import ConfigError
from dflash2_lightning.target.capture import capture_features
from dflash2_lightning.target.cpu_linear import CpuLinears, declare_rows, install_cpu_linears
from dflash2_lightning.target.shard import full_tensor, whole_copy
from dflash2_lightning.target.spec import TargetError, TargetSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Logits elements computed at once by :meth:`Target.greedy_at` (2**26: 128 MiB in bf16, 256 MiB in float32).
GREEDY_CHUNK_ELEMENTS = 2**26
# Config fields of HF models whose logits are more than ``lm_head(last hidden state)`` (soft-capping, scaling).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class TargetOutput(NamedTuple):
    """What the target computes for the draft: features ``[B,S,n_t*H]`` and logits ``[B,S,V]`` (or None);
    ``last_hidden [B,S,H]``: the final (normed) hidden state the head reads, when asked for."""

    features: torch.Tensor
    logits: torch.Tensor | None
    last_hidden: torch.Tensor | None = None


def _weight_of(module: nn.Module, what: str) -> torch.Tensor:
    """``module.weight`` of the target's ``what`` (its embedding or head), refused in one line where it is not a
    tensor (a module whose computation is more than a weight matrix)."""
    weight = getattr(module, "weight", None)  # not module.weight: an AttributeError in a property reads as no property
    if not isinstance(weight, torch.Tensor):
        raise TargetError(
            f"the target's {what} ({type(module).__name__}) has no weight tensor: "
            "use a target whose embedding and head are plain weight matrices"
        )
    return weight


class Target(nn.Module):
    """A frozen causal LM with its tokenizer: the teacher and feature source of a draft.

    Always in eval mode (``train()`` is a no-op) with ``requires_grad=False`` on every parameter, so
    putting it inside a LightningModule neither trains it nor turns its dropout on. Its plain linears
    take the few-row kernels of ``spec.cpu_linear`` on a CPU (:attr:`cpu_linears`,
    :mod:`dflash2_lightning.target.cpu_linear`); :meth:`prepare_verification` declares a speculative
    loop's row counts.

    A sharded target (``spec.shard == "fsdp"``, :mod:`dflash2_lightning.target.shard`) is made by every process of
    the job together: its :meth:`features` are a collective, while :meth:`embed`, :meth:`head` and
    :meth:`greedy_at` use whole copies of the embedding and head made here, so the draft's calls stay local. Its
    linears keep the stock kernels (the few-row ones would replace modules the shards belong to).
    """

    def __init__(self, hf: PreTrainedModel, tokenizer: Any, spec: TargetSpec | None = None) -> None:
        super().__init__()
        self.hf = hf
        self.tokenizer = tokenizer
        self.spec = spec
        self.sharded = spec is not None and spec.shard == "fsdp"
        self.hf.requires_grad_(False)
        if self.sharded:
            self.cpu_linears: CpuLinears = CpuLinears("stock")
            # Whole copies, made once by every process together; registered so that .to() moves them.
            self.whole_embedding: nn.Module | None = whole_copy(self.hf.get_input_embeddings())
            self.whole_head: nn.Module | None = whole_copy(
                self.hf.get_output_embeddings(), tied_to=self.tied_embedding_weight()
            )
            self.fingerprint()  # a collective too (every parameter gathered): now, while every process is here
        else:
            self.cpu_linears = install_cpu_linears(self.hf, spec.cpu_linear if spec is not None else "auto")
            self.whole_embedding = self.whole_head = None
        self.verify_block_sizes: set[int] = set()
        super().train(False)

    def train(self, mode: bool = True) -> Target:
        """Frozen: stays in eval mode whatever the parent module asks."""
        return super().train(False)

    # ------------------------------------------------------------------ geometry
    def tied_embedding_weight(self) -> torch.Tensor | None:
        """The whole embedding's weight when the target's head is its embedding (``tie_word_embeddings``), so the
        whole head reuses it instead of a second vocabulary x hidden copy; None otherwise. (FSDP2 holds the sharded
        head and embedding as two parameters with equal values: the tie is one tensor only in the whole model.)"""
        if self.whole_embedding is None or not getattr(self.config.get_text_config(), "tie_word_embeddings", False):
            return None
        return _weight_of(self.whole_embedding, "embedding")

    def input_embeddings(self) -> nn.Module:
        """The target's token embedding as the draft calls it: whole on every process, also when sharded."""
        return self.whole_embedding if self.whole_embedding is not None else self.hf.get_input_embeddings()

    def output_embeddings(self) -> nn.Module:
        """The target's head as the draft calls it: whole on every process, also when sharded."""
        return self.whole_head if self.whole_head is not None else self.hf.get_output_embeddings()

    def embedding_weight(self) -> torch.Tensor:
        """The weight of :meth:`input_embeddings` (vocabulary x hidden), refused in one line if it is no tensor."""
        return _weight_of(self.input_embeddings(), "embedding")

    def head_weight(self) -> torch.Tensor:
        """The weight of :meth:`output_embeddings` (vocabulary x hidden), refused in one line if it is no tensor."""
        return _weight_of(self.output_embeddings(), "head")

    def head_bias(self) -> torch.Tensor | None:
        """The bias of :meth:`output_embeddings` (None without one), refused in one line if it is no tensor."""
        head = self.output_embeddings()
        bias = getattr(head, "bias", None)
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TargetError(
                f"the target's head ({type(head).__name__}) has a bias that is no tensor: use a target whose head is a plain linear layer"
            )
        return bias

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
        return int(self.embedding_weight().shape[0])

    @property
    def context_length(self) -> int | None:
        """The most positions the target was built for (``max_position_embeddings``; None if it does not say)."""
        return context_length_of_config(self.config)

    @property
    def rope_theta(self) -> float:
        return rope_theta_of(self.config)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads)

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_weight().dtype

    @property
    def device(self) -> torch.device:
        return self.embedding_weight().device

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the tokenizer's eos plus the generation config's."""
        ids: list[int] = []
        candidates: list[Any] = [self.tokenizer.eos_token_id]
        gen = getattr(self.hf, "generation_config", None)
        candidates.append(getattr(gen, "eos_token_id", None))
        candidates.append(getattr(self.config, "eos_token_id", None))
        for c in candidates:
            for i in c if isinstance(c, (list, tuple)) else [c]:
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
        return self.input_embeddings()(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's frozen ``lm_head``: ``[..., H] -> [..., V]`` (no final norm: the draft has its own)."""
        # contiguous: a sliced view (e.g. a block's mask slots) sends the matmul down a slow batched path on CPU.
        return self.output_embeddings()(hidden.contiguous())

    def prepare_verification(self, block_size: int) -> None:
        """Get the linears ready for a speculative loop with blocks of ``block_size`` tokens: every layer may
        pack its weight for the ``block_size``-row verify pass, and the head also for the ``block_size - 1``
        drafted slots a drafter without a head of its own sends through it (lossless; once per block size)."""
        if block_size not in self.verify_block_sizes:
            declare_rows(self.hf, block_size, block_size - 1)
            self.verify_block_sizes.add(block_size)

    def check_layer_ids(self, layer_ids: list[int] | tuple[int, ...]) -> list[int]:
        """Validate feature layer ids against the target depth; return them as a list of ints."""
        ids = [int(i) for i in layer_ids]
        if not ids:
            raise ConfigError("target_layer_ids=[] is invalid: must be a non-empty list")
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(
                f"target_layer_ids={ids} is invalid: every id must be in "
                f"[0, num_layers={self.num_layers}) of the target (bad: {bad})"
            )
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
            problems.append(
                f"target_layer_ids {list(cfg.target_layer_ids or [])} outside the target's {self.num_layers} layers"
            )
        if problems:
            raise TargetError(
                f"{draft} was not trained for this target: "
                + "; ".join(problems)
                + "; pass the target the draft was trained with"
            )

    @property
    def greedy_from_hidden(self) -> bool:
        """Whether :meth:`greedy_at` gives the argmax of this target's logits: its head is a plain linear on
        the last hidden state (no soft-capping or scaling of the logits in the model's forward)."""
        head = self.output_embeddings()
        return isinstance(head, nn.Linear) and not any(getattr(self.config, k, None) for k in _LOGIT_TRANSFORMS)

    @torch.no_grad()
    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_ids: list[int] | tuple[int, ...],
        logits: bool = True,
        last_hidden: bool = False,
    ) -> TargetOutput:
        """Run the target once: ``cat([hidden_states[l + 1] for l in layer_ids], -1)`` and its logits.

        HF ``hidden_states[0]`` is the embedding output, so layer ``l``'s output is index ``l + 1``; the last
        entry is the final normed hidden state (``last_hidden=True`` returns it, for :meth:`greedy_at`).
        ``logits=False``: no logits, and the head never runs. The layers the draft reads are captured by forward
        hooks, every other hidden state is freed as the forward goes, and the forward stops once nothing more is
        needed (:mod:`dflash2_lightning.target.capture`); the result equals the ``output_hidden_states`` path's
        bit for bit. ``no_grad`` rather than ``inference_mode``: the draft's ``fc`` saves these features for
        backward.
        """
        ids = self.check_layer_ids(layer_ids)
        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.long)
        out = capture_features(self.hf, input_ids, attention_mask, ids, logits=logits, last_hidden=last_hidden)
        return TargetOutput(features=out.features, logits=out.logits, last_hidden=out.last_hidden)

    @torch.no_grad()
    def greedy_at(
        self, last_hidden: torch.Tensor, rows: torch.Tensor, chunk_elements: int = GREEDY_CHUNK_ELEMENTS
    ) -> torch.Tensor:
        """The target's greedy next token ``[B, S]`` at the flat positions ``rows`` (indices into ``B * S``),
        -1 elsewhere, from ``last_hidden [B, S, H]`` (:meth:`features` with ``last_hidden=True``).

        The head runs on those rows only, ``chunk_elements // V`` rows at a time, so the ``[B, S, V]`` logits
        are never formed; each row's logits, and so its argmax (first maximum, like
        ``logits.max(-1).indices``), are the full head's. Only for a target with :attr:`greedy_from_hidden`.
        """
        head = self.output_embeddings()
        if not isinstance(head, nn.Linear):
            raise TypeError(f"greedy_at needs a plain linear head (greedy_from_hidden), not {type(head).__name__}")
        b, s, h = last_hidden.shape
        flat = last_hidden.reshape(b * s, h)
        greedy = torch.full((b * s,), -1, dtype=torch.long, device=last_hidden.device)
        step = max(1, chunk_elements // head.out_features)
        for lo in range(0, rows.shape[0], step):
            r = rows[lo : lo + step]
            # F.linear, not the module: a CPU FewRowLinear would pick a few-row kernel for a short chunk.
            greedy[r] = torch.nn.functional.linear(flat[r], head.weight, head.bias).max(-1).indices
        return greedy.view(b, s)

    def draft_config(self, **overrides: Any) -> DraftConfig:
        """A :class:`DraftConfig` whose geometry comes from this target; any override wins.

        Taken from the target: hidden size, vocabulary (embedding rows), heads, KV heads, head dim,
        intermediate size, RoPE base, RMSNorm eps, depth (``num_target_layers``), max positions and the
        mask token (:attr:`mask_token_id`). ``target_layer_ids`` default to the DFlash rule for
        ``num_hidden_layers`` draft layers.
        """
        cfg = self.config
        geometry: dict[str, Any] = dict(
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            num_target_layers=self.num_layers,
            num_attention_heads=int(cfg.num_attention_heads),
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
            head_dim=self.head_dim,
            intermediate_size=int(cfg.intermediate_size),
            rope_theta=self.rope_theta,
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
        offline feature-cache manifests and in training checkpoints. Computed once per target (its weights
        are frozen); a sharded target's is computed at load, every parameter gathered whole, and equals the
        unsharded target's.
        """
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            cached = self._compute_fingerprint()
            self.__dict__["_fingerprint"] = cached
        return cached

    def describe(self, fingerprint: bool = True) -> dict[str, Any]:
        """What a checkpoint records of the target it was trained against: the spec, geometry, fingerprint
        (left out with ``fingerprint=False``: for a target whose weights are not loaded, only its geometry)."""
        record = {
            "spec": json.loads(self.spec.key()) if self.spec is not None else None,
            "geometry": {
                "hidden_size": self.hidden_size,
                "num_layers": self.num_layers,
                "vocab_size": self.vocab_size,
                "context_length": self.context_length,
            },
        }
        if fingerprint:
            record["fingerprint"] = self.fingerprint()
        return record

    def _compute_fingerprint(self) -> str:
        # Where the config was loaded from and the library version do not change the model; nor do the
        # entries save_pretrained fills in (architectures, dtype: each tensor's dtype is hashed below), so a
        # target hashes the same before and after it is saved, and as its saved copy.
        cfg = {
            k: v
            for k, v in self.config.to_dict().items()
            if not k.startswith("_")
            and k not in ("transformers_version", "architectures", "dtype", "torch_dtype", "distributed_config")
        }
        h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
        for name, p in self.hf.state_dict().items():
            flat = full_tensor(p.detach()).reshape(-1)
            h.update(f"{name}{tuple(p.shape)}{p.dtype}{flat.double().sum().item():.10e}".encode())
            h.update(flat[:64].float().cpu().numpy().tobytes())
        h.update(tokenizer_fingerprint(self.tokenizer).encode())
        return h.hexdigest()[:16]


def context_length_of_config(config: Any) -> int | None:
    """``max_position_embeddings`` of an HF config (object or dict), or None when it does not say."""
    value = (
        config.get("max_position_embeddings")
        if isinstance(config, dict)
        else getattr(config, "max_position_embeddings", None)
    )
    return int(value) if value else None


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (16 hex) of a tokenizer's full definition, special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
    h.update(repr(sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:16]
