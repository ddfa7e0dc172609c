"""The HTTP routes: text-embeddings-inference's (`/embed`, `/predict`, `/rerank`, `/tokenize`, `/info`, `/health`,
`/metrics`, and `/` as TEI routes it by the model's kind) and OpenAI's `/v1/embeddings`, over one `Engine` and its
`Batcher`, as a plain ASGI application (`App`) that uvicorn serves.

A request's way: its route looked up in a dict; 401 without the API key where one is set; 429 with Retry-After on the
model's routes while the queue is full, before the body is read; the body validated by its pydantic model straight
from the JSON bytes (pydantic's Rust parser); then its route. Tokenizing runs in a thread pool of the app's own, never
on the event loop, and queues the request for the model from there; the event loop wakes once more for the request,
when its rows are ready. Answers are JSON written by orjson, the embeddings straight from their float32 arrays (each
number as float32's shortest repr, as text-embeddings-inference writes them). No web framework between uvicorn and the
routes: FastAPI's and Starlette's routing, middleware and request parsing took a single request about a quarter of a
millisecond (benchmarks/NOTES.md, "The server's own time").

Every route answers its errors in its API's shape: TEI's `{"error", "error_type"}`, OpenAI's `{"error": {"message",
"type", "param", "code"}}`; 422 for a malformed body or a field of another JSON type (the field named), 413 for too
many inputs, too long an input or too large a body (the limit named), 408 for a body that does not come in time, 429
with Retry-After when the queue is full, 401 without the API key where one is set, 404 and 405 for a path or method
the server does not have, 500 for a batch that failed (the server goes on). A request whose client leaves while it
waits is dropped from the queue, and nothing is sent. Limits on a request's head are protocol.py's.
"""

import asyncio
import base64
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import orjson
import torch
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from ..inference import free_thread_pool
from .batching import Batcher, stream_plan
from .limits import Limits
from .engine import Encoding, Engine

logger = logging.getLogger("bert_impl.serve")
OPEN_ROUTES = ("/health", "/metrics")  # answered without the API key: probes and scrapers
QUEUED_ROUTES = ("/", "/embed", "/predict", "/rerank", "/v1/embeddings")  # their requests wait for the model
TOKENIZING_THREADS = 4  # the app's thread pool: tokenizing (the Rust tokenizer runs without the GIL) and stopping
JSON_TYPE = b"application/json"
CLOSE = ((b"connection", b"close"),)  # a refused body's answer ends its connection: the rest is never read


# Real tokens in one batch where none are chosen: text-embeddings-inference's 16384 on a GPU; on a CPU, where the
# engines run fastest on batches of 32 to 64 sentences and a batch of 16384 tokens holds the next requests back for
# seconds, 4096.
BATCH_TOKENS = {"cuda": 16384, "cpu": 4096}


@dataclass
class Reply:
    """An answer as it goes out: status, body, content type, more headers."""

    status: int
    body: bytes
    content_type: bytes = JSON_TYPE
    headers: tuple = ()


def json_reply(content, status: int = 200, headers: tuple = ()) -> Reply:
    """`content` as JSON by orjson: numpy arrays as lists (float32 ones in float32's shortest repr), NaN as null."""
    return Reply(status, orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), JSON_TYPE, headers)


class RouteError(Exception):
    """An answer other than 200: its status, message, TEI's error type and the field or limit it names."""

    def __init__(self, status: int, message: str, error_type: str = "Validation", param: str | None = None,
                 headers: tuple = ()):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param = status, message, error_type, param
        self.headers = headers  # more response headers: (name, value) bytes


class Body(BaseModel):
    """A request body, its fields of the JSON types TEI and OpenAI document and no other: a boolean is true or false
    (not "yes", 1 or 0.0), a token id an integer (not 1e3, "101" or true), a text a string."""

    model_config = ConfigDict(strict=True)


class Embed(Body):
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = False


class Predict(Body):
    inputs: str | list[str] | list[list[str]]
    raw_scores: bool = False
    truncate: bool = False


class Rerank(Body):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = False


class Tokenize(Body):
    inputs: str | list[str]
    add_special_tokens: bool = True


