"""bert-impl-serve over loopback: each route against the engine's direct answer (and sentence-transformers' for the
MiniLM checkpoint), with the clients users have (OpenAI's, huggingface_hub's InferenceClient, plain HTTP); each limit
and bad input with its status and message; the API key; concurrent clients each getting their own answer in shared
batches; a failing batch; SIGTERM with requests in flight. Servers run in this process (uvicorn in a thread, on a free
port of 127.0.0.1), but the SIGTERM test's, a `bert-impl-serve` subprocess."""

import base64
import hmac
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

pytest.importorskip("uvicorn")
import uvicorn  # noqa: E402

import modeling_bert_impl as bi  # noqa: E402
from modeling_bert_impl.server.app import Limits, create_app  # noqa: E402
from modeling_bert_impl.server.batching import Batcher  # noqa: E402
from modeling_bert_impl.server.cli import uvicorn_limits  # noqa: E402
from modeling_bert_impl.server.engine import Encoding, Engine, EngineChoice  # noqa: E402

FLOAT32 = EngineChoice(dtype="float32", device="cpu")
TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog near the river bank.", "Hello!",
         "Servers batch requests that arrive together."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`create_app(engine, limits)` served by uvicorn in a thread of this process, on 127.0.0.1."""

    def __init__(self, engine, limits: Limits = Limits()):
        self.app = create_app(engine, limits)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    **uvicorn_limits(limits)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def post(self, route: str, payload, headers: dict | None = None, raw: bytes | None = None):
        """(status, parsed JSON body, headers) of a POST."""
        data = raw if raw is not None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + route, data=data, method="POST",
                                         headers={"content-type": "application/json", **(headers or {})})
        return read(request)

    def get(self, route: str, headers: dict | None = None):
        return read(urllib.request.Request(self.url + route, headers=headers or {}))


def read(request):
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            body = response.read()
            status, headers = response.status, response.headers
    except urllib.error.HTTPError as error:
        body, status, headers = error.read(), error.code, error.headers
    try:
        return status, json.loads(body) if body else None, headers
    except ValueError:
        return status, body.decode(), headers


@pytest.fixture(scope="module")
def embedder(minilm_dir):
    return Engine(minilm_dir, FLOAT32)


@pytest.fixture(scope="module")
def served(embedder):
    server = Server(embedder, Limits(max_client_batch_size=8, max_input_length=64))
    yield server
    server.stop()


def small_folder(folder, minilm_dir, model_class, seed: int, **config):
    """A random small `model_class` (2 layers of 32) with MiniLM's tokenizer, saved in `folder`; the model."""
    torch.manual_seed(seed)
    config = bi.BertImplConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=37, **config)
    model = model_class(config).eval()
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(folder)
    return model


def served_head(tmp_path_factory, minilm_dir, num_labels: int):
    """A server of a random small sequence classifier (a cross-encoder with one label) with MiniLM's tokenizer, saved
    to a folder; the server, the model and the tokenizer, for a module's tests."""
    folder = tmp_path_factory.mktemp(f"head{num_labels}")
    model = small_folder(folder, minilm_dir, bi.BertImplForSequenceClassification, num_labels, num_labels=num_labels,
                         id2label={i: f"label_{i}" for i in range(num_labels)})
    server = Server(Engine(str(folder), FLOAT32))
    yield server, model, transformers.AutoTokenizer.from_pretrained(folder)
    server.stop()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, minilm_dir):
    yield from served_head(tmp_path_factory, minilm_dir, num_labels=3)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, minilm_dir):
    yield from served_head(tmp_path_factory, minilm_dir, num_labels=1)


def sentence_transformers_embeddings(minilm_dir, texts):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir, device="cpu").encode(texts, normalize_embeddings=True)


# --- routes against the engine's direct answer ---------------------------------------------------------------------
def test_embed_gives_sentence_transformers_embeddings(served, embedder, minilm_dir):
    status, got, _ = served.post("/embed", {"inputs": TEXTS})
    assert status == 200
    expected = sentence_transformers_embeddings(minilm_dir, TEXTS)
    assert np.abs(np.array(got) - expected).max() < 1e-5
    direct = embedder.run(embedder.encode(TEXTS))
    unnormalized = served.post("/embed", {"inputs": TEXTS, "normalize": False})[1]
    assert np.array_equal(np.array(unnormalized, dtype=np.float32), direct.numpy())  # float32's every bit, in JSON
    status, one, _ = served.post("/embed", {"inputs": TEXTS[0]})
    assert status == 200 and np.abs(np.array(one) - expected[:1]).max() < 1e-5
    assert embedder.pooling == "mean" and embedder.normalized


