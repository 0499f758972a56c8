"""The report page: one list of blocks (headings, bullet lists, tables, plots) written out twice, as
Markdown (plots as PNG files beside it) and as one self-contained HTML file (plots as inline SVG).
The plots: accuracy against decode speed-up and against KV memory, one curve per method, vanilla
as the reference star, the Pareto front dashed."""

import html
import io
import logging
import os
import re

from sparsevllm.report.pareto import curves, pareto_front

logger = logging.getLogger(__name__)

# (row key, axis label, higher is better) of each panel's x
PLOTS = (("speedup", "decode speed-up over vanilla (x)", True),
         ("kv_memory_mib", "KV memory per request (MiB)", False))


def fmt(x, spec=".1f", suffix=""):
    return "-" if x is None else format(x, spec) + suffix


def mib(b):
    return None if b is None else b / 2**20


def status_text(row: dict) -> str:
    parts = []
    for half in ("accuracy", "speed"):
        s = row[f"{half}_status"]
        if s != "ok":
            # one line, and short: a traceback's tail must not break the table it sits in
            why = " ".join(str(row.get(f"{half}_error") or "").split())
            why = why if len(why) <= 300 else why[:297] + "..."
            parts.append(f"{half} **{s.upper()}**" + (f": {why}" if why else ""))
    return "; ".join(parts) or "ok"


def summary_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["method", "budget", "accuracy %", "vs vanilla", "recall", "decode tok/s", "speed-up", "TTFT ms",
            "KV read/step (tokens, % of vanilla)", "KV held/request (planned)", "KV peak/request (measured)",
            "Pareto speed / memory", "status"]

    def front(v):
        return "-" if v is None else ("yes" if v else "no")

    body = []
    for r in rows:
        read = "-" if r["kv_tokens_read"] is None else (
            f"{r['kv_tokens_read']:,.0f} ({fmt(r['read_share'], '.0%')})")
        body.append([r["method"], "-" if r["budget"] is None else str(r["budget"]), fmt(r["accuracy"]),
                     fmt(r["accuracy_delta"], "+.1f") if r["method"] != "vanilla" else "ref",
                     fmt(r["recall"], ".3f"), fmt(r["decode_tok_s"], ",.1f"),
                     fmt(r["speedup"], ".2f", "x"), fmt(None if r["ttft_s"] is None else r["ttft_s"] * 1e3, ",.1f"),
                     read, fmt(mib(r["kv_bytes_held"]), ",.2f", " MiB"),
                     fmt(mib(r["kv_bytes_measured"]), ",.2f", " MiB"),
                     f"{front(r['pareto_speed'])} / {front(r['pareto_memory'])}", status_text(r)])
    return head, body


def task_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    keys = list(dict.fromkeys(k for r in rows for k in r["per_task"]))
    head = ["method", "budget", *keys, "mean", "recall"]
    body = [[r["method"], "-" if r["budget"] is None else str(r["budget"]),
             *(fmt(r["per_task"].get(k)) for k in keys), fmt(r["accuracy"]), fmt(r["recall"], ".3f")]
            for r in rows]
    return head, body


def plot_figure(rows: list[dict]):
    """The two Pareto panels as a matplotlib figure, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [dict(r, kv_memory_mib=mib(r.get("kv_memory_bytes"))) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (x, xlabel, higher) in zip(axes, PLOTS):
        for method, pts in curves(rows, x).items():
            xs, ys, budgets = zip(*pts)
            if method == "vanilla":
                ax.scatter(xs, ys, marker="*", s=180, color="black", zorder=4, label="vanilla")
                continue
            ax.plot(xs, ys, marker="o", label=method)
            for px, py, b in pts:
                ax.annotate(str(b), (px, py), textcoords="offset points", xytext=(4, 4), fontsize=7)
        have = [(r[x], r["accuracy"]) for r in rows if r.get(x) is not None and r.get("accuracy") is not None]
        front = sorted(have[i] for i in pareto_front(have, higher))
        if len(front) > 1:
            ax.plot(*zip(*front), linestyle="--", color="grey", alpha=0.7, label="Pareto front")
        xs = [p[0] for p in have if p[0] > 0]
        if not higher and xs and max(xs) / min(xs) > 20:   # 8B at 32K: vanilla GiB against SnapKV MiB
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy % (mean over tasks and lengths)")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0].set_title("accuracy vs decode speed")
    axes[1].set_title("accuracy vs KV memory")
    fig.tight_layout()
    return fig


def save_plots(rows: list[dict], out_dir: str) -> tuple[str | None, str | None]:
    """(PNG file name, inline SVG text); (None, None) without matplotlib or on a plotting error,
    which must not lose the tables."""
    if not any(r.get("accuracy") is not None for r in rows):   # nothing to place on either axis
        return None, None
    try:
        fig = plot_figure(rows)
        if fig is None:
            return None, None
        import matplotlib.pyplot as plt
        fig.savefig(os.path.join(out_dir, "pareto.png"), dpi=110)
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
        plt.close(fig)
        svg = buf.getvalue()
        return "pareto.png", svg[svg.index("<svg"):]
    except Exception:
        logger.exception("plotting failed")
        return None, None


# ---- the two writers ------------------------------------------------------------------------------
def to_markdown(blocks: list[tuple]) -> str:
    out = []
    for kind, *args in blocks:
        if kind == "h":
            out += ["#" * args[0] + " " + args[1], ""]
        elif kind == "p":
            out += [args[0], ""]
        elif kind == "list":
            out += [f"- {item}" for item in args[0]] + [""]
        elif kind == "table":
            head, body = args
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body] + [""]
        elif kind == "plot" and args[0]:
            out += [f"![accuracy vs speed-up and vs KV memory]({args[0]})", ""]
    return "\n".join(out)


def inline(text: str) -> str:
    """Markdown's inline code and bold, escaped, as HTML."""
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)