class OpenAIEmbeddings(Body):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"
    user: str | None = None


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self, batcher: Batcher):
        self.registry = CollectorRegistry()
        Gauge("bert_impl_queue_size", "Requests waiting for the model", registry=self.registry).set_function(
            lambda: len(batcher.queue))
        self.batch_size = Histogram("bert_impl_batch_size", "Inputs per batch", registry=self.registry,
                                    buckets=[2**i for i in range(11)])
        self.batch_tokens = Histogram("bert_impl_batch_tokens", "Real tokens per batch", registry=self.registry,
                                      buckets=[2**i for i in range(4, 16)])
        self.latency = Histogram("bert_impl_request_duration_seconds", "Time from a request's arrival to its answer",
                                 ["route"], registry=self.registry)
        self.requests = Counter("bert_impl_requests", "Requests answered (status 499: not, their client gone)",
                                ["route", "status"], registry=self.registry)
        self.dropped = Counter("bert_impl_dropped_requests", "Requests taken off the queue unrun, their client gone",
                               registry=self.registry)
        self.stream_batches = Counter("bert_impl_stream_batches", "Batches a model stream ran, by the threads they ran "
                                      "on", ["stream", "threads"], registry=self.registry)
        self.stream_busy = Counter("bert_impl_stream_busy_seconds", "Seconds a model stream spent running batches",
                                   ["stream"], registry=self.registry)

    def batch(self, stream: int, inputs: int, tokens: int, seconds: float, threads: int) -> None:
        self.batch_size.observe(inputs)
        self.batch_tokens.observe(tokens)
        self.stream_batches.labels(str(stream), str(threads)).inc()
        self.stream_busy.labels(str(stream)).inc(seconds)


@dataclass
class Route:
    """A route: its method, its handler (given the body as `body_model`, validated, for a POST) and the model."""

    method: str
    handler: Callable[..., Awaitable]
    body_model: type[BaseModel] | None = None


