"""The server's limits in one place: the app enforces some, protocol.py others, uvicorn the rest (cli.py passes them);
the command line takes its flags' defaults from here. No import beyond the standard library, so that
`bert-impl-serve --help` works without the `serve` extra."""

from dataclasses import dataclass


@dataclass
class Limits:
    """The server's limits, by text-embeddings-inference's names, and its model streams; None: the device's
    `BATCH_TOKENS`, the model's longest input, the streams `stream_plan` chooses."""

    max_batch_tokens: int | None = None
    max_batch_requests: int | None = None
    # the model streams (batching.py): None: chosen from the threads the process may run (`stream_plan`)
    streams: int | None = None
    threads_per_stream: int | None = None
    max_client_batch_size: int = 32
    max_concurrent_requests: int = 512
    max_input_length: int | None = None
    api_key: str | None = None
    payload_limit: int = 2_000_000  # bytes of a request's body, as text-embeddings-inference's --payload-limit
    body_timeout: float = 60.0  # seconds for a request's whole body to arrive (nginx's client_body_timeout's 60)
    # enforced on each request's head (protocol.py), before the app: its bytes, its header fields, its time
    max_header_bytes: int = 32768
    max_headers: int = 100
    header_timeout: float = 60.0
    # enforced by uvicorn (cli.py passes them), said by /info: connections at once past which uvicorn answers 503,
    # seconds an idle connection is kept, seconds a stop waits for the requests in flight
    max_connections: int = 1024
    keep_alive: float = 5.0
    graceful_timeout: float = 30.0
