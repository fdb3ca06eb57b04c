"""OpenAI-compatible HTTP serving of an Engine: `python -m runtime serve BUNDLE` (needs the `serve` extra:
starlette, uvicorn, prometheus_client). `runtime.engine` itself needs none of them."""
