"""`DraftConfig`: the draft's geometry and DFlash2 fields, validated at construction.

The same object round-trips through the HF ``config.json`` that vLLM and SGLang serve
(``to_hf_dict`` / ``from_hf_dict``). Every validation error names the field, the value and
the bound, so a bad YAML fails at start-up instead of deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, Literal

from dflash2_lightning.errors import ConfigError, check

__all__ = ["DraftConfig", "default_target_layer_ids", "check_target_layer_ids", "rope_theta_of"]

ProjectorType = Literal["dflash2", "dflash"]

ARCHITECTURES: dict[str, str] = {"dflash2": "DFlash2DraftModel", "dflash": "DFlashDraftModel"}
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DEFAULT_ROPE_THETA = 1_000_000.0
#: dflash_config keys the engines honour (output logit scale, softcap, embedding scale) with their no-op value.
UNSUPPORTED_SCALES: dict[str, Any] = {
    "output_multiplier": 1.0,
    "final_logit_softcapping": 0.0,
    "input_embedding_scale": 1.0,
}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash rule for which target layers feed the draft.

    One draft layer reads the middle target layer; otherwise ``num_draft_layers`` ids are spread
    evenly from layer 1 to layer ``num_target_layers - 3`` (36 target / 5 draft -> [1, 9, 17, 25, 33]).
    Shallow targets get fewer, distinct ids, never the last layer (see :func:`check_target_layer_ids`).
    """
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        span = num_target_layers - 4
        ids = [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return sorted({min(max(i, 0), max(num_target_layers - 2, 0)) for i in ids})


def check_target_layer_ids(ids: Any, num_target_layers: int) -> list[int]:
    """Raise :class:`ConfigError` unless ``ids`` are strictly increasing ints in ``0 .. num_target_layers - 2``.

    Why each rule (the serving engines, read from vLLM 0.33 and SGLang 0.5.23): both capture the target
    layers in ascending layer order and concatenate them in that order, so unsorted ids silently permute
    ``fc``'s input columns; duplicate ids fail at load; SGLang never captures the last layer, and vLLM's
    feature for it is the pre-norm residual while HF ``hidden_states[L]`` (what training saw) is post-norm.
    """
    field_name = "target_layer_ids"
    top = num_target_layers - 2
    bound = f"strictly increasing unique ints in 0 .. num_target_layers - 2 = {top}"
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ConfigError(f"{field_name}={ids!r} is invalid: must be a non-empty list of {bound}")
    if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise ConfigError(f"{field_name}={list(ids)!r} is invalid: every id must be an int ({bound})")
    ids = list(ids)
    if top < 0:
        raise ConfigError(
            f"num_target_layers={num_target_layers} is invalid: a draft needs a target with at "
            "least 2 layers (the last layer cannot feed the draft)"
        )
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(
            f"{field_name}={ids} is invalid: duplicate ids {dupes} (vLLM and SGLang fail to load "
            f"them); must be {bound}, e.g. {sorted(set(ids))}"
        )
    bad = [i for i in ids if not 0 <= i <= top]
    if bad:
        last = [i for i in bad if i == num_target_layers - 1]
        why = (
            f" layer {num_target_layers - 1} is the target's last layer: SGLang never captures it and vLLM "
            "hands over its pre-norm residual where training used the post-norm hidden state;"
            if last
            else ""
        )
        raise ConfigError(
            f"{field_name}={ids} is invalid: ids {bad} are out of range for a target with "
            f"num_target_layers={num_target_layers};{why} must be {bound}"
        )
    if ids != sorted(ids):
        raise ConfigError(
            f"{field_name}={ids} is invalid: not in increasing order; vLLM and SGLang concatenate "
            f"target layers in ascending order, so this order would permute fc's input columns "
            f"silently. Must be {bound}: use {sorted(ids)} (a checkpoint trained in this order "
            "needs fc.weight's column blocks permuted the same way)"
        )
    return ids


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
        if isinstance(self.target_layer_ids, (list, tuple)):  # numpy / torch ints become ints; 1.5 stays and fails
            self.target_layer_ids = [
                int(i) if isinstance(i, Integral) and not isinstance(i, bool) else i for i in self.target_layer_ids
            ]
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field outside its bound."""
        for name in (
            "hidden_size",
            "vocab_size",
            "num_target_layers",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "block_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value, "an integer >= 1")
        check(
            self.block_size >= 2,
            "block_size",
            self.block_size,
            "block_size >= 2 (the anchor and at least one draft)",
            verb="satisfy",
        )
        check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            self.num_key_value_heads,
            f"num_attention_heads={self.num_attention_heads}",
            verb="divide",
        )
        check(self.resolved("head_dim") % 2 == 0, "head_dim", self.head_dim, "an even number (RoPE rotates pairs)")
        check(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "> 0")
        check(self.rope_theta > 0, "rope_theta", self.rope_theta, "> 0")
        check(self.hidden_act == "silu", "hidden_act", self.hidden_act, "'silu' (the Qwen3 MLP)")
        check(
            0 <= self.mask_token_id < self.vocab_size,
            "mask_token_id",
            self.mask_token_id,
            f"0 <= mask_token_id < vocab_size={self.vocab_size}",
            verb="satisfy",
        )
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        if self.sliding_window is not None:
            check(
                self.sliding_window >= self.block_size,
                "sliding_window",
                self.sliding_window,
                f"sliding_window >= block_size={self.block_size}",
                verb="satisfy",
            )
        check(
            self.projector_type in ARCHITECTURES,
            "projector_type",
            self.projector_type,
            f"one of {sorted(ARCHITECTURES)}",
        )
        check(
            self.torch_dtype in ("float32", "bfloat16", "float16", "float64"),
            "torch_dtype",
            self.torch_dtype,
            "one of float32, bfloat16, float16, float64",
        )
        if self.projector_type == "dflash2":
            for name in DFLASH2_FIELDS:
                value = getattr(self, name)
                check(isinstance(value, int) and not isinstance(value, bool), name, value, "an integer")
            check(
                1 <= self.conv_kernel_size <= self.block_size,
                "conv_kernel_size",
                self.conv_kernel_size,
                f"1 <= conv_kernel_size <= block_size={self.block_size}",
                verb="satisfy",
            )
            check(
                self.conv_group_size >= 1 and self.hidden_size % self.conv_group_size == 0,
                "conv_group_size",
                self.conv_group_size,
                f"hidden_size={self.hidden_size}",
                verb="divide",
            )
            check(
                1 <= self.selector_top_k <= self.vocab_size,
                "selector_top_k",
                self.selector_top_k,
                f"1 <= selector_top_k <= vocab_size={self.vocab_size}",
                verb="satisfy",
            )
            check(self.selector_rank >= 1, "selector_rank", self.selector_rank, "selector_rank >= 1", verb="satisfy")

    def check_sequence_length(self, seq_len: int, name: str = "seq_len") -> None:
        """Sequences are cut into whole blocks: raise unless ``seq_len`` is a multiple of ``block_size``."""
        check(
            seq_len > 0 and seq_len % self.block_size == 0,
            name,
            seq_len,
            f"a positive multiple of block_size={self.block_size}",
        )

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

    def resolved(self, name: Literal["head_dim", "intermediate_size"]) -> int:
        """``head_dim`` or ``intermediate_size`` as an int. The fields are Optional only so that the constructor
        can derive them: ``__post_init__`` sets them and :meth:`validate` checks them, so a built config holds
        ints; a field cleared afterwards is refused here, naming it."""
        value = self.head_dim if name == "head_dim" else self.intermediate_size
        if value is None:
            raise ConfigError(f"{name}=None is invalid: must be an integer >= 1 (set it, or leave it to DraftConfig)")
        return value

    def replace(self, **changes: Any) -> DraftConfig:
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
    def from_hf_dict(cls, data: dict[str, Any]) -> DraftConfig:
        """Read a ``config.json`` written by this project, ModelOpt, SpecForge or z-lab.

        Strict where the serving engines are lenient, because what they accept silently is served wrong:
        ``architectures`` must be exactly one DFlash architecture and agree with ``dflash_config``
        (``DFlashDraftModel`` over DFlash2 fields would drop the conv and selector), a top-level
        ``block_size`` must equal ``dflash_config.block_size``, and ids / sizes must be real ints.
        Raises :class:`ConfigError` naming the field, the value and what it must be.
        """
        if not isinstance(data, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(data).__name__}")
        dflash = data.get("dflash_config")
        if not isinstance(dflash, dict):
            raise ConfigError(
                f"dflash_config={dflash!r} is invalid: a DFlash / DFlash2 config.json needs a "
                "dflash_config object (mask_token_id, target_layer_ids, block_size ...)"
            )
        archs = data.get("architectures")
        known = sorted(ARCHITECTURES.values())
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in known:
            raise ConfigError(
                f"architectures={archs!r} is invalid: must be exactly one of {known} "
                "(vLLM and SGLang pick the draft model class from it)"
            )
        projector = dflash.get("projector_type")
        has_dflash2_fields = [k for k in DFLASH2_FIELDS if dflash.get(k)]
        if archs[0] == "DFlash2DraftModel":
            if projector not in (None, "dflash2"):
                raise ConfigError(
                    f"dflash_config.projector_type={projector!r} is invalid with architectures="
                    f"{archs!r}: must be 'dflash2' (or absent)"
                )
            projector = "dflash2"
        else:
            if projector == "dflash2" or has_dflash2_fields:
                what = "projector_type='dflash2'" if projector == "dflash2" else ", ".join(has_dflash2_fields)
                raise ConfigError(
                    f"architectures={archs!r} is invalid for this checkpoint: dflash_config has "
                    f"DFlash2 settings ({what}); served as DFlashDraftModel the convolution and "
                    "the selector are dropped silently. Set architectures to "
                    '["DFlash2DraftModel"] (or remove the DFlash2 settings for a DFlash draft)'
                )
            projector = "dflash"
        for key in ("mask_token_id", "target_layer_ids"):
            if key not in dflash:
                raise ConfigError(f"dflash_config.{key} is missing from config.json")
        for key, neutral in UNSUPPORTED_SCALES.items():  # engines apply these; this project's model does not
            value = dflash.get(key)
            if value is not None and value != neutral:
                raise ConfigError(
                    f"dflash_config.{key}={value!r} is not supported: vLLM and SGLang apply it, "
                    "this project's draft model does not, so its evaluation and exports would "
                    f"differ from what the engines serve (supported: absent or {neutral!r})"
                )
        for key in (
            "hidden_size",
            "vocab_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
        ):
            if key not in data:
                raise ConfigError(f"{key} is missing from config.json (the draft's Qwen3 geometry)")
        inner, top = dflash.get("block_size"), data.get("block_size")
        if inner is not None and top is not None and inner != top:
            raise ConfigError(
                f"block_size={top!r} (top level) disagrees with dflash_config.block_size={inner!r}: "
                "SGLang reads dflash_config.block_size, other readers the top-level one, so the "
                "draft would be served with a block it was not trained for. Make both equal to "
                "the training block size"
            )
        block_size = inner if inner is not None else top if top is not None else 16
        layer_ids = dflash["target_layer_ids"]
        num_target_layers = data.get("num_target_layers")
        if num_target_layers is None and isinstance(layer_ids, list) and layer_ids:
            # Not recorded (z-lab, older exports): the smallest depth the ids allow (the last layer is never used).
            num_target_layers = max(int(i) for i in layer_ids if isinstance(i, Integral)) + 2
        dtype = data.get("dtype") or data.get("torch_dtype") or "float32"
        kwargs: dict[str, Any] = dict(
            hidden_size=data["hidden_size"],
            vocab_size=data["vocab_size"],
            num_target_layers=num_target_layers,
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=data["num_attention_heads"],
            num_key_value_heads=data["num_key_value_heads"],
            head_dim=data.get("head_dim"),
            intermediate_size=data["intermediate_size"],
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta_of(_Attrs(data)),
            max_position_embeddings=data.get("max_position_embeddings", 32768),
            initializer_range=data.get("initializer_range", 0.02),
            hidden_act=data.get("hidden_act", "silu"),
            mask_token_id=_json_int(dflash["mask_token_id"], "dflash_config.mask_token_id"),
            block_size=_json_int(block_size, "dflash_config.block_size"),
            target_layer_ids=layer_ids,
            sliding_window=data.get("sliding_window")
            if data.get("use_sliding_window") or dflash.get("use_swa")
            else None,
            projector_type=projector,
            torch_dtype=str(dtype).replace("torch.", ""),
        )
        if projector == "dflash2":
            for name in DFLASH2_FIELDS:
                if name not in dflash:
                    raise ConfigError(
                        f"dflash_config.{name} is missing from config.json (required by DFlash2DraftModel)"
                    )
                kwargs[name] = _json_int(dflash[name], f"dflash_config.{name}")
        return cls(**kwargs)


def _json_int(value: Any, name: str) -> int:
    """``value`` as an int, refusing what only looks like one (``"8"``, ``8.5``, ``true``): engines call ``int()``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ConfigError(f"{name}={value!r} is invalid: must be an integer")
    return int(value)


class _Attrs:
    """Attribute view of a dict, so :func:`rope_theta_of` reads config.json and HF configs alike."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.__dict__.update(data)

    def __getattr__(self, name: str) -> Any:
        return None