def test_openai_client_gets_the_same_embeddings_and_usage(served, minilm_dir):
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    expected = sentence_transformers_embeddings(minilm_dir, TEXTS)
    response = client.embeddings.create(input=TEXTS, model="minilm")  # the client asks for base64 and decodes it
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    assert np.abs(np.array([d.embedding for d in response.data]) - expected).max() < 1e-5
    tokens = sum(len(ids) for ids in transformers.AutoTokenizer.from_pretrained(minilm_dir)(TEXTS)["input_ids"])
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens and response.model == "minilm"
    status, body, _ = served.post("/v1/embeddings", {"input": TEXTS[0], "encoding_format": "float"})
    assert status == 200 and np.abs(np.array(body["data"][0]["embedding"]) - expected[0]).max() < 1e-5
    status, body, _ = served.post("/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(body["data"][1]["embedding"]), dtype=np.float32)
    assert np.abs(decoded - expected[1]).max() < 1e-5
    ids = transformers.AutoTokenizer.from_pretrained(minilm_dir)(TEXTS[2])["input_ids"]
    status, body, _ = served.post("/v1/embeddings", {"input": ids})  # token ids
    assert status == 200 and np.abs(np.array(body["data"][0]["embedding"]) - expected[2]).max() < 1e-5


def test_inference_client_feature_extraction_and_text_classification(served, classifier, minilm_dir, monkeypatch):
    import huggingface_hub
    from huggingface_hub import InferenceClient

    # the suite runs with HF_HUB_OFFLINE=1, which refuses every request of huggingface_hub's, this loopback one too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    got = InferenceClient(base_url=served.url).feature_extraction(TEXTS[1])
    assert np.abs(got.reshape(-1) - sentence_transformers_embeddings(minilm_dir, [TEXTS[1]])[0]).max() < 1e-5
    server, model, tokenizer = classifier
    answers = InferenceClient(base_url=server.url).text_classification(TEXTS[0])
    with torch.no_grad():
        probabilities = model(**tokenizer(TEXTS[0], return_tensors="pt")).logits.softmax(-1)[0]
    assert {a.label: a.score for a in answers} == pytest.approx(
        {f"label_{i}": p for i, p in enumerate(probabilities.tolist())}, abs=1e-5)


def test_predict_gives_the_heads_probabilities_sorted(classifier):
    server, model, tokenizer = classifier
    with torch.no_grad():
        logits = model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits
    status, answers, _ = server.post("/predict", {"inputs": TEXTS})
    assert status == 200 and len(answers) == len(TEXTS)
    for answer, row in zip(answers, logits.softmax(-1)):
        assert [a["score"] for a in answer] == sorted((a["score"] for a in answer), reverse=True)
        assert {a["label"]: a["score"] for a in answer} == pytest.approx(
            {f"label_{i}": p for i, p in enumerate(row.tolist())}, abs=1e-5)
    status, raw, _ = server.post("/predict", {"inputs": TEXTS[0], "raw_scores": True})  # one text: one answer
    assert {a["label"]: a["score"] for a in raw} == pytest.approx(
        {f"label_{i}": p for i, p in enumerate(logits[0].tolist())}, abs=1e-5)
    status, pair, _ = server.post("/predict", {"inputs": [TEXTS[0], TEXTS[1]], "raw_scores": True})  # two: a pair
    with torch.no_grad():
        pair_logits = model(**tokenizer(TEXTS[0], TEXTS[1], return_tensors="pt")).logits[0]
    assert {a["label"]: a["score"] for a in pair} == pytest.approx(
        {f"label_{i}": p for i, p in enumerate(pair_logits.tolist())}, abs=1e-5)


def test_rerank_scores_each_pair_with_the_cross_encoder(reranker):
    server, model, tokenizer = reranker
    query = "Where did the cat sit?"
    with torch.no_grad():
        logits = model(**tokenizer([query] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")).logits[:, 0]
    status, ranked, _ = server.post("/rerank", {"query": query, "texts": TEXTS, "return_text": True})
    assert status == 200 and [r["index"] for r in ranked] == logits.argsort(descending=True).tolist()
    for r in ranked:
        assert r["score"] == pytest.approx(logits[r["index"]].sigmoid().item(), abs=1e-5)
        assert r["text"] == TEXTS[r["index"]]
    status, raw, _ = server.post("/rerank", {"query": query, "texts": TEXTS, "raw_scores": True})
    assert [r["score"] for r in raw] == pytest.approx(logits.sort(descending=True).values.tolist(), abs=1e-5)
    assert "text" not in raw[0]


def test_tokenize_and_info(served, minilm_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    status, tokens, _ = served.post("/tokenize", {"inputs": TEXTS[0]})
    assert status == 200 and [t["id"] for t in tokens[0]] == tokenizer(TEXTS[0])["input_ids"]
    offsets = tokenizer(TEXTS[0], return_offsets_mapping=True)["offset_mapping"][1:-1]
    assert [(t["start"], t["stop"]) for t in tokens[0] if not t["special"]] == [tuple(o) for o in offsets]
    assert [t["text"] for t in tokens[0]] == tokenizer.convert_ids_to_tokens(tokenizer(TEXTS[0])["input_ids"])
    assert [t["special"] for t in tokens[0]] == [True] + [False] * len(offsets) + [True]
    texts = [f"{text} number {i}" for i in range(16) for text in TEXTS[:2]]
    with ThreadPoolExecutor(8) as pool:  # at once: each answer its own texts' tokens
        answers = list(pool.map(lambda t: served.post("/tokenize", {"inputs": t, "add_special_tokens": False}),
                                [texts[i:i + 2] for i in range(0, len(texts), 2)]))
    assert [[t["id"] for t in tokens] for _, got, _ in answers for tokens in got] == tokenizer(
        texts, add_special_tokens=False)["input_ids"]
    with pytest.MonkeyPatch.context() as patch:  # a slow tokenizer (no offsets): its reason, not a bare 500
        patch.setattr(served.app.engine, "backend", lambda max_length: None)
        status, body, _ = served.post("/tokenize", {"inputs": "x"})
    assert status == 400 and "/tokenize needs a fast (Rust) tokenizer" in body["error"]
    status, info, _ = served.get("/info")
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["model_dtype"] == "float32"
    assert info["max_input_length"] == 64 and info["max_client_batch_size"] == 8
    assert info["max_batch_tokens"] == 4096  # the CPU's default
    assert info["model_id"] == Path(minilm_dir).name and "/" not in info["model_id"]  # no path of the server's disk
    assert (info["payload_limit"], info["body_timeout"], info["max_header_bytes"], info["max_headers"],
            info["header_timeout"], info["max_connections"], info["keep_alive"], info["graceful_timeout"]) == (
        2_000_000, 60.0, 32768, 100, 60.0, 1024, 5.0, 30.0)
    assert served.get("/health")[0] == 200


def test_a_route_for_another_kind_of_model_says_so(served, classifier):
    status, body, _ = served.post("/predict", {"inputs": "x"})
    assert status == 400 and "/predict needs a classifier or reranker model" in body["error"]
    status, body, _ = classifier[0].post("/embed", {"inputs": "x"})
    assert status == 400 and body["error"].startswith("/embed needs an embedding model;")
    assert body["error"].endswith("is a classifier model")


# --- limits and bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route,payload,status,message", [
    ("/embed", {"inputs": ["a"] * 9}, 413, "batch size 9 > maximum allowed batch size 8 (--max-client-batch-size)"),
    ("/embed", {"inputs": "word " * 80}, 413, "input 0 has 82 tokens, more than the 64 allowed (--max-input-length); "
                                              "pass truncate: true to cut it"),
    ("/embed", {"inputs": []}, 422, "inputs cannot be empty"),
    ("/embed", {"inputs": 5}, 422, "inputs: Input should be a valid string; or Input should be a valid array "
                                   "(got int)"),
    ("/embed", {"texts": ["a"]}, 422, "inputs: Field required (got dict)"),
    ("/embed", {"inputs": "a", "normalize": "maybe"}, 422, "normalize: Input should be a valid boolean"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, 422, "encoding_format: 'int8' is not 'float' or "
                                                                       "'base64'"),
    ("/v1/embeddings", {"input": [[1, 2], [99999999]]}, 422, "input: token ids must be in [0, 30522)"),
])
def test_limits_and_bad_input_are_answered_with_what_is_wrong(served, route, payload, status, message):
    got, body, _ = served.post(route, payload)
    assert got == status
    said = body["error"]["message"] if route.startswith("/v1/") else body["error"]
    assert said.startswith(message), said
    if route.startswith("/v1/"):
        assert body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error_type"] == "Validation"


def test_openai_route_names_its_own_field_in_a_limits_answer(served):
    """OpenAI's route calls its texts `input`: the 413s of its limits name that field, not TEI's `inputs`."""
    for payload, message in [({"input": ["a"] * 9}, "batch size 9 > maximum allowed batch size 8"),
                             ({"input": "word " * 80}, "input 0 has 82 tokens"),
                             ({"input": [[7] * 70]}, "input 0 has 70 tokens")]:
        status, body, _ = served.post("/v1/embeddings", payload)
        assert status == 413 and body["error"]["message"].startswith(message), body
        assert body["error"]["param"] == "input"


def test_truncate_cuts_an_input_to_the_limit_and_malformed_json_is_named(served, embedder):
    status, got, _ = served.post("/embed", {"inputs": "word " * 80, "truncate": True})
    cut = embedder.tokenizer("word " * 80, truncation=True, max_length=64)["input_ids"]
    assert status == 200 and len(cut) == 64
    direct = torch.nn.functional.normalize(embedder.run([Encoding(cut, [0] * 64)]), dim=-1)
    assert np.abs(np.array(got) - direct.numpy()).max() < 1e-5
    status, body, _ = served.post("/embed", None, raw=b'{"inputs": ')
    assert status == 422 and body["error"].startswith("body: not valid JSON")


def test_the_api_key_is_required_where_set(embedder):
    server = Server(embedder, Limits(api_key="s3cret"))
    try:
        status, body, _ = server.post("/embed", {"inputs": "a"})
        assert status == 401 and "Authorization: Bearer" in body["error"]
        assert server.post("/embed", {"inputs": "a"}, {"authorization": "Bearer wrong"})[0] == 401
        assert server.post("/embed", {"inputs": "a"}, {"authorization": "Bearer s3cret"})[0] == 200
        status, body, _ = server.post("/v1/embeddings", {"input": "a"})
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert server.get("/health")[0] == 200 and server.get("/metrics")[0] == 200  # probes and scrapers
    finally:
        server.stop()


def test_the_key_is_compared_in_constant_time_and_its_scheme_in_any_case(embedder, monkeypatch):
    """`Authorization: <scheme> <key>`: the scheme Bearer in any case (HTTP's auth schemes are case-insensitive), one
    or more spaces, then the key exactly; the key compared by hmac.compare_digest, never by ==."""
    from modeling_bert_impl.server import app as app_module

    compared, compare = [], hmac.compare_digest
    monkeypatch.setattr(app_module.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or compare(a, b))
    server = Server(embedder, Limits(api_key="s3cret"))
    try:
        for value in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret", "Bearer   s3cret"):
            assert server.post("/embed", {"inputs": "a"}, {"authorization": value})[0] == 200, value
        for value in ("Bearer s3cre", "Bearer s3cretX", "Basic s3cret", "s3cret", "Bearer", "Bearers3cret",
                      "Bearer s3cret extra"):
            assert server.post("/embed", {"inputs": "a"}, {"authorization": value})[0] == 401, value
    finally:
        server.stop()
    assert (b"s3cret", b"s3cret") in compared and (b"s3cre", b"s3cret") in compared


def test_fields_take_their_json_types_only(served):
    """Booleans are JSON booleans and token ids JSON integers: a string, a number or a bool in their place is 422
    naming the field and what came (they were converted and answered 200); an empty list of ids has its own
    message."""
    for body in ({"inputs": "a", "normalize": "yes"}, {"inputs": "a", "normalize": "off"},
                 {"inputs": "a", "normalize": 0.0}, {"inputs": "a", "truncate": "yes"}, {"inputs": "a", "truncate": 1}):
        status, answer, _ = served.post("/embed", body)
        field = next(k for k in body if k != "inputs")
        assert status == 422 and answer["error"].startswith(f"{field}: Input should be a valid boolean"), answer
    for given in ([True, False], [1e3], [101.0], [["101", "102"]], [[101, True]]):
        status, answer, _ = served.post("/v1/embeddings", {"input": given})
        assert status == 422 and answer["error"]["param"] == "input", (given, answer)
    status, answer, _ = served.post("/v1/embeddings", {"input": [[]]})
    assert status == 422 and answer["error"]["message"] == "input: token id list 0 is empty"
    assert served.post("/v1/embeddings", {"input": [101, 7592, 102]})[0] == 200
    assert served.post("/embed", {"inputs": "a", "normalize": False, "truncate": True})[0] == 200


def raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 10) -> tuple[bytes, float]:
    """Send `head` then `body` on a new connection; the answer's bytes (until the server closes or stops sending) and
    the seconds from the end of `head` to the answer's first bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(head)
        sent = time.perf_counter()
        if body:
            connection.sendall(body)
        first = connection.recv(65536)
        took = time.perf_counter() - sent
        answer = first
        try:
            while chunk := connection.recv(65536):
                answer += chunk
        except (TimeoutError, ConnectionError):
            pass
        return answer, took


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads this process's RSS from /proc")
def test_a_body_over_the_payload_limit_is_refused_before_it_is_read(embedder):
    """--payload-limit: a Content-Length above it is answered 413 at once (a 10 GB promise with 1 KB sent, within
    100 ms of its headers); a chunked body is counted as it comes and refused once past it, the server's memory
    growing by about the limit (what it holds to parse), not by the 64 MB sent; a body within it is served."""
    limit = 4_000_000
    server = Server(embedder, Limits(payload_limit=limit))
    head = (b"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n")
    try:
        promise = head + b"content-length: 10000000000\r\n\r\n"
        answer, took = raw_request(server.port, promise, b'{"inputs": "a"' + b" " * 1000)
        assert answer.startswith(b"HTTP/1.1 413") and b"more than the 4000000 allowed (--payload-limit)" in answer
        assert took < 0.1, took
        before = rss_bytes()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
            connection.sendall(head + b"transfer-encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
            try:
                for _ in range(64):
                    connection.sendall(chunk)
            except ConnectionError:  # refused and closed part-way: what a server that stops reading does
                pass
            answer = connection.recv(65536)
        grown = rss_bytes() - before
        assert answer.startswith(b"HTTP/1.1 413") and grown < 2 * limit, (answer[:200], grown)  # it holds up to the
        # limit's bytes to parse them, and nothing past them: before, 50 MB sent grew it by 90 MB
        assert server.post("/embed", {"inputs": "a" + " " * 100_000})[0] == 200
    finally:
        server.stop()


def test_a_body_that_stops_coming_gets_408_within_the_body_timeout_while_others_are_served(embedder):
    """--body-timeout: ten clients that send half a body and then nothing get 408 once it is up, their connections
    closed, while a normal client keeps getting answers within 1 s."""
    server = Server(embedder, Limits(body_timeout=1.5))
    head = b"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    try:
        stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(10)]
        for connection in stalled:
            connection.sendall(head + b'{"inputs": ')
        start = time.monotonic()
        while time.monotonic() - start < 1.2:
            asked = time.monotonic()
            assert server.post("/embed", {"inputs": "a normal client"})[0] == 200
            assert time.monotonic() - asked < 1
        answers = []
        for connection in stalled:
            answer = b""
            while chunk := connection.recv(65536):
                answer += chunk
            answers.append(answer)  # read to the end: the server closed the connection
            connection.close()
        assert 1.5 <= time.monotonic() - start < 5
        assert all(a.startswith(b"HTTP/1.1 408") and b"within 1.5 s (--body-timeout)" in a for a in answers), answers
    finally:
        server.stop()


def test_heads_too_large_or_too_slow_are_refused_before_the_app_and_slow_clients_cannot_hold_the_server(embedder,
                                                                                                      monkeypatch):
    """--max-header-bytes and --max-headers: a 100 KB header, 1,000 headers and an unfinished 32 MB one get 431, read
    no further than the cap; --header-timeout: 200 connections sending a header a byte at a time are answered 408
    and closed once it is up, while a normal client keeps getting answers within 1 s; ordinary requests with their
    usual headers are served."""
    server = Server(embedder, Limits(header_timeout=2.0))
    start = b"GET /health HTTP/1.1\r\nhost: x\r\n"
    try:
        for head in (start + b"x-big: " + b"a" * 100_000 + b"\r\n\r\n",
                     start + b"".join(b"x-h%d: v\r\n" % i for i in range(1000)) + b"\r\n"):
            answer, _ = raw_request(server.port, head)
            assert answer.startswith(b"HTTP/1.1 431") and b"--max-header-bytes, --max-headers" in answer, answer[:99]
        protocol = server.server.config.http_protocol_class  # the guard, as uvicorn loaded it
        read, data_received = [], protocol.data_received
        monkeypatch.setattr(protocol, "data_received", lambda self, data: read.append(len(data)) or
                            data_received(self, data))
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as connection:
            connection.sendall(start + b"x-huge: ")
            sent = 0
            try:
                while sent < 32 << 20:
                    connection.sendall(b"a" * (1 << 20))
                    sent += 1 << 20
            except ConnectionError:
                pass
        # refused and closed at the cap: the server read one socket read past it, not the 32 MB (the client's sends
        # also fill the kernel's buffers, up to tcp_rmem's window, before the reset reaches it)
        assert 32768 < sum(read) < 1 << 20 and sent < 32 << 20, (sum(read), sent)
        slow = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(200)]
        opened = time.monotonic()
        byte = 0
        while time.monotonic() - opened < 1.5:  # a byte a connection every 0.3 s: each head still unfinished
            for connection in slow:
                connection.sendall(start[byte:byte + 1])
            asked = time.monotonic()
            assert server.get("/health")[0] == 200 and time.monotonic() - asked < 1
            byte += 1
            time.sleep(0.3)
        answers = []
        for connection in slow:
            answer = b""
            while chunk := connection.recv(65536):
                answer += chunk
            answers.append(answer)
            connection.close()
        assert 2.0 <= time.monotonic() - opened < 6
        assert all(a.startswith(b"HTTP/1.1 408") and b"within 2 s (--header-timeout)" in a for a in answers)
        headers = {f"x-ordinary-{i}": "v" * 100 for i in range(40)}  # 40 fields, 4 KB: served
        assert server.post("/embed", {"inputs": "a"}, headers)[0] == 200
    finally:
        server.stop()


def test_work_for_clients_that_left_is_dropped(embedder):
    """Requests whose clients disconnect while they wait in the queue are taken off it unrun, and counted (status
    499 and bert_impl_dropped_requests in /metrics); the model ran the first, held request only."""
    gated = GatedEngine(embedder)
    server = Server(gated)
    body = json.dumps({"inputs": [f"a sentence for nobody, number {i}" for i in range(32)]}).encode()
    head = b"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(server.post, "/embed", {"inputs": "one"})  # taken by the worker, held at the gate
            while not gated.held:
                time.sleep(0.01)
            leavers = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
            for connection in leavers:
                connection.sendall(head % len(body) + body)
            while len(server.app.batcher.queue) < 8:
                time.sleep(0.01)
            for connection in leavers:
                connection.close()
            deadline = time.monotonic() + 10
            while server.app.metrics.requests.labels("/embed", "499")._value.get() < 8:
                assert time.monotonic() < deadline, "the server did not notice its clients leave"
                time.sleep(0.01)
            gated.gate.set()
            assert first.result()[0] == 200
        assert server.post("/embed", {"inputs": "after"})[0] == 200
        metrics = server.get("/metrics")[1]
        assert 'bert_impl_requests_total{route="/embed",status="499"} 8.0' in metrics
        assert "bert_impl_dropped_requests_total 8.0" in metrics
        assert gated.batches == [1, 1], gated.batches  # "one", then "after": nothing of the 8 x 32 sentences
    finally:
        gated.gate.set()
        server.stop()


def test_idle_connections_close_after_keep_alive_and_connections_past_the_cap_get_503(embedder):
    """--keep-alive: an idle connection is closed after it; --max-connections: a request on a connection past the
    cap is answered 503 (uvicorn's limit_concurrency), the others served."""
    server = Server(embedder, Limits(keep_alive=1.0, max_connections=3))
    request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    try:
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        idle.sendall(request)
        assert idle.recv(65536).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert idle.recv(65536) == b""  # closed by the server
        assert 0.5 < time.monotonic() - start < 3
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(3)]
        time.sleep(0.2)
        answer, _ = raw_request(server.port, request)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:100]
        for connection in held:
            connection.close()
        time.sleep(0.2)
        assert server.get("/health")[0] == 200
    finally:
        server.stop()


