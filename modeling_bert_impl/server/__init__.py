"""bert-impl-serve: text-embeddings-inference's and OpenAI's HTTP routes over the CPU inference engine, with dynamic
batching. `Engine` (engine.py) loads a model and runs it; `Batcher` (batching.py) forms batches of concurrent requests;
`create_app` (app.py) is the ASGI app; `main` (cli.py) the console script. It uses the package's public functions only,
and needs the `serve` extra (uvicorn, pydantic, prometheus-client, orjson)."""
