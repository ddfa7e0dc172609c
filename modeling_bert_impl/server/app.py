"""The HTTP routes: text-embeddings-inference's (`/embed`, `/predict`, `/rerank`, `/tokenize`, `/info`, `/health`,
`/metrics`, and `/` as TEI routes it by the model's kind) and OpenAI's `/v1/embeddings`, over one `Engine` and its
`Batcher`.

Every route answers its errors in its API's shape: TEI's `{"error", "error_type"}`, OpenAI's `{"error": {"message",
"type", "param", "code"}}`; 422 for a malformed body (the field named), 413 for too many inputs or too long an input
(the limit named), 429 with Retry-After when the queue is full, 401 without the API key where one is set, 500 for a
batch that failed (the server goes on). Tokenizing runs in a thread pool of the app's own, never on the event loop, and
queues the request for the model from there; the event loop wakes once more for the request, when its rows are ready.
JSON is written by orjson, the embeddings straight from their float32 arrays (each number as float32's shortest
repr, as text-embeddings-inference writes them).
"""

import asyncio
import base64
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel

from ..inference import free_thread_pool
from .batching import Batcher
from .engine import Encoding, Engine, normalize

OPEN_ROUTES = ("/health", "/metrics")  # answered without the API key: probes and scrapers
QUEUED_ROUTES = ("/", "/embed", "/predict", "/rerank", "/v1/embeddings")  # their requests wait for the model
TOKENIZING_THREADS = 4  # the app's thread pool: tokenizing (the Rust tokenizer runs without the GIL) and stopping


# Real tokens in one batch where none are chosen: text-embeddings-inference's 16384 on a GPU; on a CPU, where the
# engines run fastest on batches of 32 to 64 sentences and a batch of 16384 tokens holds the next requests back for
# seconds, 4096.
BATCH_TOKENS = {"cuda": 16384, "cpu": 4096}


@dataclass
class Limits:
    """The server's limits, by text-embeddings-inference's names; None: the device's `BATCH_TOKENS`, the model's
    longest input."""

    max_batch_tokens: int | None = None
    max_batch_requests: int | None = None
    max_client_batch_size: int = 32
    max_concurrent_requests: int = 512
    max_input_length: int | None = None
    api_key: str | None = None