STYLE = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
         "table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px}"
         "th{background:#f3f3f3}code{background:#f3f3f3;padding:0 3px}svg{max-width:100%;height:auto}")


def to_html(blocks: list[tuple], title: str) -> str:
    out = ["<!DOCTYPE html>", "<html><head><meta charset='utf-8'>", f"<title>{html.escape(title)}</title>",
           f"<style>{STYLE}</style></head><body>"]
    for kind, *args in blocks:
        if kind == "h":
            out.append(f"<h{args[0]}>{inline(args[1])}</h{args[0]}>")
        elif kind == "p":
            out.append(f"<p>{inline(args[0])}</p>")
        elif kind == "list":
            out.append("<ul>" + "".join(f"<li>{inline(i)}</li>" for i in args[0]) + "</ul>")
        elif kind == "table":
            head, body = args
            out.append("<table><tr>" + "".join(f"<th>{inline(h)}</th>" for h in head) + "</tr>")
            out += ["<tr>" + "".join(f"<td>{inline(c)}</td>" for c in row) + "</tr>" for row in body]
            out.append("</table>")
        elif kind == "plot" and args[1]:
            out.append(args[1])
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# ---- the page ---------------------------------------------------------------------------------------
def definitions(meta: dict) -> list[str]:
    knobs = ", ".join(f"{m}: `{k}`" for m, k in meta["budget_knobs"].items())
    return [
        f"**budget**: one number for every method, the tokens a decode step may attend to (SnapKV: the "
        f"prompt tokens it keeps), set through each method's knob ({knobs}).",
        "**KV read/step**: KV tokens one request reads per decode step, the method's own "
        "`decode_kv_tokens_read` (dense filter/full layers and metadata included, averaged over layers "
        "and over the speed case's decode steps, the benchmark's roofline figure), on the speed model at "
        "the speed length; the percentage is of vanilla's.",
        "**KV held (planned)**: the method's `kv_tokens_held` (a request's peak device KV tokens) x K+V "
        "bytes per token of the speed model at its dtype; '-' where the method cannot say ahead (SnapKV).",
        "**KV peak (measured)**: the benchmark's peak `memory_accounting()['kv_used_bytes']` over the "
        "speed case's steps divided by its batch (device pool pages, so page rounding and metadata "
        "included). The memory plot uses it, or the planned figure where the speed cell did not run.",
        "**speed-up**: decode tok/s (the benchmark's stable window, every request admitted) over "
        "vanilla's on the same model, length, batch and output length.",
        "**accuracy**: the regression harness's accuracy % per task and length (greedy, the question "
        "before and after the context), and its mean over them; **vs vanilla**: points above (+) or "
        "below (-) vanilla's mean on the same prompts.",
        "**recall**: the mean share of the dense softmax attention mass the method's view keeps, sampled "
        "every N-th decode step of the accuracy runs (`RequestOutput.metrics['attention_recall']`), "
        "averaged over requests and cells; vanilla is 1.",
        "**Pareto front**: a cell no other cell beats on both accuracy and speed-up (or KV memory).",
    ]


def page(rows: list[dict], meta: dict, png: str | None, svg: str | None) -> list[tuple]:
    blocks = [("h", 1, meta["title"]), ("list", meta["header"])]
    if meta["notes"]:
        blocks += [("h", 2, "Notes"), ("list", meta["notes"])]
    blocks += [("h", 2, "Summary"), ("table", *summary_table(rows))]
    if png or svg:
        blocks += [("h", 2, "Pareto plots"),
                   ("p", "One curve per method, its points labelled with their budget; vanilla is the star; "
                         "the dashed line joins the Pareto front."), ("plot", png, svg)]
    else:
        blocks += [("p", "No plots: no cell has an accuracy, or matplotlib is missing or failed (see the log).")]
    blocks += [("h", 2, "Accuracy per task and length"), ("table", *task_table(rows))]
    bad = [r for r in rows if r["accuracy_status"] != "ok" or r["speed_status"] != "ok"]
    if bad:
        blocks += [("h", 2, "Failed, skipped or not run"), ("list", [f"{r['label']}: {status_text(r)}" for r in bad])]
    blocks += [("h", 2, "Definitions"), ("list", definitions(meta))]
    return blocks


def write_page(rows: list[dict], meta: dict, out_dir: str) -> dict[str, str]:
    png, svg = save_plots(rows, out_dir)
    blocks = page(rows, meta, png, svg)
    paths = {"markdown": os.path.join(out_dir, "report.md"), "html": os.path.join(out_dir, "report.html")}
    with open(paths["markdown"], "w") as f:
        f.write(to_markdown(blocks))
    with open(paths["html"], "w") as f:
        f.write(to_html(blocks, meta["title"]))
    return paths
