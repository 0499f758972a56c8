"""Scoring an output against its references. Every metric returns a score in [0, 1].

- `contains`: 1 if any reference occurs in the output (case-insensitive); RULER's single-answer
  string match, also LongBench's retrieval/classification scoring.
- `contains_all`: the fraction of references that occur in the output (RULER's multi-answer match).
- `exact`: 1 if the normalized output equals a normalized reference (SQuAD normalization).
- `f1`: best token-level F1 against any reference (SQuAD / LongBench QA).
- `rouge_l`: best ROUGE-L F-measure (longest common token subsequence) against any reference
  (LongBench summarization).
"""

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """Lower case, no punctuation, no English articles, single spaces (SQuAD's normalization)."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def contains(output: str, answers: list[str]) -> float:
    out = output.lower()
    return float(any(a.lower() in out for a in answers))


def contains_all(output: str, answers: list[str]) -> float:
    out = output.lower()
    return sum(a.lower() in out for a in answers) / len(answers)


def exact(output: str, answers: list[str]) -> float:
    out = normalize(output)
    return float(any(out == normalize(a) for a in answers))


def _f1(pred: list[str], ref: list[str]) -> float:
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1(output: str, answers: list[str]) -> float:
    pred = normalize(output).split()
    return max(_f1(pred, normalize(a).split()) for a in answers)


def _lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(output: str, answers: list[str]) -> float:
    pred = normalize(output).split()
    best = 0.0
    for a in answers:
        ref = normalize(a).split()
        lcs = _lcs(pred, ref)
        if lcs:
            precision, recall = lcs / len(pred), lcs / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


METRICS = {"contains": contains, "contains_all": contains_all, "exact": exact, "f1": f1,
           "rouge_l": rouge_l}


def score(metric: str, output: str, answers: list[str]) -> float:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    if not answers:
        raise ValueError("a sample needs at least one reference answer")
    return METRICS[metric](output, answers)