class GatedEngine:
    """The embedder, its batches held until `gate` is set and recorded; a batch holding the text "fail" raises."""

    def __init__(self, engine):
        self.engine, self.gate, self.batches, self.held, self.encoded = engine, threading.Event(), [], 0, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def encode(self, *args):
        self.encoded += 1
        return self.engine.encode(*args)

    def run(self, encodings):
        self.held = len(encodings)  # taken by the worker
        self.gate.wait(timeout=60)
        self.batches.append(len(encodings))
        if any(e.ids == self.engine.tokenizer("fail")["input_ids"] for e in encodings):
            raise RuntimeError("a fault inside the model")
        return self.engine.run(encodings)


def test_a_full_queue_answers_429_with_retry_after(embedder):
    """While the queue is full, requests for the model get 429 with Retry-After in their API's shape, before their
    body is parsed or tokenized (a malformed one too); the connection stays usable, and other routes answer."""
    gated = GatedEngine(embedder)
    server = Server(gated, Limits(max_concurrent_requests=1))
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)

    def post_on_connection(payload: bytes):
        connection.request("POST", "/embed", payload, {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())

    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(server.post, "/embed", {"inputs": "one"})  # taken by the worker, held at the gate
            while not gated.held:
                time.sleep(0.01)
            second = pool.submit(server.post, "/embed", {"inputs": "two"})  # waits in the queue
            while not server.app.batcher.queue:
                time.sleep(0.01)
            status, body, headers = server.post("/embed", {"inputs": "three"})
            assert status == 429 and headers["Retry-After"] == "1" and body["error_type"] == "Overloaded"
            assert "--max-concurrent-requests" in body["error"]
            status, body, headers = server.post("/v1/embeddings", {"input": "three"})
            assert status == 429 and headers["Retry-After"] == "1" and body["error"]["type"] == "rate_limit_error"
            assert post_on_connection(b'{"inputs": ')[0] == 429  # refused before its body is parsed
            assert server.post("/tokenize", {"inputs": "three"})[0] == 200
            assert gated.encoded == 2  # the first two requests only
            gated.gate.set()
            assert first.result()[0] == second.result()[0] == 200
            status, body = post_on_connection(b'{"inputs": "four"}')  # the same connection, the queue free again
            assert status == 200 and len(body[0]) == 384
    finally:
        gated.gate.set()
        connection.close()
        server.stop()


def test_a_queue_filled_after_the_entry_check_answers_429_on_every_path(embedder, monkeypatch):
    """The queue may fill between a request's check at the door and its queueing (other requests being tokenized):
    it then gets 429 too, on the text path and on OpenAI's token-id path alike, not a 500."""
    server = Server(embedder)
    try:
        monkeypatch.setattr(server.app.batcher, "submit", lambda encodings, gone=bool: None)  # full by the time it queues
        ids = embedder.tokenizer("three")["input_ids"]
        for route, body in [("/embed", {"inputs": "three"}), ("/v1/embeddings", {"input": "three"}),
                            ("/v1/embeddings", {"input": ids}), ("/v1/embeddings", {"input": [ids, ids]})]:
            status, answer, headers = server.post(route, body)
            assert status == 429 and headers["Retry-After"] == "1", (route, body, status, answer)
    finally:
        server.stop()


def test_concurrent_clients_each_get_their_own_answer_from_shared_batches(embedder, minilm_dir):
    """32 clients at once, each its own input: each answer is its own input's embedding, and the model ran them in
    fewer batches than requests (the requests that came while one batch ran form the next)."""
    gated = GatedEngine(embedder)
    server = Server(gated, Limits(max_batch_requests=16))
    texts = [f"Client number {i} asks about {'the weather' if i % 2 else 'a long and winding road'} {i}."
             for i in range(32)]
    try:
        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(server.post, "/embed", {"inputs": text}) for text in texts]
            while gated.held + len(server.app.batcher.queue) < 32:  # a batch at the gate, the others queued
                time.sleep(0.01)
            gated.gate.set()
            answers = [f.result() for f in futures]
    finally:
        gated.gate.set()
        server.stop()
    expected = sentence_transformers_embeddings(minilm_dir, texts)
    for (status, got, _), want in zip(answers, expected):
        assert status == 200 and np.abs(np.array(got[0]) - want).max() < 1e-5
    batches = gated.batches
    assert sum(batches) == 32 and max(batches) <= 16 and len(batches) <= 4, batches  # max_batch_requests=16


