"""The report's rows (one per method x budget cell: accuracy, recall, speed, KV accounting), the
speed-up over vanilla and the Pareto fronts. Pure functions over plain dicts, so the page can be
rebuilt and tested from stored results alone."""


def pareto_front(points: list[tuple[float, float]], x_higher_is_better: bool = True) -> set[int]:
    """Indices of the points no other point beats: at least as good on both axes and better on one.
    y (accuracy) is always higher-better; x is speed-up (higher) or memory (lower)."""
    sign = 1 if x_higher_is_better else -1
    front = set()
    for i, (x, y) in enumerate(points):
        dominated = any(sign * qx >= sign * x and qy >= y and (sign * qx > sign * x or qy > y)
                        for j, (qx, qy) in enumerate(points) if j != i)
        if not dominated:
            front.add(i)
    return front


def speed_fields(record: dict | None) -> dict:
    """A speed cell's record -> decode tok/s, TTFT and the measured peak KV bytes per request."""
    row = (record or {}).get("row") or {}
    out = {"speed_status": (record or {}).get("status", "not run"), "speed_error": (record or {}).get("error"),
           "decode_tok_s": None, "ttft_s": None, "kv_bytes_measured": None}
    if out["speed_status"] != "ok":
        return out
    peak = row.get("memory_accounting_peak") or {}
    used = peak.get("kv_used_bytes")
    out.update(decode_tok_s=row.get("decode_tok_s"), ttft_s=row.get("ttft_mean_s"),
               kv_bytes_measured=None if used is None else used / row["batch"])
    return out


def build_rows(cells, accuracy: dict, speed: dict, accounting: dict) -> list[dict]:
    """One row per cell, in the grid's order; a cell missing from a half is 'not run' there."""
    rows = []
    for cell in cells:
        acc = accuracy.get(cell) or {"status": "not run", "accuracy": None, "recall": None, "per_task": {}}
        row = {"method": cell.method, "budget": cell.budget, "label": cell.label,
               "accuracy": acc.get("accuracy"), "accuracy_status": acc["status"], "accuracy_error": acc.get("error"),
               "per_task": acc.get("per_task", {}), "recall": acc.get("recall")}
        row.update(speed_fields(speed.get(cell)))
        row.update(accounting.get(cell) or {"kv_tokens_read": None, "kv_bytes_read": None, "kv_tokens_held": None,
                                            "kv_bytes_held": None})
        rows.append(row)
    add_relative(rows)
    mark_pareto(rows)
    return rows


def add_relative(rows: list[dict]) -> None:
    """Speed-up and accuracy drop against vanilla, and the KV memory a row is plotted at: the
    measured peak per request where its speed cell ran, else the planned figure."""
    ref = next((r for r in rows if r["method"] == "vanilla"), {})
    for r in rows:
        base, dec = ref.get("decode_tok_s"), r.get("decode_tok_s")
        r["speedup"] = dec / base if base and dec else None
        a, b = r.get("accuracy"), ref.get("accuracy")
        r["accuracy_delta"] = None if a is None or b is None else round(a - b, 9)
        if r.get("kv_bytes_measured") is not None:
            r["kv_memory_bytes"], r["kv_memory_source"] = r["kv_bytes_measured"], "measured"
        else:
            r["kv_memory_bytes"] = r.get("kv_bytes_held")
            r["kv_memory_source"] = "planned" if r["kv_memory_bytes"] is not None else None
        read, vread = r.get("kv_tokens_read"), ref.get("kv_tokens_read")
        r["read_share"] = read / vread if read is not None and vread else None


def mark_pareto(rows: list[dict]) -> None:
    """pareto_speed / pareto_memory: on the front of accuracy against speed-up / KV memory, among
    the rows that have both figures (None where a row lacks one)."""
    for key, x, higher in (("pareto_speed", "speedup", True), ("pareto_memory", "kv_memory_bytes", False)):
        have = [r for r in rows if r.get(x) is not None and r.get("accuracy") is not None]
        front = pareto_front([(r[x], r["accuracy"]) for r in have], higher)
        for r in rows:
            r[key] = None
        for i, r in enumerate(have):
            r[key] = i in front


def curves(rows: list[dict], x: str) -> dict[str, list[tuple[float, float, int | None]]]:
    """method -> [(x, accuracy, budget)] sorted by budget: one curve per method on a Pareto plot."""
    out = {}
    for r in rows:
        if r.get(x) is not None and r.get("accuracy") is not None:
            out.setdefault(r["method"], []).append((r[x], r["accuracy"], r["budget"]))
    return {m: sorted(pts, key=lambda p: (p[2] is not None, p[2] or 0)) for m, pts in out.items()}
