"""Runs every method variant over every task sample through the public `LLM` API.

One `LLM` is built per variant (a method with one value of each swept knob) and given whole
cells of samples at a time, so the engine batches them. Each finished sample is appended to
`samples.jsonl` at once; a rerun with the same output folder skips every sample whose key
(variant, task, length, index, prompt hash) is already there, so an interrupted run resumes.
"""

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

from tqdm.auto import tqdm

from sparsevllm.regression import report
from sparsevllm.regression.datasets import dataset_samples, parse_dataset_spec
from sparsevllm.regression.fidelity import FIDELITY_TOKENS, compare, fidelity_sample
from sparsevllm.regression.grading import score
from sparsevllm.regression.prompts import PromptFormatter, Sample
from sparsevllm.regression.records import append_records, read_records
from sparsevllm.regression.tasks import SYNTHETIC_TASKS
from sparsevllm.regression.variants import (Variant, expand_variants, list_valued_knobs,
                                             registered_methods)

logger = logging.getLogger(__name__)

FIDELITY_TASK = "fidelity"
# One needle of each kind; the word needle sits in noise because in the docs prose, full of quoted
# identifiers, SmolLM2-135M returns one of those instead (6/20 at 1K) while it finds numbers and
# UUIDs there.
DEFAULT_TASKS = ("niah_single_number_noise", "niah_single_word_noise", "niah_single_uuid_essay",
                 "niah_multikey", "niah_multivalue", "variable_tracking", FIDELITY_TASK)


@dataclass
class RunConfig:
    model: str | None = None
    methods: list[str] = field(default_factory=lambda: ["vanilla"])
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    samples: int = 20
    hyper_params: dict = field(default_factory=dict)
    out_dir: str = "regression_out"
    seed: int = 0
    chat_template: bool = True
    tolerance: float = 5.0       # allowed drop against vanilla, in accuracy points
    batch_size: int = 0          # samples handed to one generate() call; 0 = a whole cell
    fidelity_tokens: int = FIDELITY_TOKENS


def build_samples(tokenizer, config: RunConfig) -> list[Sample]:
    formatter = PromptFormatter(tokenizer, config.chat_template)
    samples = []
    for task in config.tasks:
        for length in config.lengths:
            if task == FIDELITY_TASK:
                samples += [fidelity_sample(tokenizer, length, i, config.seed,
                                            num_tokens=config.fidelity_tokens)
                            for i in range(config.samples)]
            elif task in SYNTHETIC_TASKS:
                samples += [SYNTHETIC_TASKS[task](formatter, length, i, config.seed)
                            for i in range(config.samples)]
            else:
                label, path, metric = parse_dataset_spec(task)
                samples += dataset_samples(label, path, metric, formatter, length, config.samples)
    return samples


def validate_tasks(tasks: list[str]) -> None:
    valid = [*SYNTHETIC_TASKS, FIDELITY_TASK]
    labels = {}
    for task in tasks:
        if task not in valid and ".jsonl" not in task:
            raise ValueError(f"--tasks: unknown task {task!r}; valid: {valid} or a "
                             "LongBench-format file 'path.jsonl[:metric]'")
        label = task if task in valid else parse_dataset_spec(task)[0]
        # Records and summary cells are keyed by the label (a dataset's file stem): two tasks
        # under one label would overwrite each other's records and share a cell.
        if label in labels or (task not in valid and label in valid):
            raise ValueError(f"--tasks: {task!r} and {labels.get(label, label)!r} would both be "
                             f"reported as task {label!r}; rename one of the files")
        labels[label] = task


def sample_key(variant: Variant, sample: Sample) -> str:
    return (f"{variant.label}|{variant.variant_id}|{sample.task}|{sample.length}|"
            f"{sample.index}|{sample.prompt_hash}")


def _still_valid(record: dict | None, sample: Sample) -> bool:
    """A stored record counts as done only if it was graded as this run grades the sample: the
    key holds the prompt, not the metric (`data.jsonl:f1` -> `:rouge_l`) or a dataset's edited
    answers, and a stale score would be reported under the new metric."""
    return (record is not None and record.get("metric") == sample.metric
            and record.get("expected") == sample.answers)


def load_tokenizer(model: str | None):
    from transformers import AutoTokenizer
    path = model
    if model is None or not os.path.isdir(model):
        from sparsevllm.default_model import resolve_model
        path = resolve_model(model)
    return AutoTokenizer.from_pretrained(path)


