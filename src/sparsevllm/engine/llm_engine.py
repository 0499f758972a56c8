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
from sparsevllm.layers.sampler import sample
from sparsevllm.method_registry import get_method
from sparsevllm.models.config import ModelConfig
from sparsevllm.models.registry import get_model_class
from sparsevllm.sampling_params import SamplingParams

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
        self.model_config = mc = ModelConfig.from_folder(model_path)
        get_model_class(mc.architecture)  # unsupported architecture: fail before loading anything
        if config.max_model_len is None:
            config.max_model_len = mc.max_position_embeddings
        elif config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context "
                             f"(max_position_embeddings={mc.max_position_embeddings})")
        self.config = config
        self.tokenizer = self._load_tokenizer(model_path)
        self.eos_token_ids = self._eos_ids(model_path)
        self.model_runner = ModelRunner(config, model_path, mc, get_method(config.vllm_sparse_method))
        self.cache_manager = self.model_runner.cache_manager
        self.scheduler = Scheduler(config, self.cache_manager)
        self.generator = torch.Generator(device=self.model_runner.device).manual_seed(config.seed)
        self._seq_generators: dict[int, torch.Generator] = {}

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
        """Run one scheduled step; return the requests it finished and the tokens it processed."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            # Nothing can run: the head of the queue needs more pages than exist even with every
            # other request gone. Fail it rather than wait forever.
            seq = self.scheduler.waiting[0] if self.scheduler.waiting else self.scheduler.running[0]
            if seq in self.scheduler.waiting:
                self.scheduler.waiting.remove(seq)
            seq.error = (f"request of {len(seq)} tokens no longer fits the KV pool ({self.cache_manager.num_pages} "
                         f"pages of {self.config.page_size})")
            logger.warning("request %d failed: %s", seq.seq_id, seq.error)
            self.scheduler.finish(seq, "error")
            return [seq], 0
        step = self.cache_manager.prepare_step(batch.seqs, batch.num_tokens, batch.is_prefill)
        logits = self.model_runner.forward(step)
        done = [seq.num_computed_tokens + n == len(seq) for seq, n in zip(batch.seqs, batch.num_tokens)]
        rows = [i for i, d in enumerate(done) if d]
        tokens = []
        if rows:
            sel = logits if len(rows) == len(done) else logits.index_select(
                0, torch.tensor(rows, device=logits.device))
            seqs = [batch.seqs[i] for i in rows]
            tokens = sample(sel, [s.params for s in seqs], [self._seq_generators.get(s.seq_id) for s in seqs],
                            self.generator).tolist()
        now = time.perf_counter()
        finished = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self.cache_manager.commit(seq, n)
        for j, i in enumerate(rows):
            seq = batch.seqs[i]
            token = tokens[j]
            if seq.logprobs is not None:
                seq.logprobs.append(torch.log_softmax(sel[j], dim=-1).cpu())
            if seq.forced_token_ids is not None:
                token = seq.forced_token_ids[seq.num_completion_tokens]
            seq.append_token(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_times.append(now)
            reason = self._finish_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                self._seq_generators.pop(seq.seq_id, None)
                finished.append(seq)
        return finished, sum(batch.num_tokens)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= p.max_tokens or len(seq) >= self.config.max_model_len:
            return "length"
        return None

    def run(self, seqs: list[Sequence], use_tqdm: bool = True, desc: str = "generate") -> None:
        pending = sum(not s.is_finished for s in seqs)
        bar = tqdm(total=len(seqs), desc=desc, disable=not use_tqdm, dynamic_ncols=True)
        bar.update(len(seqs) - pending)
        while self.scheduler.has_work():
            t0 = time.perf_counter()
            finished, num_tokens = self.step()
            bar.set_postfix_str(f"{num_tokens / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
            bar.update(len(finished))
        bar.close()
        assert self.cache_manager.allocator.is_idle() or self.scheduler.has_work(), "KV pages leaked"

    def output(self, seq: Sequence) -> dict:
        ids = seq.completion_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return {"text": text, "token_ids": ids, "prompt_token_ids": seq.token_ids[:seq.num_prompt_tokens],
                "finish_reason": seq.finish_reason, "error": seq.error,
                "metrics": {"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                            "finish_time": seq.token_times[-1] if seq.token_times else seq.arrival_time,
                            "token_times": list(seq.token_times)}}
