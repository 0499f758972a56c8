"""add_request / step / generate: the loop that turns prompts into finished requests."""
import json
import logging
import os
import time

import torch
from tqdm.auto import tqdm

from sparsevllm.config import EngineConfig
from sparsevllm.engine.model_runner import ModelRunner
from sparsevllm.engine.scheduler import Scheduler
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import to_device
from sparsevllm.layers.sampler import sample
from sparsevllm.method_registry import get_method
from sparsevllm.models.config import ModelConfig
from sparsevllm.models.registry import get_model_class
from sparsevllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class _Launched:
    """A step whose forward and sampling are issued: its sampled tokens (one per request in seqs)
    are on the device and on their way to pinned host memory."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor | None, logprobs: torch.Tensor | None,
                 num_tokens: int):
        self.seqs, self.device_tokens, self.num_tokens = seqs, tokens, num_tokens
        self.rows = {s.seq_id: j for j, s in enumerate(seqs)}
        self._tokens = self._logprobs = self._ready = None
        if tokens is None:
            return
        if tokens.is_cuda:
            self._tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._tokens.copy_(tokens, non_blocking=True)
            if logprobs is not None:
                self._logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
                self._logprobs.copy_(logprobs, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._tokens, self._logprobs = tokens, logprobs

    def host_tokens(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
        return self._tokens

    def host_logprobs(self) -> torch.Tensor | None:
        self.host_tokens()
        return self._logprobs


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.model is None or str(config.model).lower() == "smollm2-135m":
            from sparsevllm.default_model import resolve_model
            model_path = resolve_model(config.model)
        else:
            model_path = str(config.model)
            if not os.path.isdir(model_path):
                raise ValueError(f"model {model_path!r} is not a folder; pass a Hugging Face model folder, or "
                                 "model=None / 'smollm2-135m' for the embedded default model")
        self.model_path = model_path
        self.model_config = model_cfg = ModelConfig.from_folder(model_path)
        get_model_class(model_cfg.architecture)  # unsupported architecture: fail before loading anything
        if config.max_model_len is None:
            config.max_model_len = model_cfg.max_position_embeddings
        elif config.max_model_len > model_cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context "
                             f"(max_position_embeddings={model_cfg.max_position_embeddings})")
        method_cls = get_method(config.vllm_sparse_method)
        method_cls.validate_model(config, model_cfg)   # knobs against the model's shape, before weights load
        self.config = config
        self.tokenizer = self._load_tokenizer(model_path)
        self.eos_token_ids = self._eos_ids(model_path)
        self.model_runner = ModelRunner(config, model_path, model_cfg, method_cls)
        self.cache_manager = self.model_runner.cache_manager
        self.scheduler = Scheduler(config, self.cache_manager)
        self.generator = torch.Generator(device=self.model_runner.device).manual_seed(config.seed)
        self._seq_generators: dict[int, torch.Generator] = {}
        # Overlapped scheduling pays where the device runs asynchronously to the host (CUDA); on a
        # CPU every op finishes before the next is issued, so there is nothing to overlap.
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.model_runner.device.type == "cuda")
        self._in_flight: _Launched | None = None

    @staticmethod
    def _load_tokenizer(path: str):
        if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
            logger.info("no tokenizer in %s: prompts must be token ids", path)
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)

    def _eos_ids(self, path: str) -> set[int]:
        ids = set(self.model_config.eos_token_id)
        gen_cfg = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_cfg):
            with open(gen_cfg) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model folder {self.model_path!r} has no tokenizer: pass prompts as token-id lists")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def add_request(self, prompt, params: SamplingParams) -> Sequence:
        """Queue one request. A request that can never run (empty, too long) is returned already
        finished with finish_reason 'error' and a message; it does not disturb the others."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        seq = Sequence(token_ids, params, arrival_time=time.perf_counter())
        if params.seed is not None:
            self._seq_generators[seq.seq_id] = torch.Generator(self.model_runner.device).manual_seed(params.seed)
        vocab = self.model_config.vocab_size
        error = None
        if not token_ids:
            error = "empty prompt: a request needs at least one token"
        elif len(token_ids) >= self.config.max_model_len:
            error = (f"prompt of {len(token_ids)} tokens does not fit max_model_len={self.config.max_model_len} "
                     "(it must leave room for at least one generated token)")
        elif self.cache_manager.pages_for(len(token_ids) + 1) > self.cache_manager.num_pages:
            error = (f"prompt of {len(token_ids)} tokens needs more KV pages than the whole pool holds "
                     f"({self.cache_manager.num_pages} pages of {self.config.page_size}); raise num_kv_pages, "
                     "cpu_kv_cache_gb or gpu_memory_utilization")
        elif min(token_ids) < 0 or max(token_ids) >= vocab:
            error = f"prompt token ids must be in [0, {vocab}) for this model"
        if error:
            logger.warning("request %d failed: %s", seq.seq_id, error)
            seq.error = error
            self.scheduler.finish(seq, "error")
        else:
            self.scheduler.add(seq)
        return seq

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        """One engine step; returns the requests it finished and the tokens its forward processed.

        The lifecycle of a step, in order: schedule -> prepare (host inputs) -> forward ->
        on_step_end -> sample -> commit (counters) are issued by `_launch`; finish (learn the sampled
        tokens, stop conditions, free) is `_finish`. With overlapped scheduling (async_scheduling)
        the step finished here is the one launched before: its tokens were produced by the GPU
        while the host built this one, and this one reads them on the device.
        """
        launched = self._launch()
        if launched is None and self._in_flight is None:
            return (self._fail_stuck_request() if self.scheduler.has_work() else []), 0
        if self.async_scheduling:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        return self._finish(done), (done.num_tokens if done else 0)

    def _launch(self) -> "_Launched | None":
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return None
        cm, runner, prev = self.cache_manager, self.model_runner, self._in_flight
        feed = None
        if prev is not None and not batch.is_prefill:
            feed = [prev.rows.get(s.seq_id, -1) if s.num_pending_tokens else -1 for s in batch.seqs]
            feed = feed if max(feed) >= 0 else None
        step = cm.prepare_step(batch.seqs, batch.num_tokens, batch.is_prefill, feed)
        logits = runner.forward(step, prev.device_tokens if feed is not None else None)
        cm.on_step_end(step)
        seqs = [batch.seqs[i] for i in step.sampled]
        tokens = logprobs = None
        if seqs:
            tokens = sample(logits, [s.params for s in seqs], [self._seq_generators.get(s.seq_id) for s in seqs],
                            self.generator)
            forced = [(j, s.forced_token_ids[s.num_completion_tokens + s.num_pending_tokens])
                      for j, s in enumerate(seqs) if s.forced_token_ids is not None]
            if forced:
                rows, ids = zip(*forced)
                tokens[to_device(rows, tokens.device)] = to_device(ids, tokens.device)
            if any(s.logprobs is not None for s in seqs):
                logprobs = torch.log_softmax(logits, dim=-1)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            cm.commit(seq, n)
        for seq in seqs:
            seq.num_pending_tokens += 1
        return _Launched(seqs, tokens, logprobs, sum(batch.num_tokens))

    def _finish(self, launched: "_Launched | None") -> list[Sequence]:
        if launched is None or not launched.seqs:
            return []
        tokens = launched.host_tokens().tolist()
        logprobs = launched.host_logprobs()
        now = time.perf_counter()
        finished = []
        for j, (seq, token) in enumerate(zip(launched.seqs, tokens)):
            if seq.is_finished:
                continue  # it finished at the step before: this was an extra step, its token is dropped
            seq.append_token(token, pending=True)
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[j])
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_times.append(now)
            reason = self._finish_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                self._seq_generators.pop(seq.seq_id, None)
                finished.append(seq)
        return finished

    def _fail_stuck_request(self) -> list[Sequence]:
        """Nothing can run and nothing is in flight: the head of the queue needs more pages than
        exist even with every other request gone. Fail it rather than wait forever."""
        seq = self.scheduler.waiting[0] if self.scheduler.waiting else self.scheduler.running[0]
        seq.error = (f"request of {len(seq)} tokens no longer fits the KV pool ({self.cache_manager.num_pages} "
                     f"pages of {self.config.page_size})")
        logger.warning("request %d failed: %s", seq.seq_id, seq.error)
        self.scheduler.finish(seq, "error")
        return [seq]

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= p.max_tokens or len(seq.token_ids) >= self.config.max_model_len:
            return "length"
        return None

    def run(self, seqs: list[Sequence], use_tqdm: bool = True, desc: str = "generate") -> None:
        pending = sum(not s.is_finished for s in seqs)
        bar = tqdm(total=len(seqs), desc=desc, disable=not use_tqdm, dynamic_ncols=True)
        bar.update(len(seqs) - pending)
        while self.has_work():
            t0 = time.perf_counter()
            finished, num_tokens = self.step()
            bar.set_postfix_str(f"{num_tokens / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
            bar.update(len(finished))
        bar.close()
        assert self.cache_manager.allocator.is_idle() or self.scheduler.has_work(), "KV pages leaked"

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def output(self, seq: Sequence) -> dict:
        ids = seq.completion_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return {"text": text, "token_ids": ids, "prompt_token_ids": seq.token_ids[:seq.num_prompt_tokens],
                "finish_reason": seq.finish_reason, "error": seq.error,
                "metrics": {"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                            "finish_time": seq.token_times[-1] if seq.token_times else seq.arrival_time,
                            "token_times": list(seq.token_times)}}
