"""Two settings of one swept knob compared sample by sample, from a regression run's samples.jsonl.

    python scripts/benchmarks/paired_samples.py OUT_DIR/samples.jsonl [--knob kv_cache_dtype] [--a auto] [--b fp8]

The harness's summary gives each variant's accuracy; at 20 samples a cell one sample is 5 points, so
whether two settings differ is better read from the samples they score differently. Rows pair the
same method, task, length and sample index under --a and --b; a markdown table per method, task and
length: both accuracies, outputs that are the same, and samples right under one setting only.
"""
import argparse
import json


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("samples", help="a regression run's samples.jsonl")
    ap.add_argument("--knob", default="kv_cache_dtype", help="the swept knob")
    ap.add_argument("--a", default="auto", help="its reference setting")
    ap.add_argument("--b", default="fp8", help="its compared setting")
    args = ap.parse_args(argv)
    by = {}
    with open(args.samples) as f:
        for line in f:
            r = json.loads(line)
            setting = str(r["sweep"].get(args.knob))
            if setting in (args.a, args.b) and r.get("error") is None:
                by[(r["method"], r["task"], r["length"], r["index"], setting)] = r
    cells = sorted({k[:3] for k in by})
    print(f"| method | task | length | {args.a} | {args.b} | same output | right under {args.a} only | "
          f"right under {args.b} only |")
    print("|---|---|---|---|---|---|---|---|")
    for cell in cells:
        pairs = [(by[(*cell, i, args.a)], by[(*cell, i, args.b)]) for i in sorted({k[3] for k in by if k[:3] == cell})
                 if (*cell, i, args.a) in by and (*cell, i, args.b) in by]
        if not pairs:
            continue
        n = len(pairs)
        acc_a, acc_b = (100 * sum(p[j]["score"] for p in pairs) / n for j in (0, 1))
        same = sum(a["output"] == b["output"] for a, b in pairs)
        only_a = sum(a["score"] > b["score"] for a, b in pairs)
        only_b = sum(b["score"] > a["score"] for a, b in pairs)
        print(f"| {cell[0]} | {cell[1]} | {cell[2]} | {acc_a:.1f} | {acc_b:.1f} | {same} / {n} | {only_a} | {only_b} |")


if __name__ == "__main__":
    main()
