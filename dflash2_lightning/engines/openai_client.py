"""Talking HTTP/JSON to an OpenAI-compatible server (vLLM, SGLang, llama-server): one home for every request.

``dflash2 regen --server`` (:mod:`dflash2_lightning.data.regen_server`), ``dflash2 check-serving``
(:mod:`dflash2_lightning.engines.counters`) and the llama.cpp measurements send their requests
through :func:`fetch` / :func:`request_json`, so every way a server can fail reads the same and names the
endpoint:

- nothing answers (connection refused, unknown host): :class:`Unreachable`, "is the server running?";
- it answers too late: "did not answer within N s (--timeout)", never "is it running?";
- it does not speak HTTP (another service on that port), or its answer is cut off mid-body: said so, with
  what it sent made printable (no raw NUL or CR bytes in the message);
- it answers an HTTP error, or something that is not JSON;
- it answers JSON of another shape than the endpoint's (a list where an object belongs, a string where token
  ids belong): :func:`expect` names the endpoint and the field.

Each is a :class:`ServerError` (a user error: one ``dflash2: error:`` line, exit status 2).
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any

from dflash2_lightning.errors import UserError

#: what a shape error suggests: the URL names something else than an OpenAI-compatible server
_WHICH_SERVER = "is it an OpenAI-compatible server (vLLM, SGLang, llama-server), and is the URL right?"


class ServerError(UserError, RuntimeError):
    """The server did not answer, or answered with an error (the message names the URL and what is kept)."""


class Unreachable(ServerError):
    """Nothing answers at the URL: connection refused, no route, unknown host."""


def one_line(text: str, limit: int = 300) -> str:
    """``text`` printable on one line (a server's answer echoed in a message), cut to ``limit`` characters."""
    from dflash2_lightning.reporting import printable

    return printable(" ".join(text.split()), limit)


def json_kind(value: Any) -> str:
    """How JSON calls ``value``'s type, with its article: ``an object``, ``a list``, ``a string`` ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object" if isinstance(value, dict) else type(value).__name__


def shape_error(url: str, field: str, value: Any, expected: str, error: type[UserError] = ServerError) -> UserError:
    """The error of an answer whose ``field`` is not what the endpoint ``url`` returns (``expected``)."""
    shown = one_line(json.dumps(value, default=str), 80)
    return error(
        f"{url} answered JSON of another shape: {field} is {json_kind(value)} ({shown}), not {expected}: "
        f"{_WHICH_SERVER}"
    )


def expect(
    value: Any, kind: type | tuple[type, ...], url: str, field: str, expected: str, error: type[UserError] = ServerError
) -> Any:
    """``value`` when it is a ``kind`` (a bool is never a number), else :func:`shape_error`."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
        return value
    raise shape_error(url, field, value, expected, error)


def fetch(url: str, payload: dict[str, Any] | None, timeout: float) -> tuple[int, bytes]:
    """``(status, body)`` of a GET (``payload`` None) or a JSON POST; an HTTP error status is returned, not raised.

    Raises :class:`Unreachable` when nothing answers, :class:`ServerError` when the server answers too late,
    not in HTTP, or cuts its answer off.
    """
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="GET" if payload is None else "POST"
    )
    try:
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
    except http.client.IncompleteRead as error:
        got = len(error.partial)
        raise ServerError(
            f"{url} cut its answer off ({got} of {got + (error.expected or 0)} bytes received): the "
            "server closed the connection mid-answer; check its log, then rerun"
        ) from None
    except TimeoutError as error:
        raise _timed_out(url, timeout) from error
    except urllib.error.URLError as error:
        if isinstance(error.reason, (TimeoutError, socket.timeout)):
            raise _timed_out(url, timeout) from None
        if isinstance(error.reason, http.client.HTTPException):
            raise _not_http(url, error.reason) from None
        raise Unreachable(
            f"{url} did not answer ({one_line(str(error.reason), 200)}): is the server running and the URL right?"
        ) from None
    except http.client.HTTPException as error:
        if isinstance(error, ConnectionError):  # RemoteDisconnected: it accepted and closed without a word
            raise Unreachable(
                f"{url} did not answer (it closed the connection without a response): is the server "
                "running and the URL right?"
            ) from None
        raise _not_http(url, error) from None
    except (ConnectionError, OSError) as error:
        raise Unreachable(
            f"{url} did not answer ({one_line(str(error), 200)}): is the server running and the URL right?"
        ) from None


def _timed_out(url: str, timeout: float) -> ServerError:
    return ServerError(
        f"{url} did not answer within {timeout:g} s (--timeout): the server is busy or stuck; check "
        "it, or rerun with a larger --timeout"
    )


def _not_http(url: str, error: http.client.HTTPException) -> ServerError:
    sent = one_line(str(error), 60)
    return ServerError(
        f"{url} did not answer in HTTP (it sent '{sent}'): is the URL the server's HTTP address (host and port)?"
    )


def request_json(url: str, payload: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    """The JSON object a GET (``payload`` None) or POST of ``url`` answers; every failure is a :class:`ServerError`
    naming ``url`` (see the module docstring)."""
    status, body = fetch(url, payload, timeout)
    if status >= 400:
        text = one_line(body.decode(errors="replace"))
        raise ServerError(f"{url} answered HTTP {status}" + (f" ({text})" if text else ""))
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:  # not JSON: not an OpenAI-compatible endpoint
        raise ServerError(
            f"{url} answered something that is not JSON ({one_line(str(error), 120)}; it begins "
            f"'{one_line(body[:60].decode(errors='replace'), 60)}'): is it an OpenAI-compatible "
            "server's /v1 URL?"
        ) from None
    return expect(answer, dict, url, "the answer", "an object")


def served_model(base_url: str, timeout: float = 30.0) -> str:
    """The id of the model an OpenAI-compatible server serves (``GET {base_url}/models``, first entry)."""
    url = base_url.rstrip("/") + "/models"
    listing = request_json(url, None, timeout)
    models = expect(listing.get("data") or [], list, url, "data", "a list of models")
    if not models:
        raise ServerError(f"{url} lists no model: {one_line(str(listing))}")
    first = expect(models[0], dict, url, "data[0]", "a model object with an id")
    if first.get("id") is None:
        raise ServerError(f"{url} lists no model id: {one_line(str(listing))}")
    return str(first["id"])


def first_choice(answer: dict[str, Any], url: str, error: type[UserError] = ServerError) -> dict[str, Any]:
    """``choices[0]`` of a completions answer, with its ``text`` a string; else ``error`` naming the field."""
    choices = answer.get("choices")
    if not choices:
        raise error(f"{url} returned no choice: {one_line(str(answer))}")
    choices = expect(choices, list, url, "choices", "a list of choices", error)
    choice = expect(choices[0], dict, url, "choices[0]", "a choice object", error)
    if "text" not in choice:
        raise error(f"{url} returned a choice without text: {one_line(str(answer))}")
    expect(choice["text"], str, url, "choices[0].text", "a string", error)
    return choice


def complete(
    base_url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """One ``POST {base_url}/completions`` with token-id prompt; returns the first choice (text, finish_reason)."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stream": False,
    }
    if temperature == 0.0:
        payload["top_k"] = 1  # greedy on engines that otherwise keep sampling settings (vLLM, SGLang, llama.cpp)
    if seed is not None:
        payload["seed"] = seed
    url = base_url.rstrip("/") + "/completions"
    return first_choice(request_json(url, payload, timeout), url)
