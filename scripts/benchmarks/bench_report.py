"""Reports of one benchmark run: speed-up against vanilla, the markdown summary and the plot."""
import os


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_vanilla = decode tok/s over vanilla's at the same (length, batch) in this run."""
    base = {(r["length"], r["batch"]): r.get("decode_tok_s") for r in rows if r["method"] == "vanilla"}
    for r in rows:
        ref = base.get((r["length"], r["batch"]))
        r["speedup_vs_vanilla"] = r["decode_tok_s"] / ref if ref and r.get("decode_tok_s") else None


def _fmt(value, scale=1.0, digits=1):
    if value is None:
        return "-"
    return f"{value * scale:,.{digits}f}"


def _bytes(value):
    if value is None:
        return "-"
    return f"{value / 2**30:,.2f} GiB" if value >= 2**30 else f"{value / 2**20:,.2f} MiB"


COLUMNS = ["method", "length", "batch", "status", "TTFT mean / max (ms)", "prefill tok/s", "decode tok/s",
           "ITL p50 / p99 (ms)", "peak dev mem", "KV used / pool", "graph", "decoded", "speed-up",
           "roofline tok/s", "% of roofline"]


def summary_markdown(rows: list[dict], header: dict) -> str:
    lines = ["# Sparse-vLLM throughput benchmark", ""]
    lines += [f"- **{k}**: {v}" for k, v in header.items()]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        acc = r.get("memory_accounting") or {}
        peak = r.get("memory_accounting_peak") or {}
        frac = r.get("roofline_fraction")
        cells = [r["method"], str(r["length"]), str(r["batch"]), r["status"],
                 f"{_fmt(r.get('ttft_mean_s'), 1e3)} / {_fmt(r.get('ttft_max_s'), 1e3)}",
                 _fmt(r.get("prefill_tok_s")), _fmt(r.get("decode_tok_s")),
                 f"{_fmt(r.get('itl_p50_ms'), 1, 2)} / {_fmt(r.get('itl_p99_ms'), 1, 2)}",
                 _bytes(r.get("peak_device_bytes")),
                 f"{_bytes(peak.get('kv_used_bytes'))} / {_bytes(acc.get('kv_pool_bytes'))}",
                 r.get("execution_mode") or "-", _fmt(r.get("decoded_tokens"), 1, 0),
                 _fmt(r.get("speedup_vs_vanilla"), 1, 2) + ("x" if r.get("speedup_vs_vanilla") else ""),
                 _fmt(r.get("roofline_tok_s")), _fmt(frac, 100, 1) + ("%" if frac is not None else "")]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed cases", ""]
        lines += [f"- {r['method']} length {r['length']} batch {r['batch']}: **{r['status']}**: {r.get('error')}"
                  for r in failed]
    notes = [r for r in rows if r["status"] == "ok" and not r.get("concurrent", True)]
    if notes:
        lines += ["", "Cases whose requests did not all run at once have no stable decode window: "
                  + ", ".join(f"{r['method']}/{r['length']}/{r['batch']}" for r in notes)]
    return "\n".join(lines) + "\n"


def _length_label(n: int) -> str:
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return f"{n / 1000:g}k" if n >= 1000 else str(n)


def plot(rows: list[dict], path: str, title: str) -> None:
    """Decode tok/s against prompt length, one line per method, one panel per batch size; vanilla's
    roofline dashed (GPU runs). Failed cases are left out of the lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        here = [r for r in rows if r["batch"] == batch]
        for method in dict.fromkeys(r["method"] for r in here):
            pts = sorted((r["length"], r["decode_tok_s"]) for r in here
                         if r["method"] == method and r["status"] == "ok" and r.get("decode_tok_s"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        # the roofline uses a GPU's bandwidth; next to CPU figures it would only flatten the plot
        roof = sorted({(r["length"], r["roofline_tok_s"]) for r in here if r["method"] == "vanilla"
                       and r["status"] == "ok" and (r.get("environment") or {}).get("gpu")})
        if roof:
            ax.plot(*zip(*roof), linestyle="--", color="grey", label="vanilla roofline")
        failed = sorted({r["length"] for r in here if r["status"] != "ok"})
        if failed:
            ax.scatter(failed, [0] * len(failed), marker="x", color="red", zorder=3, label="failed (see summary)")
        ax.set_xscale("log", base=2)
        lengths = sorted({r["length"] for r in here})
        ax.set_xticks(lengths, [_length_label(n) for n in lengths])
        ax.set_ylim(bottom=0)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("decode tok/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