def test_a_failing_batch_fails_its_own_requests_and_the_server_goes_on(embedder):
    gated = GatedEngine(embedder)
    gated.gate.set()
    server = Server(gated)
    try:
        status, body, _ = server.post("/embed", {"inputs": ["fine", "fail"]})
        assert status == 500 and body["error_type"] == "Backend" and "a fault inside the model" in body["error"]
        status, body, _ = server.post("/v1/embeddings", {"input": embedder.tokenizer("fail")["input_ids"]})
        assert status == 500 and body["error"]["type"] == "server_error"
        assert "a fault inside the model" in body["error"]["message"]
        assert server.post("/embed", {"inputs": "fine"})[0] == 200
        metrics = server.get("/metrics")[1]
        assert 'bert_impl_requests_total{route="/embed",status="500"} 1.0' in metrics
        assert 'bert_impl_requests_total{route="/embed",status="200"} 1.0' in metrics
        assert 'bert_impl_requests_total{route="/v1/embeddings",status="500"} 1.0' in metrics
    finally:
        server.stop()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compile_compiles_the_model_in_the_dtype_chosen(tmp_path, minilm_dir, monkeypatch, dtype):
    """`--compile` hands compile_for_inference the model as loaded and the dtype (bfloat16 too: the program's products
    in bfloat16); with `--int8`, the quantized model. compile_for_inference itself is recorded here, not run (its own
    tests compile)."""
    from modeling_bert_impl.server import engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "compile_for_inference",
                        lambda model, **kwargs: calls.append((type(model).__name__, kwargs)) or model)
    small_folder(tmp_path, minilm_dir, bi.BertImplModel, seed=0)
    folder = str(tmp_path)
    engine = Engine(folder, EngineChoice(dtype=dtype, compile=True, device="cpu"))
    assert calls == [("BertImplModel", {"dtype": getattr(torch, dtype)})]
    assert (engine.dtype, engine.engine) == (dtype, "compile_for_inference")
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("\n".join(TEXTS) + "\n")
    engine = Engine(folder, EngineChoice(int8_calibration=str(calibration), compile=True, device="cpu"))
    assert calls[1][1] == {} and engine.dtype == "int8"
    assert engine.engine == "compile_for_inference of quantize_for_inference (int8)"


