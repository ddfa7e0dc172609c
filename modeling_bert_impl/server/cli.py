"""`bert-impl-serve MODEL`: serve a model over HTTP with text-embeddings-inference's and OpenAI's routes.

MODEL is a folder or a Hub id: bert-impl's, or stock BERT's, RoBERTa's, XLM-RoBERTa's or CamemBERT's, a
sentence-transformers folder of one (its pooling and normalization), a sequence classifier, or a cross-encoder (a
classifier with one label: /rerank). The engine is optimize_for_inference's in float32, or in bfloat16 by default where
the CPU has bfloat16 units (AMX, AVX512-BF16); --int8 quantizes, --compile compiles; on CUDA, the model itself.
"""

import argparse
import dataclasses
import gc
import logging
import os
import signal
import sys

from ..inference.packed_linear import bound_onednn_caches
from .engine import DTYPES, POOLINGS, EngineChoice
from .limits import Limits

logger = logging.getLogger("bert_impl.serve")
# oneDNN's two per-shape caches, entries each where the environment does not size them (the engines keep 256): a
# server's batches hold any number of tokens, so a shape kept is seldom met again, and 256 of them grew the process by
# about 300 MB under load (benchmarks/NOTES.md, "The server's memory under overload").
ONEDNN_CACHE_ENTRIES = 16


