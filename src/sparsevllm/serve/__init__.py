"""The OpenAI-compatible server: `schema` (request bodies and errors), `app` (the routes),
`metrics` (Prometheus text) and `cli` (`python -m sparsevllm.serve`, `sparsevllm-serve`)."""
from sparsevllm.serve.app import build_app
from sparsevllm.serve.cli import main

__all__ = ["build_app", "main"]
