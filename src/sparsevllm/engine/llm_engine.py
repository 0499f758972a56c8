"""add_request / step / generate: the loop that turns prompts into finished requests."""
import atexit
import json
import logging
import os
import time

import torch
from tqdm.auto import tqdm

from sparsevllm.config import EngineConfig
from sparsevllm.distributed import check_kv_heads
from sparsevllm.engine.model_runner import ModelRunner, make_cache_manager, resolve_device
from sparsevllm.engine.output_processor import OutputProcessor
from sparsevllm.engine.recall import RequestRecall
from sparsevllm.engine.sampling import SampledStep, position_logprobs, sample_step
from sparsevllm.engine.scheduler import Scheduler
from sparsevllm.engine.sequence import Sequence
from sparsevllm.method_registry import request_sparsity
from sparsevllm.models.config import ModelConfig, config_architecture, read_config_json
from sparsevllm.models.registry import get_model_class
from sparsevllm.outputs import RequestOutput
from sparsevllm.sampling_params import SamplingParams
from sparsevllm.sparse_params import SparseParams

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


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
        raw = read_config_json(model_path)
        get_model_class(config_architecture(raw))  # an unsupported architecture is named before its keys are read
        self.model_config = model_cfg = ModelConfig.from_dict(raw)
        context, limit = model_cfg.max_position_embeddings, "max_position_embeddings"
        if model_cfg.sliding_window is not None and model_cfg.sliding_window < context:
            # The model attends over its last sliding_window tokens only; every method here attends
            # over the whole context, which is the same attention only while a sequence fits the window.
            context, limit = model_cfg.sliding_window, "sliding_window"
        if config.max_model_len is None:
            config.max_model_len = context
            if limit == "sliding_window":
                logger.warning("max_model_len is %d, the model's sliding_window: sliding-window attention is "
                               "not implemented, and full attention differs beyond the window", context)
        elif config.max_model_len > context:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context "
                             f"({limit}={context}" + ("; sliding-window attention is not implemented"
                                                      if limit == "sliding_window" else "") + ")")
        config.method.validate_model(config, model_cfg)   # knobs against the model's shape, before weights load
        self.config = config
        self.tokenizer = self._load_tokenizer(model_path)
        eos_token_ids = self._eos_ids(model_path)
        self.workers = self._start_workers(config, model_cfg) if config.tensor_parallel_size > 1 else None
        if self.workers is not None:
            atexit.register(self.shutdown)   # the one exit hook: graphs dropped before the ranks' teardown
        try:
            self.model_runner = ModelRunner(config, model_path, model_cfg)
            cm = make_cache_manager(config, model_cfg, self.model_runner)
        except BaseException as e:
            self._raise_worker_failure(e)
        if self.workers is not None:
            self.workers.mid_collectives = False   # every rank's construction collectives paired with rank 0's
            from sparsevllm.engine.tensor_parallel import CommandedCacheManager
            cm = CommandedCacheManager(cm, self.workers)   # records the page decisions the followers replay
        self.cache_manager = cm
        self.scheduler = Scheduler(config, cm)
        self.generator = torch.Generator(device=self.model_runner.device).manual_seed(config.seed)
        self._seq_generators: dict[int, torch.Generator] = {}
        # Overlapped scheduling pays where the device runs asynchronously to the host (CUDA); on a
        # CPU every op finishes before the next is issued, so there is nothing to overlap.
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.model_runner.device.type == "cuda")
        self._in_flight: SampledStep | None = None
        self.outputs = OutputProcessor(self.tokenizer, eos_token_ids, config.max_model_len,
                                       config.method.recall_definition if config.recall_sample_every else None)

    def _start_workers(self, config: EngineConfig, model_cfg: ModelConfig):
        """Check the split before anything loads, then spawn ranks 1..N-1 (rank 0 is this process)."""
        n = config.tensor_parallel_size
        check_kv_heads(model_cfg.num_key_value_heads, model_cfg.num_attention_heads, n)
        for name in ("vocab_size", "intermediate_size"):
            if getattr(model_cfg, name) % n:
                raise ValueError(f"tensor_parallel_size={n} must divide the model's {name} "
                                 f"({getattr(model_cfg, name)})")
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs; {torch.cuda.device_count()} visible")
        from sparsevllm.engine.tensor_parallel import Workers
        return Workers(config, self.model_path, device.type)

    def _raise_worker_failure(self, error: BaseException):
        """After a failure on rank 0: raise a follower's error if one failed (the likely cause),
        else the error itself; the tensor-parallel group is unusable either way."""
        if self.workers is None:
            raise error
        failure = self.workers.failure()
        self.shutdown()
        if failure:
            raise RuntimeError(failure) from error
        raise error

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do with one rank)."""
        if self.workers is not None:
            atexit.unregister(self.shutdown)
            if getattr(self, "model_runner", None) is not None:
                self.model_runner.release_graphs()
            self.workers.shutdown()

    @property
    def eos_token_ids(self) -> set[int]:
        return self.outputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.outputs.eos_token_ids = set(ids)

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

    def add_request(self, prompt, params: SamplingParams, arrival_time: float | None = None,
                    sparse: SparseParams | None = None) -> Sequence:
        """Queue one request (its params.n samples: `seq.group`). A request that can never run
        (empty, too long, a per-request sparse knob the engine refuses) is returned already finished
        with finish_reason 'error' and a message; it does not disturb the others. arrival_time
        (time.perf_counter()): when the request really arrived, if earlier than now (the server
        stamps it on receipt). sparse: its SparseParams (None: the engine's method and knobs)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if sparse is not None and not isinstance(sparse, SparseParams):
            raise TypeError(f"sparse_params must be SparseParams, got {type(sparse).__name__}")
        token_ids = self.tokenize(prompt)
        now = time.perf_counter() if arrival_time is None else arrival_time
        text = prompt if isinstance(prompt, str) else None
        seq = Sequence(token_ids, params, arrival_time=now, prompt=text)
        # The other samples prefill only what the first one's prompt pages do not hold. Each gets
        # its own seed when the request has one, so the samples differ and still reproduce (modulo
        # 2**64, the generator's range: torch takes a negative seed modulo 2**64 too).
        children = [Sequence(token_ids, params.clone(n=1, prompt_logprobs=None,
                                                     seed=None if params.seed is None else (params.seed + i) % 2**64),
                             arrival_time=now, prompt=text) for i in range(1, params.n)]
        seq.group = [seq] + children
        if self.config.recall_sample_every:
            for s in seq.group:
                s.recall = RequestRecall(self.model_config.num_hidden_layers)
        for child in children:
            child.prefix_parent = seq
        error = self._request_error(token_ids, params)
        try:
            setting = request_sparsity(self.config, sparse, len(token_ids))
        except ValueError as e:
            setting, error = None, error or str(e)
        for s in seq.group:
            s.sparse = setting
        for s in seq.group:
            if error:
                self.fail(s, error)
                continue
            if s.params.seed is not None:
                self._seq_generators[s.seq_id] = torch.Generator(self.model_runner.device).manual_seed(s.params.seed)
            self.scheduler.add(s)
        if error:
            logger.warning("request %d failed: %s", seq.seq_id, error)
        elif len(token_ids) + params.max_tokens > self.config.max_model_len:
            logger.warning("request %d: max_tokens=%d is cut to %d by max_model_len=%d", seq.seq_id, params.max_tokens,
                           self.config.max_model_len - len(token_ids), self.config.max_model_len)
        return seq

    def _request_error(self, token_ids: list[int], params: SamplingParams) -> str | None:
        vocab = self.model_config.vocab_size
        if not token_ids:
            return "empty prompt: a request needs at least one token"
        if len(token_ids) >= self.config.max_model_len:
            return (f"prompt of {len(token_ids)} tokens does not fit max_model_len={self.config.max_model_len} "
                    "(it must leave room for at least one generated token)")
        cm = self.cache_manager
        if cm.pages_for(cm.admit_len(len(token_ids), len(token_ids), params.max_tokens)) > cm.num_pages:
            return (f"prompt of {len(token_ids)} tokens needs more KV pages than the whole pool holds "
                    f"({cm.num_pages} pages of {self.config.page_size}); raise num_kv_pages, "
                    "cpu_kv_cache_gb or gpu_memory_utilization")
        method_error = cm.request_error(len(token_ids), params.max_tokens)
        if method_error:
            return method_error
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            return f"prompt token ids must be in [0, {vocab}) for this model"
        # Checked here, not in the sampler: a step that fails fails every request it runs.
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                return f"SamplingParams.{name}={k} exceeds the model's vocabulary of {vocab} tokens"
        if any(t >= vocab for t in params.stop_token_ids):
            return f"SamplingParams.stop_token_ids must be token ids in [0, {vocab}) for this model"
        if params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer, and this model folder has none; use stop_token_ids"
        return None

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        """One engine step; returns the requests it finished and the tokens its forward processed.

        The lifecycle of a step, in order (docs/design.md, section 3): schedule -> prepare (host
        inputs, the method's on_step_begin) -> forward -> on_step_end -> sample -> commit (counters)
        are issued by `_launch`; finish (learn the sampled tokens, stop conditions, free) is
        `_finish`. With overlapped scheduling (async_scheduling) the step finished here is the one
        launched before: its tokens were produced by the GPU while the host built this one, and this
        one reads them on the device.
        """
        try:
            launched = self._launch()
        except BaseException as e:
            if self.workers is None or self.workers.closed:   # closed: the ranks were stopped before this step
                raise
            if isinstance(e, KeyboardInterrupt):
                if self.workers.mid_collectives:   # the followers wait inside this step: it cannot resume
                    self.shutdown()
                raise
            self._raise_worker_failure(e)
        if launched is None and self._in_flight is None:
            return (self._fail_stuck_request() if self.scheduler.has_work() else []), 0
        if self.async_scheduling:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        return self._finish(done), (done.num_tokens if done else 0)

    def _launch(self) -> SampledStep | None:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return None
        cm, runner, prev = self.cache_manager, self.model_runner, self._in_flight
        feed = None
        if prev is not None and not batch.is_prefill:
            feed = [prev.rows.get(s.seq_id, -1) if s.num_pending_tokens else -1 for s in batch.seqs]
            feed = feed if max(feed) >= 0 else None
        if self.workers is not None:   # the followers replay the page decisions, then run the same step
            cm.send_step(batch.seqs, batch.num_tokens, batch.is_prefill, feed is not None)
        step = runner.prepare_step(batch.seqs, batch.num_tokens, batch.is_prefill, feed)
        logits = runner.forward(step, prev.device_tokens if feed is not None else None)
        cm.on_step_end(step)
        # queued before the sampled tokens' copy, so reading those (a step later) finds these done
        recall = step.recall.to_host(step.seqs) if step.recall is not None and step.recall.rows else None
        sampled = sample_step(step, logits, self._seq_generators, self.generator, self.eos_token_ids)
        sampled.recall = recall
        sampled.prompt_rows = [(step.seqs[i], start, count) for i, start, count in step.prompt_logprob_rows]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            cm.commit(seq, n)
        for seq in sampled.seqs:
            seq.num_pending_tokens += 1
        return sampled

    def _finish(self, launched: SampledStep | None) -> list[Sequence]:
        if launched is None:
            return []
        host = launched.host()
        if launched.recall is not None:
            launched.recall.deliver()
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        row = 0
        for seq, start, count in launched.prompt_rows:
            k = seq.params.prompt_logprobs
            for r in range(count):   # a chunk run again after preemption reports nothing new
                if len(seq.prompt_logprobs) == start + 1 + r:
                    seq.prompt_logprobs.append(position_logprobs(host, "prompt", row + r, seq.token_ids[start + 1 + r],
                                                                 k, decode))
            row += count
        if not launched.seqs:
            return []
        now = time.perf_counter()
        finished = []
        for j, (seq, token) in enumerate(zip(launched.seqs, host["tokens"].tolist())):
            if seq.is_finished:
                continue  # it finished at the step before: this was an extra step, its token is dropped
            seq.append_token(token, pending=True)
            if seq.full_logprobs is not None:
                seq.full_logprobs.append(host["full_logprobs"][j])
            if seq.output_logprobs is not None:
                entry = position_logprobs(host, "sample", j, token, seq.params.logprobs, decode)
                seq.output_logprobs.append(entry)
                seq.cumulative_logprob += entry[token].logprob
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_times.append(now)
            reason = self.outputs.finish_reason(seq, token)
            if reason:
                self._end(seq, reason)
                finished.append(seq)
        return finished

    def _fail_stuck_request(self) -> list[Sequence]:
        """Nothing can run and nothing is in flight: the head of the queue needs more pages than
        exist even with every other request gone. Fail it rather than wait forever."""
        seq = self.scheduler.waiting[0] if self.scheduler.waiting else self.scheduler.running[0]
        self.fail(seq, f"request of {len(seq)} tokens no longer fits the KV pool ({self.cache_manager.num_pages} "
                       f"pages of {self.config.page_size})")
        logger.warning("request %d failed: %s", seq.seq_id, seq.error)
        return [seq]

    def run(self, seqs: list[Sequence], use_tqdm: bool = True, desc: str = "generate") -> None:
        seqs = [s for request in seqs for s in request.group]
        pending = sum(not s.is_finished for s in seqs)
        bar = tqdm(total=len(seqs), desc=desc, disable=not use_tqdm, dynamic_ncols=True)
        bar.update(len(seqs) - pending)
        while self.has_work():
            t0 = time.perf_counter()
            finished, num_tokens = self.step()
            bar.set_postfix_str(f"{num_tokens / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
            bar.update(len(finished))
        bar.close()
        if self.workers is not None:
            self.cache_manager.sync()   # the followers free what rank 0 freed after the last step
        assert self.cache_manager.allocator.is_idle() or self.scheduler.has_work(), "KV pages leaked"

    def abort(self, request: Sequence) -> None:
        """Finish a request (all its samples) now and free its pages: its client went away. A
        token of it still in flight is dropped when it arrives."""
        for seq in request.group:
            if not seq.is_finished:
                self._end(seq, "abort")

    def fail(self, seq: Sequence, message: str) -> None:
        """Finish one sample with finish_reason 'error' and this message (a request that can never
        run, a failed step); its pages are freed."""
        seq.error = message
        self._end(seq, "error")

    def _end(self, seq: Sequence, reason: str) -> None:
        """Finish one sample, free its pages and drop what the engine keeps for a live sample (its
        generator, its stop-string search): every way a request ends goes through here."""
        self.scheduler.finish(seq, reason)
        self._seq_generators.pop(seq.seq_id, None)
        self.outputs.forget(seq)

    def reset_in_flight(self) -> None:
        """After a failed step: forget the step in flight (its requests were failed)."""
        self._in_flight = None

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def output(self, seq: Sequence) -> RequestOutput:
        return self.outputs.request_output(seq)
