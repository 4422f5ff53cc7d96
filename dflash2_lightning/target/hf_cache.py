"""How a transformers causal LM takes its KV cache: the one place that knows the keyword's name.

transformers renamed the keyword of a model's KV cache from ``past_key_values`` to ``cache`` during 5.x (5.24
takes both, with a deprecation warning for the old one until 5.40; 5.17, on the GPU machine this project is
checked on, takes only ``past_key_values``). An unknown keyword lands in the model's ``**kwargs`` and is ignored,
so the wrong name would decode every step without its past: wrong logits, no error. The name is read from the
model's own ``forward`` signature.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn


@functools.cache
def _cache_keyword(forward: Callable[..., Any]) -> str:
    # Keyed on the class's forward function (what the answer depends on), not the class: mypy does not see a
    # class object as Hashable.
    parameters = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(
        f"{forward.__qualname__} takes neither `cache` nor `past_key_values`: this transformers "
        "model cannot decode with a KV cache"
    )


def with_cache(hf: nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword arguments that pass ``cache`` to ``hf``'s forward: ``{"cache": cache}`` or
    ``{"past_key_values": cache}``, whichever this model's transformers version takes."""
    return {_cache_keyword(type(hf).forward): cache}
