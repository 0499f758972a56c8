"""Command-line tools that work with a model: python -m sparsevllm.tools.<name>."""
