"""The options of a running OpenAI-compatible server that ``dflash2 regen --server`` and ``dflash2 check-serving``
share: where it answers and how long one request may take (the requests go through
:mod:`dflash2_lightning.engines.openai_client`)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash2_lightning.action_options import option
from dflash2_lightning.errors import bounded


@dataclass(kw_only=True)
class ServerOptions:
    """How an action reaches a running server (vLLM, SGLang, llama-server): the options group an action's options
    inherit. ``--server`` is optional here (``regen`` runs the target in-process without one); an action that
    needs a server redeclares it as required."""

    server: str | None = option(
        None,
        "an OpenAI-compatible server (vLLM, SGLang, llama-server) at this address, e.g. http://127.0.0.1:8080/v1",
        metavar="URL",
    )
    timeout: float = option(
        600.0,
        "seconds any one request to the server may take before it counts as stuck (default {default})",
        parse=bounded(float, 0.0, low_open=True),
    )
