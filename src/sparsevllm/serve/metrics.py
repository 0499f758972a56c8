"""/metrics: the engine's load and the server's latencies as Prometheus text (format 0.0.4)."""
import time

from sparsevllm.engine.async_engine import AsyncLLM


def prometheus(llm: AsyncLLM, model: str) -> str:
    eng, st = llm.engine, llm.stats
    cm = eng.cache_manager
    lines = []

    def metric(name, kind, help_, value):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f'{name}{{model="{model}"}} {value}'])

    def histogram(name, help_, h):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram"])
        for le, n in zip(h.bounds, h.counts):
            lines.append(f'{name}_bucket{{model="{model}",le="{le}"}} {n}')
        lines.append(f'{name}_bucket{{model="{model}",le="+Inf"}} {h.count}')
        lines.append(f'{name}_sum{{model="{model}"}} {h.sum}')
        lines.append(f'{name}_count{{model="{model}"}} {h.count}')

    metric("sparsevllm_num_requests_running", "gauge", "requests in the running batch", len(eng.scheduler.running))
    metric("sparsevllm_num_requests_waiting", "gauge", "requests waiting for admission", len(eng.scheduler.waiting))
    metric("sparsevllm_kv_pages_used", "gauge", "KV pages referenced", cm.num_pages - cm.allocator.num_free)
    metric("sparsevllm_kv_pages_total", "gauge", "KV pages in the pool", cm.num_pages)
    metric("sparsevllm_prompt_tokens_total", "counter", "prompt tokens received", st.prompt_tokens)
    metric("sparsevllm_generation_tokens_total", "counter", "tokens generated", st.generation_tokens)
    metric("sparsevllm_requests_finished_total", "counter", "requests finished", st.requests_finished)
    metric("sparsevllm_generation_tokens_per_second", "gauge", "tokens generated per second since start",
           st.generation_tokens / max(time.time() - st.started, 1e-9))
    histogram("sparsevllm_time_to_first_token_seconds", "time to first token", st.ttft)
    histogram("sparsevllm_inter_token_latency_seconds", "time between consecutive tokens", st.itl)
    if eng.config.recall_sample_every:
        histogram("sparsevllm_attention_recall", "per finished request, the mean share of the dense attention "
                  "mass its sparse views attend (recall_sample_every)", st.recall)
        histogram("sparsevllm_attention_recall_output_rel_error", "per finished request, the mean relative error of "
                  "the sparse attention output against the dense one", st.recall_error)
    return "\n".join(lines) + "\n"