class App:
    """The ASGI application serving `engine` within `limits`; its model streams start and stop with the lifespan
    (stopping finishes the requests queued). Each HTTP request's latency and status go to the metrics; requests to
    paths the app does not have are counted under the route "other" (a label per path a client makes up would grow the
    metrics without end)."""

    def __init__(self, engine: Engine, limits: Limits = Limits()):
        self.engine, self.limits = engine, limits
        self.max_input_length = min(limits.max_input_length or engine.max_input_length, engine.max_input_length)
        self.max_batch_tokens = limits.max_batch_tokens or BATCH_TOKENS.get(engine.device.type, BATCH_TOKENS["cuda"])
        streams, threads = 1, None  # CUDA: one stream, its launches queued on one device
        if engine.device.type == "cpu":
            streams, threads = stream_plan(torch.get_num_threads(), limits.streams, limits.threads_per_stream)
        self.batcher = Batcher(engine.run, self.max_batch_tokens, limits.max_batch_requests,
                               limits.max_concurrent_requests, streams=streams, threads_per_stream=threads)
        self.metrics = Metrics(self.batcher)
        self.batcher.on_batch, self.batcher.on_drop = self.metrics.batch, self.metrics.dropped.inc
        self.pool = ThreadPoolExecutor(TOKENIZING_THREADS, thread_name_prefix="bert-impl-tokenize")
        self.api_key = None if limits.api_key is None else limits.api_key.encode()
        self.routes = {"/": Route("POST", self.root), "/embed": Route("POST", self.embed, Embed),
                       "/predict": Route("POST", self.predict, Predict), "/rerank": Route("POST", self.rerank, Rerank),
                       "/tokenize": Route("POST", self.tokenize, Tokenize),
                       "/v1/embeddings": Route("POST", self.openai_embeddings, OpenAIEmbeddings),
                       "/info": Route("GET", self.info), "/health": Route("GET", self.health),
                       "/metrics": Route("GET", self.prometheus)}

    # --- ASGI ------------------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":  # websockets: not served (uvicorn refuses the handshake)
            return
        start, path = time.perf_counter(), scope["path"]
        try:
            reply = await self.answer(scope, receive, path)
        except ClientGone:  # nothing to send it; counted as nginx counts a request its client closed
            self.metrics.requests.labels(path, "499").inc()
            return
        except RouteError as error:
            reply = error_reply(path, error)
        except Exception as error:  # a bug of ours: the request gets 500, the server goes on
            logger.exception("%s %s failed", scope["method"], path)
            reply = error_reply(path, RouteError(500, f"internal error: {error}", "Backend"))
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [(b"content-type", reply.content_type),
                                (b"content-length", str(len(reply.body)).encode()), *reply.headers]})
        await send({"type": "http.response.body", "body": reply.body})
        route = path if path in self.routes else "other"
        self.metrics.latency.labels(route).observe(time.perf_counter() - start)
        self.metrics.requests.labels(route, str(reply.status)).inc()

    async def answer(self, scope, receive, path: str) -> Reply:
        """The request's reply: 401 without the API key where one is set (but on `OPEN_ROUTES`); 429 on
        `QUEUED_ROUTES` while the queue is full, before the body is read, parsed or tokenized, so that refusing a
        request under overload costs the model's cores little (such a request, malformed or not, gets 429: its retry
        gets the answer); 404, 405; else the route's."""
        if self.api_key is not None and path not in OPEN_ROUTES and not bearer(header(scope, b"authorization"),
                                                                                self.api_key):
            raise RouteError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                             "Unauthorized")
        method = scope["method"]
        if path in QUEUED_ROUTES and method == "POST" and self.batcher.full():
            raise overloaded(self.batcher)
        route = self.routes.get(path)
        if route is None:
            raise RouteError(404, f"no route {path}", "NotFound")
        if method != route.method:
            raise RouteError(405, f"{path} takes {route.method}, not {method}", "MethodNotAllowed",
                             headers=((b"allow", route.method.encode()),))
        if method == "GET":
            return await route.handler()
        body = await read_body(scope, receive, self.limits.payload_limit, self.limits.body_timeout)
        return await unless_gone(receive, route.handler(validated(route.body_model, body) if route.body_model
                                                        else body))

    async def lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # the model computes on the streams from now on; this thread, which loaded it, holds an OpenMP pool
                free_thread_pool()
                self.batcher.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await asyncio.get_running_loop().run_in_executor(self.pool, self.batcher.stop)
                self.pool.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- the model's work ------------------------------------------------------------------------------------------
    def check_count(self, inputs: list, param: str = "inputs") -> None:
        if not inputs:
            raise RouteError(422, f"{param} cannot be empty", param=param)
        if len(inputs) > self.limits.max_client_batch_size:
            raise RouteError(413, f"batch size {len(inputs)} > maximum allowed batch size "
                                  f"{self.limits.max_client_batch_size} (--max-client-batch-size)", param=param)

    async def text_rows(self, texts: list, truncate: bool,
                        param: str = "inputs") -> tuple[list[Encoding], torch.Tensor]:
        """The texts' token ids and the model's output rows for them: tokenized and queued in the app's thread pool,
        where the model streams take them from, and the event loop woken once, by the rows (the stream hands them to
        the loop itself); 413 for too many texts, or for one too long without `truncate`, naming the body's field
        `param`."""
        self.check_count(texts, param)
        loop = asyncio.get_running_loop()
        answer = loop.create_future()  # (encodings, rows) or the request's error
        self.pool.submit(self.tokenize_and_queue, texts, truncate, param, loop, answer)
        return await answer

    def tokenize_and_queue(self, texts: list, truncate: bool, param: str, loop, answer: asyncio.Future) -> None:
        """In the thread pool: tokenize, then `queue_and_settle`; a 413, 429 or the tokenizer's own error settles
        `answer` at once."""
        if answer.cancelled():  # the request is gone
            return
        try:
            encodings = self.engine.encode(texts, self.max_input_length if truncate else None)
            self.queue_and_settle([self.check_length(e, i, param) for i, e in enumerate(encodings)], loop, answer)
        except Exception as error:
            loop.call_soon_threadsafe(settle, answer, None, error)

    def queue_and_settle(self, encodings: list, loop, answer: asyncio.Future) -> None:
        """Queue the inputs (429 when the queue is full) and have the model stream settle `answer` on the loop as
        their batch ends: (encodings, rows), or the 500 of a batch that failed."""
        rows = self.queue(encodings, answer.cancelled)

        def pass_on(done: Future) -> None:  # on the model stream
            error = done.exception()
            loop.call_soon_threadsafe(settle, answer, None if error else (encodings, done.result()),
                                      error and backend_error(error))

        rows.add_done_callback(pass_on)

    def check_length(self, encoding: Encoding, index: int, param: str = "inputs") -> Encoding:
        if len(encoding.ids) > self.max_input_length:
            raise RouteError(413, f"input {index} has {len(encoding.ids)} tokens, more than the "
                                  f"{self.max_input_length} allowed (--max-input-length); pass truncate: true to cut "
                                  "it", param=param)
        return encoding

    def queue(self, encodings: list, gone=bool) -> Future:
        """The future of these inputs' rows, queued for the model (dropped unrun once `gone()`, its request cancelled):
        429 when the queue is full."""
        future = self.batcher.submit(encodings, gone)
        if future is None:
            raise overloaded(self.batcher)
        return future

    def needs(self, kinds: tuple[str, ...], route: str) -> None:
        if self.engine.kind not in kinds:
            raise RouteError(400, f"{route} needs {article(kinds[0])} {' or '.join(kinds)} model; "
                                  f"{self.engine.model_id} is {article(self.engine.kind)} {self.engine.kind} model")

    # --- routes ----------------------------------------------------------------------------------------------------
    async def embed(self, body: Embed) -> Reply:
        self.needs(("embedding",), "/embed")
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        _, rows = await self.text_rows(texts, body.truncate)
        return json_reply(normalize(rows.numpy()) if body.normalize else rows.numpy())

    async def predict(self, body: Predict) -> Reply:
        answers, single = await self.predictions(body)
        return json_reply(answers[0] if single else answers)

    async def predictions(self, body: Predict) -> tuple[list, bool]:
        """Each input's labels and scores, best first; and whether the request held one input."""
        self.needs(("classifier", "reranker"), "/predict")
        inputs = body.inputs
        single = isinstance(inputs, str) or (len(inputs) == 2 and all(isinstance(t, str) for t in inputs))
        if single:  # a text, or two strings: one pair, as text-embeddings-inference reads them
            texts = [inputs if isinstance(inputs, str) else tuple(inputs)]
        else:
            if any(not isinstance(t, str) and len(t) not in (1, 2) for t in inputs):
                raise RouteError(422, "inputs: each input is a text, or a list of one or two texts (a pair)",
                                 param="inputs")
            texts = [t if isinstance(t, str) else t[0] if len(t) == 1 else tuple(t) for t in inputs]
        _, rows = await self.text_rows(texts, body.truncate)
        scores = self.engine.scores(rows.view(len(texts), -1), body.raw_scores)
        labels = self.engine.config.id2label
        answers = [sorted(({"score": s, "label": labels[i]} for i, s in enumerate(row.tolist())),
                          key=lambda a: -a["score"]) for row in scores]
        return answers, single

    async def rerank(self, body: Rerank) -> Reply:
        self.needs(("reranker",), "/rerank")
        _, rows = await self.text_rows([(body.query, text) for text in body.texts], body.truncate)
        scores = rows if body.raw_scores else rows.sigmoid()
        ranked = sorted(range(len(body.texts)), key=lambda i: -scores[i].item())
        return json_reply([{"index": i, "score": scores[i].item(),
                            **({"text": body.texts[i]} if body.return_text else {})} for i in ranked])

    async def tokenize(self, body: Tokenize) -> Reply:
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        try:
            tokens = await asyncio.get_running_loop().run_in_executor(self.pool, self.engine.tokens, texts,
                                                                      body.add_special_tokens)
        except ValueError as error:  # a tokenizer without offsets (not a fast one)
            raise RouteError(400, str(error)) from error
        return json_reply([[{"id": token, "text": text, "special": bool(special),
                             "start": start if not special else None, "stop": stop if not special else None}
                            for token, text, special, (start, stop) in zip(e.ids, e.tokens, e.special_tokens_mask,
                                                                           e.offsets)]
                           for e in tokens])

    async def openai_embeddings(self, body: OpenAIEmbeddings) -> Reply:
        self.needs(("embedding",), "/v1/embeddings")
        if body.encoding_format not in ("float", "base64"):
            raise RouteError(422, f"encoding_format: {body.encoding_format!r} is not 'float' or 'base64'",
                             param="encoding_format")
        given = [body.input] if isinstance(body.input, str) or (body.input and isinstance(body.input[0], int)) \
            else body.input
        if given and isinstance(given[0], str):
            encodings, rows = await self.text_rows(given, truncate=False, param="input")
        else:  # token ids, as OpenAI's clients send them for some models
            self.check_count(given, "input")
            loop = asyncio.get_running_loop()
            answer = loop.create_future()  # (encodings, rows) or the request's error
            encodings = [self.check_length(self.token_ids(ids, i), i, "input") for i, ids in enumerate(given)]
            self.queue_and_settle(encodings, loop, answer)
            _, rows = await answer
        rows = normalize(rows.numpy())  # (B, H) float32
        data = [{"object": "embedding", "index": i,
                 "embedding": row if body.encoding_format == "float" else base64.b64encode(row.tobytes()).decode()}
                for i, row in enumerate(rows)]
        tokens = sum(len(e.ids) for e in encodings)
        return json_reply({"object": "list", "data": data, "model": body.model or self.engine.model_id,
                           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def token_ids(self, ids: list[int], index: int) -> Encoding:
        vocabulary = self.engine.config.vocab_size
        if not ids:
            raise RouteError(422, f"input: token id list {index} is empty", param="input")
        if any(not 0 <= i < vocabulary for i in ids):
            raise RouteError(422, f"input: token ids must be in [0, {vocabulary})", param="input")
        return Encoding(list(ids), [0] * len(ids))

    async def root(self, body: bytes) -> Reply:
        """TEI's route for clients that post to the server's address: /embed or /predict by the model's kind."""
        if self.engine.kind == "embedding":
            return await self.embed(validated(Embed, body))
        answers, _ = await self.predictions(validated(Predict, body))
        return json_reply(answers)  # a list per input, as huggingface_hub's InferenceClient reads it

    async def info(self) -> Reply:
        limits = self.limits
        batcher = self.batcher
        return json_reply({**self.engine.info(), "streams": batcher.streams,
                           "threads_per_stream": batcher.threads_per_stream, "threads": batcher.wide_threads,
                           "max_input_length": self.max_input_length,
                           "max_batch_tokens": self.max_batch_tokens, "max_batch_requests": limits.max_batch_requests,
                           "max_client_batch_size": limits.max_client_batch_size,
                           "max_concurrent_requests": limits.max_concurrent_requests,
                           "payload_limit": limits.payload_limit, "body_timeout": limits.body_timeout,
                           "max_header_bytes": limits.max_header_bytes, "max_headers": limits.max_headers,
                           "header_timeout": limits.header_timeout, "max_connections": limits.max_connections,
                           "keep_alive": limits.keep_alive, "graceful_timeout": limits.graceful_timeout})

    async def health(self) -> Reply:
        """200 while the model streams run (liveness and readiness: the model is loaded before the port opens)."""
        if not self.batcher.alive():
            raise RouteError(503, "a model stream is not running", "Unhealthy")
        return Reply(200, b"", b"text/plain")

    async def prometheus(self) -> Reply:
        return Reply(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST.encode())


def settle(answer: asyncio.Future, result, error: BaseException | None) -> None:
    """On the loop: `answer`'s result or error, unless its request is gone."""
    if answer.done():
        return
    if error is None:
        answer.set_result(result)
    else:
        answer.set_exception(error)


def normalize(rows: np.ndarray) -> np.ndarray:
    """(B, H) rows at unit length (as torch's `F.normalize`: their norm taken as at least 1e-12), in numpy: the smaller
    code path than torch's operators, on the event loop."""
    return rows / np.maximum(np.sqrt(np.einsum("ij,ij->i", rows, rows))[:, None], 1e-12)


def create_app(engine: Engine, limits: Limits = Limits()) -> App:
    """The ASGI app serving `engine` within `limits`."""
    return App(engine, limits)


def header(scope, name: bytes) -> bytes | None:
    """A request header's value (names come lowercase from the server), or None."""
    return next((value for key, value in scope["headers"] if key == name), None)


def bearer(authorization: bytes | None, key: bytes) -> bool:
    """Whether an Authorization header's value holds `key` as a bearer token: the scheme matched in any case (HTTP's
    schemes are case-insensitive), then one or more spaces, then the key exactly, compared in constant time (no
    timing tells how much of a guess was right). Whitespace around the value is HTTP's and not the key's."""
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.lstrip(b" "), key)


async def read_body(scope, receive, limit: int, timeout: float) -> bytes:
    """The request's whole body, at most `limit` bytes, within `timeout` seconds: 413 at once for a Content-Length
    above the limit (nothing of the body read), else as soon as the bytes received pass it (a chunked body, or one
    longer than it said); 408 once the time is up. Either closes the connection, so that the rest of the body is
    never read."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise payload_too_large(f"{int(declared)} bytes", limit)
    chunks, size, deadline = [], 0, time.monotonic() + timeout
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            raise RouteError(408, f"the body did not arrive within {timeout:g} s (--body-timeout)", "Timeout",
                             param="body", headers=CLOSE) from None
        if message["type"] == "http.disconnect":
            raise RouteError(400, "the client went away before its body came", param="body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise payload_too_large(f"more than {limit} bytes", limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected before its answer: nothing is sent."""


async def unless_gone(receive, work: Awaitable) -> Reply:
    """`work`'s reply, or ClientGone once the client disconnects first (its request then cancelled: waiting in the
    queue, it is dropped unrun). After the body, the server's next message for the request is its disconnect."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(receive())
    await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watch.cancel()
        return task.result()
    task.cancel()
    raise ClientGone


def payload_too_large(size: str, limit: int) -> RouteError:
    return RouteError(413, f"the body has {size}, more than the {limit} allowed (--payload-limit)", param="body",
                      headers=CLOSE)


def validated(model: type[BaseModel], body: bytes):
    """The JSON `body` as `model` (pydantic parses and validates the bytes at once), or 422 naming the field: every way
    it failed (a union's branches) and what came; or, for a body that is not JSON, where it stops being JSON."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        errors = error.errors()
        first = errors[0]
        if first["type"] == "json_invalid":
            raise RouteError(422, f"body: not valid JSON ({first['ctx']['error']})", param="body") from None
        field = str(first["loc"][0]) if first["loc"] else "body"
        expected = dict.fromkeys(e["msg"] for e in errors if str((e["loc"] or ("body",))[0]) == field)
        message = f"{field}: {'; or '.join(expected)} (got {type(first.get('input')).__name__})"
        raise RouteError(422, message, param=field) from None


def backend_error(error: BaseException) -> RouteError:
    """The 500 of a request whose batch failed in the model."""
    return RouteError(500, f"the model failed on this request's batch: {error}", "Backend")


def overloaded(batcher: Batcher) -> RouteError:
    """The 429 of a request that finds the queue full."""
    return RouteError(429, f"the server is at its {batcher.max_concurrent_requests} waiting requests "
                           "(--max-concurrent-requests); retry later", "Overloaded")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def error_reply(route: str, error: RouteError) -> Reply:
    """An error in the shape of the route's API, with Retry-After on 429 and the error's own headers (Allow on
    405)."""
    headers = error.headers + (((b"retry-after", b"1"),) if error.status == 429 else ())
    if route.startswith("/v1/"):
        kind = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error"}.get(
            error.status, "invalid_request_error")
        body = {"error": {"message": error.message, "type": kind, "param": error.param, "code": None}}
    else:
        body = {"error": error.message, "error_type": error.error_type}
    return json_reply(body, error.status, headers)