def test_encode_gives_the_tokenizers_ids_and_types(embedder):
    """The engine's tokenizing (the fast tokenizer's Rust tokenizer, set up once per max_length) gives what the
    tokenizer's own call gives: texts, pairs and both in one request, cut or not, from several threads at once."""
    long = "word " * 300
    requests = [["hello world", "The cat sat on the mat.", long], [("a question?", "some passage " * 200), ("q", "p")],
                ["x", ("a", "b")], ["  spaced   text\twith tabs", "ÜNÏCÖDÉ ñ 東京"]]
    tokenizer = embedder.tokenizer

    def expected(texts, max_length):
        out = []
        for t in texts:
            first, second = ([t], None) if isinstance(t, str) else ([t[0]], [t[1]])
            given = tokenizer(first, second, truncation=max_length is not None, max_length=max_length,
                              return_token_type_ids=True)
            out.append(Encoding(given["input_ids"][0], given["token_type_ids"][0]))
        return out

    calls = [(texts, max_length) for texts in requests for max_length in (None, 64, 512)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda call: embedder.encode(*call), calls * 4))
    assert got == [expected(*call) for call in calls] * 4
    assert max(len(e.ids) for e in embedder.encode([long])) > 300  # uncut where no max_length is given


def test_batcher_keeps_to_its_token_and_input_limits():
    done = []
    batcher = Batcher(lambda encodings: (done.append([len(e.ids) for e in encodings]),
                                         torch.arange(len(encodings)))[1], max_batch_tokens=10,
                      max_batch_requests=3, max_concurrent_requests=100)
    jobs = [batcher.submit([Encoding([1] * n, [0] * n)]) for n in (4, 4, 4, 12, 1, 1, 1, 1)]
    batcher.start()
    batcher.stop()  # finishes what is queued
    assert done == [[4, 4], [4], [12], [1, 1, 1], [1]]  # 10 tokens, 3 inputs; a larger one alone
    assert [j.result().tolist() for j in jobs] == [[0], [1], [0], [0], [0], [1], [2], [0]]


