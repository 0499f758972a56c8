"""One accuracy x speed x memory report over a grid of methods x budgets (issue #52):
`python -m sparsevllm.report`. Accuracy comes from the regression harness, speed from the
throughput benchmark, and every cell's KV reads and holdings from the methods' own accounting."""