class JSON(JSONResponse):
    """A JSON response written by orjson: numpy arrays as lists (float32 ones in float32's shortest repr), NaN as
    null."""

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class RouteError(Exception):
    """An answer other than 200: its status, message, TEI's error type and the field or limit it names."""

    def __init__(self, status: int, message: str, error_type: str = "Validation", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param = status, message, error_type, param


class Embed(BaseModel):
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = False


class Predict(BaseModel):
    inputs: str | list[str] | list[list[str]]
    raw_scores: bool = False
    truncate: bool = False


class Rerank(BaseModel):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = False


class Tokenize(BaseModel):
    inputs: str | list[str]
    add_special_tokens: bool = True


class OpenAIEmbeddings(BaseModel):
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
        self.requests = Counter("bert_impl_requests", "Requests answered", ["route", "status"], registry=self.registry)

    def batch(self, inputs: int, tokens: int) -> None:
        self.batch_size.observe(inputs)
        self.batch_tokens.observe(tokens)


class MeasureAndGuard:
    """ASGI middleware: each HTTP request's latency and status in the metrics; 401 without the API key where one is
    set (but on `OPEN_ROUTES`); and 429 on `QUEUED_ROUTES` while the queue is full, before the body is read, parsed or
    tokenized, so that refusing a request under overload costs the model's cores little (such a request, malformed or
    not, gets 429: its retry gets the answer). A plain ASGI class, not `@app.middleware("http")`, whose per-request
    task and streams cost a single query a visible share of its time. Requests to paths other than the app's `routes`
    are counted under the route "other": a label per path a client makes up would grow the metrics without end."""

    def __init__(self, app, metrics: Metrics, api_key: str | None, routes: frozenset[str], batcher: Batcher):
        self.app, self.metrics, self.routes, self.batcher = app, metrics, routes, batcher
        self.authorization = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, path, status = time.perf_counter(), scope["path"], [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.authorization is not None and path not in OPEN_ROUTES and dict(scope["headers"]).get(
                    b"authorization") != self.authorization:
                response = error_response(path, RouteError(401, "missing or wrong API key: send the header "
                                                                "'Authorization: Bearer <key>'", "Unauthorized"))
                await response(scope, receive, send_status)
            elif path in QUEUED_ROUTES and scope["method"] == "POST" and self.batcher.full():
                await error_response(path, overloaded(self.batcher))(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            route = path if path in self.routes else "other"
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
            self.metrics.requests.labels(route, str(status[0])).inc()


def create_app(engine: Engine, limits: Limits = Limits()) -> FastAPI:
    """The ASGI app serving `engine` within `limits`; its model worker starts and stops with the app's lifespan
    (stopping finishes the requests queued)."""
    max_input_length = min(limits.max_input_length or engine.max_input_length, engine.max_input_length)
    max_batch_tokens = limits.max_batch_tokens or BATCH_TOKENS.get(engine.device.type, BATCH_TOKENS["cuda"])
    batcher = Batcher(engine.run, max_batch_tokens, limits.max_batch_requests, limits.max_concurrent_requests)
    metrics = Metrics(batcher)
    batcher.on_batch = metrics.batch

    pool = ThreadPoolExecutor(TOKENIZING_THREADS, thread_name_prefix="bert-impl-tokenize")

    @asynccontextmanager
    async def lifespan(app):
        free_thread_pool()  # the model computes on the worker from now on; this thread (which loaded it) holds a pool
        batcher.start()
        yield
        await asyncio.get_running_loop().run_in_executor(pool, batcher.stop)
        pool.shutdown()

    app = FastAPI(title="bert-impl-serve", lifespan=lifespan, default_response_class=JSON)
    app.state.batcher, app.state.engine = batcher, engine

    def check_count(inputs: list, param: str = "inputs") -> None:
        if not inputs:
            raise RouteError(422, f"{param} cannot be empty", param=param)
        if len(inputs) > limits.max_client_batch_size:
            raise RouteError(413, f"batch size {len(inputs)} > maximum allowed batch size "
                                  f"{limits.max_client_batch_size} (--max-client-batch-size)", param=param)

    async def text_rows(texts: list, truncate: bool) -> tuple[list[Encoding], torch.Tensor]:
        """The texts' token ids and the model's output rows for them: tokenized and queued in the app's thread pool,
        where the model worker takes them from, and the event loop woken once, by the rows; 413 for too many texts,
        or for one too long without `truncate`."""
        check_count(texts)
        answer = Future()  # (encodings, rows) or the request's error: set by the tokenizing thread or the model worker
        pool.submit(tokenize_and_queue, texts, truncate, answer)
        return await asyncio.wrap_future(answer)

    def tokenize_and_queue(texts: list, truncate: bool, answer: Future) -> None:
        if not answer.set_running_or_notify_cancel():  # the request is gone; running, it can no longer be cancelled
            return
        try:
            encodings = engine.encode(texts, max_input_length if truncate else None)
            rows = queue([check_length(e, i) for i, e in enumerate(encodings)])
        except Exception as error:  # 413, 429, or the tokenizer's own
            answer.set_exception(error)
            return

        def pass_on(done: Future) -> None:  # on the model worker, as the batch ends
            if (error := done.exception()) is not None:
                answer.set_exception(backend_error(error))
            else:
                answer.set_result((encodings, done.result()))

        rows.add_done_callback(pass_on)

    def check_length(encoding, index: int):
        if len(encoding.ids) > max_input_length:
            raise RouteError(413, f"input {index} has {len(encoding.ids)} tokens, more than the "
                                  f"{max_input_length} allowed (--max-input-length); pass truncate: true to cut it",
                             param="inputs")
        return encoding

    def queue(encodings: list) -> Future:
        """The future of these inputs' rows, queued for the model: 429 when the queue is full."""
        future = batcher.submit(encodings)
        if future is None:
            raise overloaded(batcher)
        return future

    async def rows_of(future: Future) -> torch.Tensor:
        try:
            return await asyncio.wrap_future(future)
        except Exception as error:
            raise backend_error(error) from error

    def needs(kinds: tuple[str, ...], route: str) -> None:
        if engine.kind not in kinds:
            raise RouteError(400, f"{route} needs {article(kinds[0])} {' or '.join(kinds)} model; {engine.model_id} "
                                  f"is {article(engine.kind)} {engine.kind} model")

    @app.exception_handler(RouteError)
    async def route_error(request: Request, error: RouteError):
        return error_response(request.url.path, error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        errors = error.errors()
        first = errors[0]
        if first["type"] == "json_invalid":
            message, field = f"body: not valid JSON ({first['ctx']['error']} at character {first['loc'][-1]})", "body"
        else:  # every way the field failed (a union's branches), and what came
            field = str(first["loc"][1]) if len(first["loc"]) > 1 else "body"
            expected = dict.fromkeys(e["msg"] for e in errors if (e["loc"][1:2] or ("body",))[0] == field)
            message = f"{field}: {'; or '.join(expected)} (got {type(first.get('input')).__name__})"
        return error_response(request.url.path, RouteError(422, message, param=field))

    @app.post("/embed")
    async def embed(body: Embed):
        needs(("embedding",), "/embed")
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        _, rows = await text_rows(texts, body.truncate)
        return JSON((normalize(rows) if body.normalize else rows).numpy())

    @app.post("/predict")
    async def predict(body: Predict):
        answers, single = await predictions(body)
        return JSON(answers[0] if single else answers)

    async def predictions(body: Predict) -> tuple[list, bool]:
        """Each input's labels and scores, best first; and whether the request held one input."""
        needs(("classifier", "reranker"), "/predict")
        inputs = body.inputs
        single = isinstance(inputs, str) or (len(inputs) == 2 and all(isinstance(t, str) for t in inputs))
        if single:  # a text, or two strings: one pair, as text-embeddings-inference reads them
            texts = [inputs if isinstance(inputs, str) else tuple(inputs)]
        else:
            if any(not isinstance(t, str) and len(t) not in (1, 2) for t in inputs):
                raise RouteError(422, "inputs: each input is a text, or a list of one or two texts (a pair)",
                                 param="inputs")
            texts = [t if isinstance(t, str) else t[0] if len(t) == 1 else tuple(t) for t in inputs]
        _, rows = await text_rows(texts, body.truncate)
        scores = engine.scores(rows.view(len(texts), -1), body.raw_scores)
        labels = engine.config.id2label
        answers = [sorted(({"score": s, "label": labels[i]} for i, s in enumerate(row.tolist())),
                          key=lambda a: -a["score"]) for row in scores]
        return answers, single

    @app.post("/rerank")
    async def rerank(body: Rerank):
        needs(("reranker",), "/rerank")
        _, rows = await text_rows([(body.query, text) for text in body.texts], body.truncate)
        scores = rows if body.raw_scores else rows.sigmoid()
        ranked = sorted(range(len(body.texts)), key=lambda i: -scores[i].item())
        return JSON([{"index": i, "score": scores[i].item(), **({"text": body.texts[i]} if body.return_text else {})}
                     for i in ranked])

    @app.post("/tokenize")
    async def tokenize(body: Tokenize):
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        try:
            tokens = await asyncio.get_running_loop().run_in_executor(pool, engine.tokens, texts,
                                                                      body.add_special_tokens)
        except ValueError as error:  # a tokenizer without offsets (not a fast one)
            raise RouteError(400, str(error)) from error
        return [[{"id": token, "text": text, "special": bool(special), "start": start if not special else None,
                  "stop": stop if not special else None}
                 for token, text, special, (start, stop) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets)]
                for e in tokens]

    @app.post("/v1/embeddings")
    async def openai_embeddings(body: OpenAIEmbeddings):
        needs(("embedding",), "/v1/embeddings")
        if body.encoding_format not in ("float", "base64"):
            raise RouteError(422, f"encoding_format: {body.encoding_format!r} is not 'float' or 'base64'",
                             param="encoding_format")
        given = [body.input] if isinstance(body.input, str) or (body.input and isinstance(body.input[0], int)) \
            else body.input
        if given and isinstance(given[0], str):
            encodings, rows = await text_rows(given, truncate=False)
        else:  # token ids, as OpenAI's clients send them for some models
            check_count(given, "input")
            encodings = [check_length(token_ids(ids), i) for i, ids in enumerate(given)]
            rows = await rows_of(queue(encodings))
        rows = normalize(rows).numpy()  # (B, H) float32
        data = [{"object": "embedding", "index": i,
                 "embedding": row if body.encoding_format == "float" else base64.b64encode(row.tobytes()).decode()}
                for i, row in enumerate(rows)]
        tokens = sum(len(e.ids) for e in encodings)
        return JSON({"object": "list", "data": data, "model": body.model or engine.model_id,
                     "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def token_ids(ids: list[int]) -> Encoding:
        vocabulary = engine.config.vocab_size
        if not ids or any(not 0 <= i < vocabulary for i in ids):
            raise RouteError(422, f"input: token ids must be in [0, {vocabulary})", param="input")
        return Encoding(list(ids), [0] * len(ids))

    @app.post("/")
    async def root(request: Request):
        """TEI's route for clients that post to the server's address: /embed or /predict by the model's kind."""
        try:
            payload = await request.json()
        except ValueError as error:
            raise RouteError(422, f"body: not JSON ({error})", param="body") from error
        if engine.kind == "embedding":
            return await embed(validated(Embed, payload))
        answers, _ = await predictions(validated(Predict, payload))
        return JSON(answers)  # a list per input, as huggingface_hub's InferenceClient reads it

    @app.get("/info")
    async def info():
        return {**engine.info(), "max_input_length": max_input_length, "max_batch_tokens": max_batch_tokens,
                "max_batch_requests": limits.max_batch_requests,
                "max_client_batch_size": limits.max_client_batch_size,
                "max_concurrent_requests": limits.max_concurrent_requests}

    @app.get("/health")
    async def health():
        """200 while the model worker runs (liveness and readiness: the model is loaded before the port opens)."""
        if not batcher.worker.is_alive():
            raise RouteError(503, "the model worker is not running", "Unhealthy")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(MeasureAndGuard, metrics=metrics, api_key=limits.api_key,
                       routes=frozenset(route.path for route in app.routes), batcher=batcher)
    return app


def backend_error(error: BaseException) -> RouteError:
    """The 500 of a request whose batch failed in the model."""
    return RouteError(500, f"the model failed on this request's batch: {error}", "Backend")


def overloaded(batcher: Batcher) -> RouteError:
    """The 429 of a request that finds the queue full."""
    return RouteError(429, f"the server is at its {batcher.max_concurrent_requests} waiting requests "
                           "(--max-concurrent-requests); retry later", "Overloaded")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def validated(model: type[BaseModel], payload):
    """`payload` as `model`, or the same 422 a route's own body gets."""
    from pydantic import ValidationError

    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from error


def error_response(route: str, error: RouteError) -> JSON:
    """An error in the shape of the route's API, with Retry-After on 429."""
    headers = {"Retry-After": "1"} if error.status == 429 else None
    if route.startswith("/v1/"):
        kind = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error"}.get(
            error.status, "invalid_request_error")
        body = {"error": {"message": error.message, "type": kind, "param": error.param, "code": None}}
    else:
        body = {"error": error.message, "error_type": error.error_type}
    return JSON(body, status_code=error.status, headers=headers)