def test_metrics_count_batches_and_requests(served):
    served.post("/embed", {"inputs": TEXTS})
    metrics = served.get("/metrics")[1]
    for name in ("bert_impl_queue_size", "bert_impl_batch_size_bucket", "bert_impl_batch_tokens_bucket",
                 'bert_impl_request_duration_seconds_bucket{le="0.005",route="/embed"}', "bert_impl_requests_total"):
        assert name in metrics
    assert served.get("/no/such/route-7")[0] == 404
    status, body, headers = served.get("/embed")
    assert status == 405 and body["error"] == "/embed takes POST, not GET" and headers["Allow"] == "POST"
    metrics = served.get("/metrics")[1]  # a path a client makes up is counted as "other", not a label of its own
    assert 'bert_impl_requests_total{route="other",status="404"}' in metrics and "route-7" not in metrics


def test_batcher_drops_the_jobs_of_cancelled_requests():
    done = []

    def batcher():
        return Batcher(lambda encodings: (done.append(len(encodings)), torch.arange(len(encodings)))[1],
                       max_batch_tokens=100, max_batch_requests=None, max_concurrent_requests=100)

    some, only = batcher(), batcher()
    jobs = [some.submit([Encoding([1, 2], [0, 0])]) for _ in range(4)]
    gone = [only.submit([Encoding([1], [0])]) for _ in range(2)]
    assert all(job.cancel() for job in [jobs[0], jobs[2], jobs[3], *gone])  # requests gone before the worker began
    some.start()
    only.start()
    assert jobs[1].result(timeout=30).tolist() == [0] and done == [1]
    assert only.submit([Encoding([1], [0])]).result(timeout=30).tolist() == [0]  # its worker waited on
    some.stop()
    only.stop()
    assert done == [1, 1] and not jobs[1].cancel()  # a job taken can no longer be cancelled