# The limits on what a client may send and for how long (docs/serving.md's table says which layer enforces each):
# flag, type, help; the default is `Limits`'.
LIMIT_FLAGS = [
    ("--payload-limit", int, "bytes of a request's body at most, as TEI's --payload-limit; more is answered 413"),
    ("--body-timeout", float, "seconds for a request's whole body to arrive; then 408 and the connection closed"),
    ("--max-header-bytes", int, "bytes of a request's line and headers at most; more is answered 431"),
    ("--max-headers", int, "header fields of a request at most; more is answered 431"),
    ("--header-timeout", float, "seconds for a request's headers to arrive; then 408 and the connection closed"),
    ("--max-connections", int, "connections (and requests in flight) at once; past it uvicorn answers 503"),
    ("--keep-alive", float, "seconds an idle connection is kept open"),
    ("--graceful-timeout", float, "seconds SIGTERM waits for the requests in flight before it closes every "
                                  "connection and exits"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bert-impl-serve", description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("model", help="a model folder or Hub id")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                                                             "0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="the products' dtype (default: bfloat16 where the CPU has bfloat16 units, else float32)")
    parser.add_argument("--int8", action="store_true", help="quantize_for_inference, calibrated on --calibration")
    parser.add_argument("--calibration", help="with --int8: a text file, one text a line, like those to be served")
    parser.add_argument("--compile", action="store_true",
                        help="compile_for_inference (in --dtype, or of the --int8 model); compiles for a minute or so "
                             "at start")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    parser.add_argument("--pooling", choices=list(POOLINGS), default=None,
                        help="an embedding model's pooling (default: its sentence-transformers config's, else cls)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="real tokens in one batch at most (default: 4096 on a CPU, 16384 on a GPU)")
    parser.add_argument("--max-batch-requests", type=int, default=None, help="inputs in one batch at most")
    parser.add_argument("--streams", type=positive, default=None,
                        help="model streams on the CPU: batches run at once, each on threads of its own (default: one "
                             "a thread the process may run; docs/serving.md says when to choose)")
    parser.add_argument("--threads-per-stream", type=positive, default=None,
                        help="threads of each stream's batches (default: the threads the process may run, divided "
                             "among the streams); a batch alone runs on every stream's threads")
    limits = Limits()  # the flags' defaults
    parser.add_argument("--max-client-batch-size", type=int, default=limits.max_client_batch_size,
                        help="inputs in one request at most")
    parser.add_argument("--max-concurrent-requests", type=int, default=limits.max_concurrent_requests,
                        help="requests waiting at most; more are answered 429 with Retry-After")
    parser.add_argument("--max-input-length", type=int, default=None,
                        help="tokens in one input at most (default and ceiling: the model's)")
    parser.add_argument("--api-key", default=os.environ.get("BERT_IMPL_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $BERT_IMPL_API_KEY; none: open)")
    for flag, kind, help_text in LIMIT_FLAGS:
        parser.add_argument(flag, type=kind, default=getattr(limits, flag[2:].replace("-", "_")),
                            help=help_text + " (default %(default)s)")
    parser.add_argument("--access-log", action="store_true",
                        help="log a line per request (uvicorn's access log; off by default: writing it costs a "
                             "request a tenth of a millisecond or more, and /metrics counts the requests)")
    args = parser.parse_args(argv)
    if args.int8 and not args.calibration:
        parser.error("--int8 needs --calibration FILE: texts like those to be served, one a line")
    if args.calibration and not args.int8:
        parser.error(f"--calibration {args.calibration} is read by --int8 only: add --int8, or leave it out")
    if args.calibration and not os.path.isfile(args.calibration):
        parser.error(f"--calibration {args.calibration}: no such file (texts like those to be served, one a line)")
    if args.device is not None and args.device.startswith("cuda") and (args.streams or 1) > 1:
        parser.error(f"--streams {args.streams}: a CUDA device runs one stream (its kernels are queued on the device)")
    if (problem := unloadable(args.model)) is not None:
        parser.error(problem)
    return args


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1")
    return value


def unloadable(model: str) -> str | None:
    """Why MODEL cannot be loaded, where that can be told before loading it: neither a folder nor a Hub id, or a Hub
    id that is not in the local cache while the Hub is off (HF_HUB_OFFLINE). None where it may load."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.isdir(model):
        return None
    if os.path.exists(model):
        return f"{model} is a file: MODEL is a model's folder (what save_pretrained writes) or a Hub id"
    try:
        validate_repo_id(model)
    except HFValidationError:
        return f"{model}: no such folder (nor is it a Hub id)"
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(model, "config.json"), str):
        return (f"{model}: no such folder, and as a Hub id it is not in the local Hub cache while HF_HUB_OFFLINE is "
                "set: give the model's folder, or download it first")
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import uvicorn

        from .app import create_app
        from .engine import Engine
    except ImportError as error:
        sys.exit(f"bert-impl-serve needs {error.name}, of bert-impl's `serve` extra: pip install 'bert-impl[serve]'")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    choice = EngineChoice(args.dtype, args.calibration if args.int8 else None, args.compile, args.device)
    bound_onednn_caches("bert-impl-serve", ONEDNN_CACHE_ENTRIES)  # read at oneDNN's first use: before the engine's
    try:
        engine = Engine(args.model, choice, args.pooling)
    except (OSError, ValueError) as error:  # a folder without a model, a Hub id not found or not reached, a config
        # transformers cannot read: said in a line, not a traceback from inside transformers or the Hub's client
        sys.exit(f"bert-impl-serve: cannot load {args.model}: {str(error).strip().splitlines()[0]}")
    limits = Limits(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Limits)})
    app = create_app(engine, limits)
    info, batcher = engine.info(), app.batcher
    streams = (f"{batcher.streams} model stream(s) of {batcher.threads_per_stream} thread(s), a batch alone on "
               f"{batcher.wide_threads}" if batcher.threads_per_stream else "one model stream")
    logger.info(f"{args.model}: {engine.kind} model, {info['engine']}, {info['model_dtype']}, {info['device']}, "
                f"{streams}")
    freeze_garbage_collector()
    serve(lambda: uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=args.access_log,
                              **uvicorn_limits(limits)), engine)


def uvicorn_limits(limits) -> dict:
    """uvicorn's arguments for the limits outside the app: its own, and its protocol with the guard on each request's
    head (protocol.py)."""
    from .protocol import guarded_protocol

    return {"limit_concurrency": limits.max_connections, "timeout_keep_alive": limits.keep_alive,
            "timeout_graceful_shutdown": limits.graceful_timeout, "http": guarded_protocol(limits)}


def serve(run, engine) -> None:
    """`run()` (uvicorn's server), then the model released however it ends (`release`). uvicorn's SIGTERM and SIGINT:
    stop taking connections, finish the requests in flight, end the lifespan (the model streams drain the queue), then
    raise the signal again: SIGTERM's handler here releases the model, then dies of it as before; SIGINT's
    KeyboardInterrupt passes through the `finally`."""

    def release_then_die(signum, frame):
        release(engine)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    previous = signal.signal(signal.SIGTERM, release_then_die)
    try:
        run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        release(engine)


def freeze_garbage_collector() -> None:
    """Set aside every object made so far (torch's, transformers', the model's: about 430,000 for all-MiniLM-L6-v2)
    from Python's cycle collector: `gc.freeze`, once loaded. Else each full collection walks them all, holding the GIL
    for a fifth of a second idle and longer under load, during which no request is answered and the model streams wait
    (benchmarks/NOTES.md, "The server's garbage collector"). Objects made later are collected as before."""
    gc.collect()
    gc.freeze()


def release(engine) -> None:
    """After serving: the engine's model released (the app, which keeps the engine, may outlive serving), and
    what `freeze_garbage_collector` set aside collected again and collected now, while the interpreter is whole.
    Frozen objects are never freed, not even at exit, so a compiled model's program left behind the folder it unpacked
    its package into (tens of MB in the temporary directory) at each start."""
    engine.close()
    gc.unfreeze()
    gc.collect()


if __name__ == "__main__":
    main()
