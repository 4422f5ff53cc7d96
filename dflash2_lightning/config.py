"""`DraftConfig`: the draft's geometry and DFlash2 fields, validated at construction.

The same object round-trips through the HF ``config.json`` that vLLM and SGLang serve
(``to_hf_dict`` / ``from_hf_dict``). Every validation error names the field, the value and
the bound, so a bad YAML fails at start-up instead of deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

ProjectorType = Literal["dflash2", "dflash"]

ARCHITECTURES: dict[str, str] = {"dflash2": "DFlash2DraftModel", "dflash": "DFlashDraftModel"}
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DEFAULT_ROPE_THETA = 1_000_000.0


class ConfigError(ValueError):
    """A configuration value is out of its allowed range (the message names field, value, bound)."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash rule for which target layers feed the draft.

    One draft layer reads the middle target layer; otherwise ``num_draft_layers`` ids are spread
    evenly from layer 1 to layer ``num_target_layers - 3`` (36 target / 5 draft -> [1, 9, 17, 25, 33]).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def rope_theta_of(hf_config: Any) -> float:
    """The real RoPE base of a transformers config.

    Transformers 5 keeps it in ``rope_parameters`` while ``rope_theta`` may show a class default;
    reading ``rope_theta`` first would export a base 100x off, so ``rope_parameters`` wins.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(hf_config, "rope_theta", None)
    return float(theta) if theta is not None else DEFAULT_ROPE_THETA


def _require(ok: bool, name: str, value: Any, bound: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: must satisfy {bound}")


@dataclass
class DraftConfig:
    """Geometry of a DFlash / DFlash2 draft.

    ``hidden_size``, ``vocab_size`` and ``rope_theta`` must equal the target's (the draft uses the
    target's embedding and head); ``target_layer_ids`` default to :func:`default_target_layer_ids`.
    ``projector_type="dflash"`` builds the DFlash baseline (no convolution, no selector).
    """

    hidden_size: int
    vocab_size: int
    num_target_layers: int
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    intermediate_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    mask_token_id: int = 0
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    sliding_window: int | None = None
    projector_type: ProjectorType = "dflash2"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 3 * self.hidden_size
        if self.target_layer_ids is None and self.num_target_layers > 0 and self.num_hidden_layers > 0:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field outside its bound."""
        for name in ("hidden_size", "vocab_size", "num_target_layers", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "block_size", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value,
                     f"an integer >= 1")
        _require(self.block_size >= 2, "block_size", self.block_size, "block_size >= 2 (anchor + at least one draft)")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 self.num_key_value_heads, f"divides num_attention_heads={self.num_attention_heads}")
        _require(self.head_dim % 2 == 0, "head_dim", self.head_dim, "an even number (RoPE rotates pairs)")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "> 0")
        _require(self.rope_theta > 0, "rope_theta", self.rope_theta, "> 0")
        _require(self.hidden_act == "silu", "hidden_act", self.hidden_act, "== 'silu' (Qwen3 MLP)")
        _require(0 <= self.mask_token_id < self.vocab_size, "mask_token_id", self.mask_token_id,
                 f"0 <= mask_token_id < vocab_size={self.vocab_size}")
        ids = self.target_layer_ids or []
        _require(len(ids) >= 1, "target_layer_ids", self.target_layer_ids, "a non-empty list")
        for i in ids:
            _require(0 <= i < self.num_target_layers, "target_layer_ids", self.target_layer_ids,
                     f"every id in [0, num_target_layers={self.num_target_layers})")
        if self.sliding_window is not None:
            _require(self.sliding_window >= self.block_size, "sliding_window", self.sliding_window,
                     f"sliding_window >= block_size={self.block_size}")
        _require(self.projector_type in ARCHITECTURES, "projector_type", self.projector_type,
                 f"one of {sorted(ARCHITECTURES)}")
        _require(self.torch_dtype in ("float32", "bfloat16", "float16", "float64"), "torch_dtype",
                 self.torch_dtype, "one of float32, bfloat16, float16, float64")
        if self.projector_type == "dflash2":
            for name in DFLASH2_FIELDS:
                value = getattr(self, name)
                _require(isinstance(value, int) and not isinstance(value, bool), name, value, "an integer")
            _require(1 <= self.conv_kernel_size <= self.block_size, "conv_kernel_size", self.conv_kernel_size,
                     f"1 <= conv_kernel_size <= block_size={self.block_size}")
            _require(self.conv_group_size >= 1 and self.hidden_size % self.conv_group_size == 0,
                     "conv_group_size", self.conv_group_size, f"divides hidden_size={self.hidden_size}")
            _require(1 <= self.selector_top_k <= self.vocab_size, "selector_top_k", self.selector_top_k,
                     f"1 <= selector_top_k <= vocab_size={self.vocab_size}")
            _require(self.selector_rank >= 1, "selector_rank", self.selector_rank, "selector_rank >= 1")

    def check_sequence_length(self, seq_len: int, name: str = "seq_len") -> None:
        """Sequences are cut into whole blocks: raise unless ``seq_len`` is a multiple of ``block_size``."""
        _require(seq_len > 0 and seq_len % self.block_size == 0, name, seq_len,
                 f"a positive multiple of block_size={self.block_size}")

    # ------------------------------------------------------------------ derived
    @property
    def is_dflash2(self) -> bool:
        return self.projector_type == "dflash2"

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.projector_type]

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids or [])

    @property
    def conv_num_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    def replace(self, **changes: Any) -> "DraftConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF config.json
    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` contract served by vLLM / SGLang (``DFlash2DraftModel``)."""
        dflash_config: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids or []),
            "block_size": self.block_size,
        }
        if self.is_dflash2:
            dflash_config["projector_type"] = "dflash2"
            for name in DFLASH2_FIELDS:
                dflash_config[name] = getattr(self, name)
        layer_type = "sliding_attention" if self.sliding_window is not None else "full_attention"
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": dflash_config,
            "is_causal": False,  # servers treat SWA layers as causal unless told otherwise
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
            "num_target_layers": self.num_target_layers,
            "layer_types": [layer_type] * self.num_hidden_layers,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
        }
        if self.sliding_window is not None:
            dflash_config.update(use_swa=True, swa_window_size=self.sliding_window, causal=False)
        out.update(self.extra)
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> "DraftConfig":
        """Read a ``config.json`` written by this project, ModelOpt, SpecForge or z-lab."""
        dflash = dict(data.get("dflash_config") or {})
        archs = data.get("architectures") or []
        if "DFlash2DraftModel" in archs or dflash.get("projector_type") == "dflash2":
            projector: ProjectorType = "dflash2"
        elif "DFlashDraftModel" in archs:
            projector = "dflash"
        else:
            raise ConfigError(f"architectures={archs!r} is invalid: must contain one of "
                              f"{sorted(ARCHITECTURES.values())}")
        for key in ("mask_token_id", "target_layer_ids"):
            if key not in dflash:
                raise ConfigError(f"dflash_config.{key} is missing from config.json")
        num_target_layers = data.get("num_target_layers")
        if num_target_layers is None:
            num_target_layers = max(dflash["target_layer_ids"]) + 1
        dtype = data.get("dtype") or data.get("torch_dtype") or "float32"
        kwargs: dict[str, Any] = dict(
            hidden_size=data["hidden_size"], vocab_size=data["vocab_size"],
            num_target_layers=int(num_target_layers), num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=data["num_attention_heads"], num_key_value_heads=data["num_key_value_heads"],
            head_dim=data.get("head_dim"), intermediate_size=data["intermediate_size"],
            rms_norm_eps=data.get("rms_norm_eps", 1e-6), rope_theta=rope_theta_of(_Attrs(data)),
            max_position_embeddings=data.get("max_position_embeddings", 32768),
            initializer_range=data.get("initializer_range", 0.02), hidden_act=data.get("hidden_act", "silu"),
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=int(dflash.get("block_size", data.get("block_size", 16))),
            target_layer_ids=list(dflash["target_layer_ids"]),
            sliding_window=data.get("sliding_window") if data.get("use_sliding_window") or dflash.get("use_swa") else None,
            projector_type=projector, torch_dtype=str(dtype).replace("torch.", ""),
        )
        if projector == "dflash2":
            for name in DFLASH2_FIELDS:
                if name not in dflash:
                    raise ConfigError(f"dflash_config.{name} is missing from config.json "
                                      f"(required by DFlash2DraftModel)")
                kwargs[name] = int(dflash[name])
        return cls(**kwargs)


class _Attrs:
    """Attribute view of a dict, so :func:`rope_theta_of` reads config.json and HF configs alike."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.__dict__.update(data)

    def __getattr__(self, name: str) -> Any:
        return None
