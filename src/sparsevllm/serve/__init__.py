"""The OpenAI-compatible server: `schema` (request bodies and errors), `app` (the routes),
`metrics` (Prometheus text) and `cli` (`python -m sparsevllm.serve`, `sparsevllm-serve`)."""
from sparsevllm.serve.cli import main

__all__ = ["build_app", "main"]


def __getattr__(name: str):
    if name == "build_app":   # FastAPI and the engine, imported when a server is built, not for --help
        from sparsevllm.serve.app import build_app
        return build_app
    raise AttributeError(f"module 'sparsevllm.serve' has no attribute {name!r}")