def check_knobs(model, variants: list[Variant]) -> None:
    """Validate every variant's knobs as LLM() will, before anything runs: a misspelt or
    out-of-range method knob would otherwise surface only once vanilla's whole run is done."""
    from sparsevllm.method_registry import make_config
    for v in variants:
        try:
            make_config(model, v.method, **v.knobs)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--hyper_params: {v.label}: {e}") from None


def default_llm_factory(model, method: str, knobs: dict):
    from sparsevllm import LLM
    return LLM(model, vllm_sparse_method=method, **knobs)


def _greedy(max_tokens: int):
    from sparsevllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


class Runner:
    def __init__(self, config: RunConfig, llm_factory=None, tokenizer=None):
        validate_tasks(config.tasks)
        if not config.lengths or any(n <= 0 for n in config.lengths):
            raise ValueError(f"--lengths must be positive token counts, got {config.lengths}")
        if config.samples <= 0:
            raise ValueError(f"--samples must be positive, got {config.samples}")
        self.config = config
        self.llm_factory = llm_factory or default_llm_factory
        self.variants = expand_variants(
            config.methods, config.hyper_params,
            None if llm_factory is not None else registered_methods(), list_valued_knobs())
        if llm_factory is None:
            check_knobs(config.model, self.variants)
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        os.makedirs(config.out_dir, exist_ok=True)
        self.records_path = os.path.join(config.out_dir, "samples.jsonl")
        self.reference_dir = os.path.join(config.out_dir, "fidelity_reference")

    # -- persistence ---------------------------------------------------------------------------
    def _load_records(self) -> dict[str, dict]:
        return read_records(self.records_path, "key")

    def _append(self, records: list[dict]) -> None:
        append_records(self.records_path, records)

    def _reference_path(self, variant: Variant, task: str, length: int) -> str:
        reference = next(v for v in self.variants if v.label == variant.reference)
        return os.path.join(self.reference_dir, f"{reference.variant_id}-{task}-{length}.pt")

    def _load_reference(self, variant: Variant, task: str, length: int) -> dict:
        path = self._reference_path(variant, task, length)
        import torch
        return torch.load(path) if os.path.exists(path) else {}

    def _write_status(self, status: str, started: float, errors: list[str]) -> None:
        run = {"status": status, "started": started, "updated": time.time(),
               "config": asdict(self.config),
               "variants": [asdict(v) | {"variant_id": v.variant_id} for v in self.variants],
               "errors": errors}
        with open(os.path.join(self.config.out_dir, "run.json"), "w") as f:
            json.dump(run, f, indent=2)

    # -- running -------------------------------------------------------------------------------
    def run(self) -> dict:
        started = time.time()
        self._write_status("running", started, [])
        samples = build_samples(self.tokenizer, self.config)
        done = {k: r for k, r in self._load_records().items() if r.get("error") is None}
        plan = []
        for variant in self.variants:
            todo = [s for s in samples if not _still_valid(done.get(sample_key(variant, s)), s)]
            if variant.method == "vanilla":
                todo += self._missing_references(variant, samples, todo)
            plan.append((variant, todo))
        total = sum(len(t) for _, t in plan)
        logger.info("%d samples to run (%d already done)", total,
                    len(samples) * len(self.variants) - total)
        errors = []
        try:
            with tqdm(total=total, desc="regression", unit="sample") as bar:
                for variant, todo in plan:
                    if todo:
                        errors += self._run_variant(variant, todo, bar)
        except BaseException:  # Ctrl-C included: finished samples are on disk, say so
            self._write_status("interrupted", started, errors)
            raise
        records = self._load_records()
        summary = report.write_reports(self.config, self.variants, samples, records,
                                       self.config.out_dir, sample_key,
                                       chat_template=PromptFormatter(
                                           self.tokenizer, self.config.chat_template).use_chat_template)
        self._write_status("failed" if errors else "complete", started, errors)
        return summary

    def _missing_references(self, variant, samples, todo) -> list[Sample]:
        """Vanilla fidelity samples marked done whose stored log-probs are gone must rerun."""
        queued = {id(s) for s in todo}
        missing, refs = [], {}
        for s in samples:
            if s.task != FIDELITY_TASK or id(s) in queued or variant.reference != variant.label:
                continue
            if s.length not in refs:
                refs[s.length] = self._load_reference(variant, s.task, s.length)
            cell = refs[s.length]
            if s.prompt_hash not in cell:
                missing.append(s)
        return missing

    def _run_variant(self, variant: Variant, todo: list[Sample], bar) -> list[str]:
        bar.set_description(variant.label)
        try:
            llm = self.llm_factory(self.config.model, variant.method, variant.knobs)
        except Exception as e:  # one broken method must not end a sweep of many
            logger.exception("building LLM for %s failed", variant.label)
            self._append([self._error_record(variant, s, f"LLM(): {e!r}") for s in todo])
            bar.update(len(todo))
            return [f"{variant.label}: LLM(): {e!r}"]
        errors = []
        cells = {}
        for s in todo:
            cells.setdefault((s.task, s.length), []).append(s)
        size = self.config.batch_size
        for (task, length), cell in cells.items():
            chunks = [cell] if size <= 0 else [cell[i:i + size] for i in range(0, len(cell), size)]
            for chunk in chunks:
                try:
                    if task == FIDELITY_TASK:
                        records = self._run_fidelity(llm, variant, chunk)
                    else:
                        records = self._run_generate(llm, variant, chunk)
                except Exception as e:
                    logger.exception("%s on %s/%d failed", variant.label, task, length)
                    records = [self._error_record(variant, s, repr(e)) for s in chunk]
                    errors.append(f"{variant.label} {task}/{length}: {e!r}")
                self._append(records)
                bar.update(len(chunk))
        llm.shutdown()   # its weights and KV go before the next variant's engine loads
        return errors

    def _record(self, variant: Variant, s: Sample, **fields) -> dict:
        return {"key": sample_key(variant, s), "label": variant.label, "method": variant.method,
                "variant_id": variant.variant_id, "sweep": variant.sweep, "task": s.task,
                "length": s.length, "index": s.index, "prompt_hash": s.prompt_hash,
                "prompt_tokens": len(s.prompt_token_ids), "metric": s.metric,
                "expected": s.answers, "meta": s.meta, "error": None, **fields}

    def _error_record(self, variant, s, error) -> dict:
        return self._record(variant, s, output=None, score=None, error=error)

    def _run_generate(self, llm, variant, chunk) -> list[dict]:
        t0 = time.perf_counter()
        outs = llm.generate([s.prompt_token_ids for s in chunk],
                            [_greedy(s.max_tokens) for s in chunk], use_tqdm=False)
        wall = time.perf_counter() - t0
        records = []
        for s, out in zip(chunk, outs):
            first = out.outputs[0]
            if first.finish_reason == "error":
                records.append(self._error_record(variant, s, out.error or "engine error"))
                continue
            m = out.metrics or {}
            latency = (m["finish_time"] - m["arrival_time"]) if "finish_time" in m else wall / len(chunk)
            ttft = (m["first_token_time"] - m["arrival_time"]) if m.get("first_token_time") else None
            records.append(self._record(
                variant, s, output=first.text, score=score(s.metric, first.text, s.answers),
                output_tokens=len(first.token_ids), finish_reason=first.finish_reason,
                latency_s=latency, ttft_s=ttft, attention_recall=m.get("attention_recall")))
        return records

    def _run_fidelity(self, llm, variant, chunk) -> list[dict]:
        t0 = time.perf_counter()
        rows = llm.teacher_forced_logprobs([s.prompt_token_ids for s in chunk],
                                           [s.continuation_ids for s in chunk], use_tqdm=False)
        wall = time.perf_counter() - t0
        is_reference = variant.reference == variant.label
        refs = self._load_reference(variant, chunk[0].task, chunk[0].length)
        records = []
        for s, lp in zip(chunk, rows):
            lp = lp.float().cpu()
            if is_reference:
                # Stored in float16: 2 bytes x vocab per token keeps a 20-sample cell of a 49K
                # vocabulary at ~60 MB; the rounding adds a KL noise floor of ~1e-8 nats.
                refs[s.prompt_hash] = lp.half()
                result = compare(lp, lp, s.continuation_ids)
            elif s.prompt_hash in refs:
                result = compare(refs[s.prompt_hash], lp, s.continuation_ids)
            else:
                records.append(self._error_record(variant, s, "no vanilla reference log-probs"))
                continue
            records.append(self._record(
                variant, s, output=None, score=result["top1_agreement"], kl=result["kl"],
                text_top1=result["text_top1"], latency_s=wall / len(chunk)))
        if is_reference:
            os.makedirs(self.reference_dir, exist_ok=True)
            import torch
            torch.save(refs, self._reference_path(variant, chunk[0].task, chunk[0].length))
        return records
