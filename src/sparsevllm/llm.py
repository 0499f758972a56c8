"""The vLLM-shaped facade: LLM(model, vllm_sparse_method=..., **knobs).generate(prompts, params)."""
import gc
import logging

import torch

from sparsevllm.engine.llm_engine import LLMEngine
from sparsevllm.method_registry import make_config
from sparsevllm.outputs import RequestOutput
from sparsevllm.sampling_params import SamplingParams
from sparsevllm.sparse_params import SparseParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, vllm_sparse_method: str | None = None, **knobs):
        """vllm_sparse_method: a registered method (None: vanilla); `sparse_method=` is its alias."""
        self.config = make_config(model, vllm_sparse_method, **knobs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.hf_config = self.engine.model_config

    def shutdown(self) -> None:
        """Stop the engine and give its GPU memory back: the tensor-parallel worker processes exit, and
        the weights, KV pool and captured graphs are freed now, so a script can build the next LLM in
        the same process (the LLM can't generate after this)."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.shutdown()
            del engine
            gc.collect()   # the engine's parts point at each other: only a collection frees them
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __del__(self):
        engine = self.__dict__.get("engine")   # at exit or when collected: the ranks stop, memory goes with us
        if engine is not None:
            engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    @property
    def execution_mode(self) -> str:
        return self.engine.model_runner.execution_mode

    def memory_accounting(self) -> dict:
        return self.engine.cache_manager.memory_accounting()

    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            return [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a token-id list, or a list of those; got "
                            f"{type(prompts).__name__}")
        return list(prompts)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 sparse_params: SparseParams | list[SparseParams | None] | None = None) -> list[RequestOutput]:
        """sparse_params: one SparseParams for every prompt or a list, one per prompt (None: the
        engine's method and knobs). A request whose sparse knobs the engine refuses finishes alone
        with finish_reason 'error' and a message naming the knob."""
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        sparse = sparse_params if isinstance(sparse_params, list) else [sparse_params] * len(prompts)
        if len(sparse) != len(prompts):
            raise ValueError(f"got {len(sparse)} sparse_params for {len(prompts)} prompts")
        if "engine" not in self.__dict__:
            raise RuntimeError("this LLM was shut down (llm.shutdown()): create a new LLM to generate")
        seqs = []
        try:
            for p, sp, sparsity in zip(prompts, params, sparse):
                seqs.append(self.engine.add_request(p, sp, sparse=sparsity))
            self.engine.run(seqs, use_tqdm)
        except BaseException:
            self._abort(seqs)
            raise
        return [self.engine.output(s) for s in seqs]

    def _abort(self, seqs) -> None:
        """A call that raises (a bad prompt after good ones, a failed step, Ctrl-C) leaves none of its
        requests behind: queued, they would hold pages and run inside the next call."""
        for seq in seqs:
            self.engine.abort(seq)
        self.engine.reset_in_flight()

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, sparse_params=None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                   for c in conversations]
        prompts = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(prompts, sampling_params, use_tqdm, sparse_params)

    def teacher_forced_logprobs(self, prompts, continuations: list[list[int]],
                                use_tqdm: bool = True) -> list[torch.Tensor]:
        """Feed each continuation through the method's real decode path and return, per prompt, a
        float32 [len(continuation), vocab] tensor of log-probabilities; row i predicts continuation[i]."""
        prompts = self._as_list(prompts)
        if len(continuations) != len(prompts) or any(len(c) < 1 for c in continuations):
            raise ValueError("teacher_forced_logprobs needs one non-empty continuation per prompt")
        seqs = []
        try:
            for prompt, cont in zip(prompts, continuations):
                sp = SamplingParams(temperature=0.0, max_tokens=len(cont), ignore_eos=True)
                seq = self.engine.add_request(prompt, sp)
                seq.forced_token_ids, seq.full_logprobs = list(cont), []
                seqs.append(seq)
            self.engine.run(seqs, use_tqdm, desc="teacher forcing")
        except BaseException:
            self._abort(seqs)
            raise
        for s in seqs:
            if s.error:
                raise ValueError(f"teacher forcing failed: {s.error}")
        return [torch.stack(s.full_logprobs) for s in seqs]
