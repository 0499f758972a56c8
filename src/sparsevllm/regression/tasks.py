"""RULER-style synthetic tasks: needle-in-a-haystack (single, multi-key, multi-value) and
variable tracking, each generated from (seed, task, length, index) alone.

The question is stated before the haystack and again after it, so a query-aware method sees it
both when it scores the context and when it decodes.
"""

import random
from functools import partial

from sparsevllm.regression.prompts import PromptFormatter, Sample, fit_to_length
from sparsevllm.regression.text import (filler_sentences, random_key, random_value,
                                        random_variable_name)

# Needle depths (fraction of the haystack before the needle) a single-needle task cycles through.
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_TOKENS = {"number": 16, "word": 12, "uuid": 40}


def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    # A string seed is hashed with SHA-512 by `random`, so this is stable across processes and
    # independent of PYTHONHASHSEED.
    return random.Random(f"{seed}:{task}:{length}:{index}")


def _haystack(sentences: list[str], needles: list[tuple[float, str]], n: int) -> str:
    """The first n filler sentences with each needle inserted at its depth (0 = start, 1 = end)."""
    inserts = sorted(((round(depth * n), order, text) for order, (depth, text) in enumerate(needles)))
    parts, i = [], 0
    for position, _, text in inserts:
        parts.extend(sentences[i:position])
        parts.append(text)
        i = position
    parts.extend(sentences[i:n])
    return " ".join(parts)


def _fit(formatter, length, sentences, needles, render):
    unit_tokens = [len(ids) for ids in formatter.tokenizer(
        [" " + s for s in sentences], add_special_tokens=False)["input_ids"]]
    text, ids, n = fit_to_length(lambda n: render(_haystack(sentences, needles, n)),
                                 unit_tokens, formatter, length)
    assert n < len(sentences), "generator produced too little filler for the target length"
    return text, ids


def _filler_count(length: int) -> int:
    # Every filler sentence is at least 3 tokens, so this always over-provides.
    return length // 3 + 32


def niah(formatter: PromptFormatter, length: int, index: int, seed: int, *, name: str,
         kind: str, filler: str, num_keys: int = 1, num_values: int = 1) -> Sample:
    """Needles "One of the special magic {kind}s for {key} is: {value}." in a haystack; the question
    asks for the values of the first key. num_keys > 1 adds distractor keys (multi-key NIAH);
    num_values > 1 hides several values under the asked key (multi-value NIAH)."""
    rng = sample_rng(seed, name, length, index)
    sentences = filler_sentences(filler, _filler_count(length), rng)
    keys = []
    for _ in range(num_keys):
        keys.append(random_key(rng, set(keys)))
    key = keys[0]
    if num_values == 1:
        question = f"What is the special magic {kind} for {key} mentioned in the provided text?"
        answer_prefix = f"The special magic {kind} for {key} mentioned in the provided text is"
    else:
        question = f"What are all the special magic {kind}s for {key} mentioned in the provided text?"
        answer_prefix = f"The special magic {kind}s for {key} mentioned in the provided text are"
    intro = (f"Some special magic {kind}s are hidden within the following text. Make sure to "
             f"memorize them. I will quiz you about the {kind}s afterwards. {question}")

    def render(haystack):
        return f"{intro}\n\n{haystack}\n\n{question}", answer_prefix

    for _attempt in range(20):
        values, seen = [], set()
        for k in keys:
            for _ in range(num_values if k == key else 1):
                v = random_value(kind, rng)
                while v in seen:
                    v = random_value(kind, rng)
                seen.add(v)
                values.append((k, v))
        if num_keys == 1 and num_values == 1:
            depths = [DEPTHS[index % len(DEPTHS)]]
        else:
            depths = [rng.random() for _ in values]
        needles = [(d, f"One of the special magic {kind}s for {k} is: {v}.")
                   for d, (k, v) in zip(depths, values)]
        text, ids = _fit(formatter, length, sentences, needles, render)
        # A value that the filler happens to contain would make the answer ambiguous: redraw.
        if all(text.count(v) == 1 for _, v in values):
            break
    else:
        raise RuntimeError(f"{name}: could not place unique needle values")
    answers = [v for k, v in values if k == key]
    meta = {"needle_kind": kind, "filler": filler, "key": key, "depths": depths[:len(answers)],
            "num_keys": num_keys, "num_values": num_values, "prompt_tokens": len(ids)}
    return Sample(task=name, length=length, index=index, prompt=text, prompt_token_ids=ids,
                  answers=answers, metric="contains" if num_values == 1 else "contains_all",
                  max_tokens=MAX_TOKENS[kind] * num_values, meta=meta)


def variable_tracking(formatter: PromptFormatter, length: int, index: int, seed: int, *,
                      name: str, num_hops: int = 4) -> Sample:
    """One chain "VAR A = 12345. ... VAR B = A. ..." of num_hops + 1 variables in noise filler;
    the answer is every variable name holding the value (RULER's variable tracking)."""
    rng = sample_rng(seed, name, length, index)
    sentences = filler_sentences("noise", _filler_count(length), rng)
    value = str(rng.randint(10_000, 99_999))
    names = []
    for _ in range(num_hops + 1):
        names.append(random_variable_name(rng, set(names)))
    statements = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i]} = {names[i - 1]}." for i in range(1, len(names))]
    # Sorted depths keep the chain in reading order.
    needles = list(zip(sorted(rng.random() for _ in statements), statements))
    question = (f"Which variables are assigned the value {value}, directly or through other "
                "variables?")
    intro = ("Memorize and track the chain of variable assignments hidden in the following text. "
             + question)
    # Ending the prefix with "VAR" shows the answer's form; with RULER's prefix ending in a colon
    # SmolLM2-135M copied the filler instead of naming any variable (0/6 at 1K).
    answer_prefix = f"The variables that are assigned the value {value} are: VAR"

    def render(haystack):
        return f"{intro}\n\n{haystack}\n\n{question}", answer_prefix

    text, ids = _fit(formatter, length, sentences, needles, render)
    meta = {"value": value, "num_hops": num_hops, "prompt_tokens": len(ids)}
    return Sample(task=name, length=length, index=index, prompt=text, prompt_token_ids=ids,
                  answers=names, metric="contains_all", max_tokens=8 * len(names), meta=meta)


def _registry():
    tasks = {}
    for kind in ("number", "word", "uuid"):
        for filler in ("noise", "essay"):
            name = f"niah_single_{kind}_{filler}"
            tasks[name] = partial(niah, name=name, kind=kind, filler=filler)
    tasks["niah_multikey"] = partial(niah, name="niah_multikey", kind="number", filler="essay",
                                     num_keys=4)
    tasks["niah_multivalue"] = partial(niah, name="niah_multivalue", kind="number",
                                       filler="essay", num_values=4)
    tasks["variable_tracking"] = partial(variable_tracking, name="variable_tracking")
    return tasks


# name -> generator(formatter, length, index, seed) -> Sample
SYNTHETIC_TASKS = _registry()
