"""User datasets in LongBench's JSONL format.

One JSON object a line: `context` (the long document), `input` (the question; may be empty for
summarization), `answers` (a list of reference strings, or one string) and optionally `length`
and `_id`, which are recorded. The metric is chosen per file on the command line
(`path.jsonl:f1`); LongBench uses F1 for QA, ROUGE-L for summarization and string containment
for retrieval and classification.

A context longer than the target length is cut in the middle (LongBench's truncation: the start
and the end of a document carry its question-relevant framing), so one file yields a sample at
every length of the run.
"""

import json
import os

from sparsevllm.regression.grading import METRICS
from sparsevllm.regression.prompts import PromptFormatter, Sample, fit_to_length

DEFAULT_METRIC = "f1"
MAX_TOKENS = {"contains": 16, "contains_all": 64, "exact": 16, "f1": 32, "rouge_l": 128}


def parse_dataset_spec(spec: str) -> tuple[str, str, str]:
    """'path/name.jsonl[:metric]' -> (task label, path, metric). The label is the file's stem."""
    path, metric = spec, DEFAULT_METRIC
    head, sep, tail = spec.rpartition(":")
    if sep and head.endswith(".jsonl"):
        path, metric = head, tail
    if not path.endswith(".jsonl"):
        raise ValueError(f"--tasks: a dataset must be a .jsonl file, got {spec!r}")
    if metric not in METRICS:
        raise ValueError(f"--tasks: metric of {spec!r} must be one of {sorted(METRICS)}")
    if not os.path.isfile(path):
        raise ValueError(f"--tasks: dataset file {path!r} does not exist")
    return os.path.splitext(os.path.basename(path))[0], path, metric


def load_jsonl(path: str, limit: int) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if len(rows) == limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: a LongBench line is a JSON object, got {type(row).__name__}")
            answers = row.get("answers")
            if isinstance(answers, str):
                answers = [answers]
            if not isinstance(row.get("context"), str) or not answers or \
                    not all(isinstance(a, str) for a in answers):
                raise ValueError(f"{path}:{number}: a LongBench line needs a string 'context' "
                                 "and non-empty 'answers' (a string or a list of strings)")
            rows.append({**row, "answers": answers, "input": row.get("input") or ""})
    return rows


def _render(row: dict, context: str) -> tuple[str, str]:
    question = row["input"]
    if not question:
        return (f"Read the following text.\n\n{context}\n\nNow summarize the text above.",
                "Summary:")
    return (f"Read the following text and answer the question briefly.\n\nQuestion: {question}"
            f"\n\n{context}\n\nNow answer the question based on the text above.\n"
            f"Question: {question}", "Answer:")


def dataset_samples(label: str, path: str, metric: str, formatter: PromptFormatter,
                    length: int, num_samples: int) -> list[Sample]:
    tokenizer = formatter.tokenizer
    samples = []
    for index, row in enumerate(load_jsonl(path, num_samples)):
        ctx = tokenizer(row["context"], add_special_tokens=False)["input_ids"]

        def build(n, row=row, ctx=ctx):
            if n >= len(ctx):
                return _render(row, row["context"])
            head, tail = (n + 1) // 2, n // 2
            cut = tokenizer.decode(ctx[:head]) + (tokenizer.decode(ctx[-tail:]) if tail else "")
            return _render(row, cut)

        text, ids, n = fit_to_length(build, [1] * len(ctx), formatter, length)
        meta = {"prompt_tokens": len(ids), "context_tokens": len(ctx),
                "truncated": n < len(ctx), "source_length": row.get("length"),
                "id": row.get("_id")}
        samples.append(Sample(task=label, length=length, index=index, prompt=text,
                              prompt_token_ids=ids, answers=row["answers"], metric=metric,
                              max_tokens=MAX_TOKENS[metric], meta=meta))
    return samples
