"""A target's ``config.json``, read and checked before anything is built from it.

``dflash2 plan`` and ``fit`` build the target from its config (on the meta device for the plan, with its
weights for the fit). A broken or foreign ``config.json`` would fail deep inside transformers (a truncated
file, a JSON array, ``hidden_size: "big"``), build a nonsense model (``hidden_size: -4096``), or run for
minutes and fill the memory before any size is checked (``num_hidden_layers: 100000000``). Here every such
file is refused in one line naming the file, the field and what is expected, before any layer exists:

- the file must be UTF-8 JSON holding an object with a ``model_type`` transformers knows;
- the sizes the target's memory scales with (:data:`SIZE_BOUNDS`) must be integers from 1 to a bound well
  above any published decoder model's (a larger value is a broken file, not a bigger model);
- the model must be a causal language model (``AutoModelForCausalLM`` loads it): a vision encoder's config is
  refused by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dflash2_lightning.target.spec import TargetError

#: field -> (largest accepted value, the largest published decoder models' value it is compared with)
SIZE_BOUNDS: dict[str, tuple[int, str]] = {
    "hidden_size": (2**16, "16384 (Llama 3.1 405B)"),
    "intermediate_size": (2**20, "53248 (Llama 3.1 405B)"),
    "num_hidden_layers": (1024, "126 (Llama 3.1 405B)"),
    "num_attention_heads": (1024, "128"),
    "num_key_value_heads": (1024, "128"),
    "head_dim": (4096, "256"),
    "vocab_size": (2**22, "262144 (Gemma 3)"),
    "max_position_embeddings": (2**30, "10485760 (Llama 4 Scout)"),
}
#: the sizes every decoder the project trains drafts for states (the draft's geometry is taken from them)
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_FIX = "a config.json of a decoder-only language model (what AutoModelForCausalLM loads)"


def read_config_json(directory: str | os.PathLike) -> dict[str, Any]:
    """``directory/config.json`` as a dict; a missing, binary, truncated or empty file, or JSON that is not an
    object, is a :class:`TargetError` naming the file."""
    path = Path(directory).expanduser() / "config.json"
    if not path.is_file():
        raise TargetError(
            f"{path.parent} is not a Hugging Face model directory (no config.json there); models are "
            "never downloaded, give a local directory"
        )
    raw = path.read_bytes()
    if not raw.strip():
        raise TargetError(f"{path} is empty: copy the model's config.json again (a failed download or copy?)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise TargetError(
            f"{path} is not a text file (byte {error.start} is not UTF-8): it should be the model's "
            "JSON config; copy it again"
        ) from None
    except json.JSONDecodeError as error:
        raise TargetError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}): "
            "truncated? copy the model's config.json again"
        ) from None
    if not isinstance(data, dict):
        raise TargetError(f"{path} holds a JSON {type(data).__name__}, not an object of settings: it should be {_FIX}")
    return data


def check_config_sizes(
    data: dict[str, Any], where: str, fix: str = "fix it or copy the model's config.json again"
) -> None:
    """Refuse (:class:`TargetError`) a target config whose sizes (:data:`SIZE_BOUNDS`) are missing, not integers,
    below 1 or above their bound; ``where`` names the file or setting in the message, ``fix`` what to do."""
    for name in REQUIRED_SIZES:
        if data.get(name) is None:
            raise TargetError(f"{where} has no {name}: it should be {_FIX}")
    for name, (bound, published) in SIZE_BOUNDS.items():
        value = data.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise TargetError(f"{where}: {name}={value!r} is invalid: must be an integer from 1 to {bound}; {fix}")
        if not 1 <= value <= bound:
            raise TargetError(
                f"{where}: {name}={value} is invalid: must be from 1 to {bound} (the largest published "
                f"decoder models have {published}); {fix}"
            )
    heads, kv = data["num_attention_heads"], data.get("num_key_value_heads")
    if kv is not None and heads % kv:
        raise TargetError(
            f"{where}: num_key_value_heads={kv} is invalid: must divide num_attention_heads={heads}; {fix}"
        )


def check_causal_lm(model_type: Any, where: str) -> None:
    """Refuse a ``model_type`` that ``AutoModelForCausalLM`` does not build (a vision or encoder model), or one
    this transformers does not know."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(model_type, str):
        raise TargetError(f"{where} has no model_type: it should be {_FIX}")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise TargetError(
            f"{where}: model_type {model_type!r} is not known to this transformers: a newer model? "
            f"upgrade transformers, or give {_FIX}"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise TargetError(
            f"{where}: model_type {model_type!r} is not a causal language model (transformers' "
            f"AutoModelForCausalLM does not build it): a draft needs a decoder-only target; give {_FIX}"
        )


def target_config(directory: str | os.PathLike) -> Any:
    """The transformers config of the HF model in ``directory``, every check of this module passed (nothing built)."""
    from transformers import AutoConfig

    data = read_config_json(directory)
    where = str(Path(directory).expanduser() / "config.json")
    check_causal_lm(data.get("model_type"), where)
    check_config_sizes(data, where)
    try:
        return AutoConfig.from_pretrained(str(Path(directory).expanduser()), local_files_only=True)
    except Exception as error:
        # reports it as a ValueError, a TypeError or huggingface_hub's StrictDataclassFieldValidationError)
        raise TargetError(
            f"{where} is refused by transformers' {data['model_type']} config "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]}): fix that field"
        ) from None