@pytest.mark.slow
def test_sigterm_finishes_the_requests_in_flight(minilm_dir):
    """The console script in a process of its own: SIGTERM while requests wait for the model answers every one of
    them (200, their own embeddings), then the process shuts down cleanly."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "modeling_bert_impl.server.cli", minilm_dir, "--port",
                                str(port), "--dtype", "float32", "--max-batch-requests", "8"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not (_listening(port) and read(urllib.request.Request(url + "/health"))[0] == 200):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        texts = [f"request {i}: " + "a long sentence about serving models " * 12 for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(read, urllib.request.Request(
                url + "/embed", data=json.dumps({"inputs": [text] * 8}).encode(), method="POST",
                headers={"content-type": "application/json"})) for text in texts]
            while "bert_impl_queue_size 0.0" in read(urllib.request.Request(url + "/metrics"))[1]:
                assert not all(f.done() for f in futures), "every request was answered before one waited"
                time.sleep(0.005)
            process.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        # uvicorn raises the signal again once it has shut down, so the exit is SIGTERM's, after a clean shutdown
        assert process.wait(timeout=120) in (0, -signal.SIGTERM)
        log = process.stdout.read()
        assert "Waiting for application shutdown." in log and "Application shutdown complete." in log, log
    finally:
        process.kill()
    expected = sentence_transformers_embeddings(minilm_dir, texts)
    for (status, got, _), want in zip(answers, expected):
        assert status == 200 and len(got) == 8 and np.abs(np.array(got[0]) - want).max() < 1e-5


@pytest.mark.slow
def test_sigterm_exits_within_the_graceful_timeout_whatever_a_client_holds_open(minilm_dir):
    """A client that sent half a body and then nothing holds its request open: SIGTERM still ends the console
    script within --graceful-timeout (2 s here, plus the model worker's stop), where it waited for that client."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "modeling_bert_impl.server.cli", minilm_dir, "--port",
                                str(port), "--dtype", "float32", "--graceful-timeout", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (_listening(port) and read(urllib.request.Request(f"http://127.0.0.1:{port}/health"))[0] == 200):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)) as holder:
            holder.sendall(b"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           b"content-length: 100\r\n\r\n{\"inputs\": ")
            time.sleep(0.5)
            process.send_signal(signal.SIGTERM)
            start = time.monotonic()
            status = process.wait(timeout=60)
            took = time.monotonic() - start
        assert status in (0, -signal.SIGTERM) and took < 2 + 3, (status, took, process.stdout.read())
    finally:
        process.kill()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_console_script_sizes_onednns_caches_loads_freezes_and_serves(monkeypatch, minilm_dir):
    """main() sizes oneDNN's per-shape caches where the environment does not (before the model's first use of
    oneDNN), loads the model, sets every object made so far aside from the cycle collector (gc.freeze), then serves:
    the collector's full passes no longer walk torch's and the model's objects. After serving it frees the model
    (released by the engine, gc.unfreeze, a collection) before it returns: frozen, a compiled program would never be
    freed, and would leave its unpacked package behind."""
    import gc
    import os
    import weakref

    from modeling_bert_impl.server import cli

    steps, loaded = [], []
    monkeypatch.setattr(os, "environ", {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"})  # set by the user: kept
    caches = lambda: (os.environ.get("LRU_CACHE_CAPACITY"), os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"])  # noqa: E731

    def load(*args):
        steps.append(("load", caches()))
        engine = Engine(minilm_dir, FLOAT32)  # an engine of this call's own, to see its model freed
        loaded.append(weakref.ref(engine.model))
        return engine

    monkeypatch.setattr("modeling_bert_impl.server.engine.Engine", load)
    monkeypatch.setattr(gc, "freeze", lambda: steps.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: steps.append("unfreeze"))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: steps.append(
        ("serve", type(app).__name__, {**kwargs, "http": kwargs["http"].__name__})))
    cli.main([minilm_dir, "--port", "8123"])
    assert steps == [("load", ("16", "64")), "freeze",
                     ("serve", "App", {"host": "127.0.0.1", "port": 8123, "log_level": "info", "access_log": False,
                                       "limit_concurrency": 1024, "timeout_keep_alive": 5.0,
                                       "timeout_graceful_shutdown": 30.0, "http": "GuardedProtocol"}),
                     "unfreeze"]
    assert loaded[0]() is None  # freed before main returned


def test_the_console_script_is_declared_and_parses(capsys, minilm_dir):
    import tomllib
    from pathlib import Path

    from modeling_bert_impl.server import cli

    scripts = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["bert-impl-serve"] == "modeling_bert_impl.server.cli:main"
    args = cli.parse_args([minilm_dir])
    assert (args.host, args.port, args.max_batch_tokens, args.max_client_batch_size, args.max_concurrent_requests) == (
        "127.0.0.1", 8080, None, 32, 512)
    assert not args.access_log and cli.parse_args([minilm_dir, "--access-log"]).access_log
    with pytest.raises(SystemExit):
        cli.parse_args([minilm_dir, "--int8"])
    assert "--int8 needs --calibration FILE" in capsys.readouterr().err


def refusal(capsys, *argv) -> str:
    """bert-impl-serve's one-line refusal of `argv` at argument parsing (exit status 2, no traceback)."""
    from modeling_bert_impl.server import cli

    with pytest.raises(SystemExit) as stop:
        cli.parse_args(list(map(str, argv)))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_a_model_that_cannot_load_is_refused_at_argument_parsing_in_one_line(capsys, tmp_path, monkeypatch):
    """A folder that does not exist, a file, a name that is no Hub id, and (offline, as the tests run) a Hub id not in
    the local cache: one line naming it, before anything loads. It was a 30-line traceback from the Hub's client (or,
    for a bare name online, 33 s of retries first)."""
    import huggingface_hub

    from modeling_bert_impl.server import cli

    missing = tmp_path / "nope"
    assert refusal(capsys, missing) == f"bert-impl-serve: error: {missing}: no such folder (nor is it a Hub id)"
    assert refusal(capsys, "../work/nope").endswith("../work/nope: no such folder (nor is it a Hub id)")
    (tmp_path / "weights.bin").write_bytes(b"")
    assert "weights.bin is a file: MODEL is a model's folder" in refusal(capsys, tmp_path / "weights.bin")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    line = refusal(capsys, "nope")
    assert "nope: no such folder, and as a Hub id it is not in the local Hub cache while HF_HUB_OFFLINE" in line
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # online: the loader tries, and is caught
    assert cli.unloadable("someone/some-model") is None


def test_a_folder_without_a_model_ends_in_one_line(tmp_path, monkeypatch):
    """A folder that exists but holds no model: transformers' OSError, said in one line as the server exits."""
    from modeling_bert_impl.server import cli

    monkeypatch.setattr(cli, "bound_onednn_caches", lambda *args: None)  # it sets this process's environment
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stop:
        cli.main([str(tmp_path / "empty")])
    message = str(stop.value.code)
    assert message.startswith(f"bert-impl-serve: cannot load {tmp_path / 'empty'}: ") and "\n" not in message


def test_calibration_is_refused_at_argument_parsing_when_missing_or_without_int8(capsys, tmp_path, minilm_dir):
    """--int8 with a calibration file that does not exist, and --calibration without --int8 (it was silently
    ignored): refused before the model loads, as --int8 without --calibration is."""
    line = refusal(capsys, minilm_dir, "--int8", "--calibration", tmp_path / "nope.txt")
    assert line.endswith(f"--calibration {tmp_path / 'nope.txt'}: no such file (texts like those to be served, one a "
                         "line)")
    texts = tmp_path / "texts.txt"
    texts.write_text("a sentence like those served\n")
    line = refusal(capsys, minilm_dir, "--calibration", texts)
    assert line.endswith(f"--calibration {texts} is read by --int8 only: add --int8, or leave it out")


def test_the_real_model_across_streams_over_http(minilm_dir, torch_threads):
    """The server with two one-thread streams (a batch alone on two threads): 64 clients at once, each its own
    sentence, get their own embeddings; /info and /metrics say what ran."""
    torch.set_num_threads(2)
    engine = Engine(minilm_dir, FLOAT32)
    server = Server(engine, Limits(streams=2, threads_per_stream=1))
    texts = [f"Client {i} writes about {['rivers', 'mountains', 'cities', 'the sea'][i % 4]} and number {i}."
             for i in range(64)]
    try:
        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(lambda text: server.post("/embed", {"inputs": text}), texts))
        info = server.get("/info")[1]
        metrics = server.get("/metrics")[1]
    finally:
        server.stop()
    expected = sentence_transformers_embeddings(minilm_dir, texts)
    for (status, got, _), want in zip(answers, expected):
        assert status == 200 and np.abs(np.array(got[0]) - want).max() < 1e-5
    assert (info["streams"], info["threads_per_stream"], info["threads"]) == (2, 1, 2)
    assert 'bert_impl_stream_batches_total{stream="0"' in metrics and "bert_impl_stream_busy_seconds_total" in metrics


def test_the_stream_flags_parse_and_bad_values_are_refused_in_one_line(capsys, minilm_dir):
    from modeling_bert_impl.server import cli

    args = cli.parse_args([minilm_dir, "--streams", "3", "--threads-per-stream", "2"])
    assert (args.streams, args.threads_per_stream) == (3, 2)
    assert (cli.parse_args([minilm_dir]).streams, cli.parse_args([minilm_dir]).threads_per_stream) == (None, None)
    assert refusal(capsys, minilm_dir, "--streams", "0").endswith("argument --streams: 0: at least 1")
    assert "invalid positive value: 'two'" in refusal(capsys, minilm_dir, "--threads-per-stream", "two")
    line = refusal(capsys, minilm_dir, "--device", "cuda", "--streams", "2")
    assert line.endswith("--streams 2: a CUDA device runs one stream (its kernels are queued on the device)")
