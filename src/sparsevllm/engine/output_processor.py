"""When a request stops, and what it returns: stop tokens, stop strings (found in the detokenised
output, wherever the tokenizer split them), length limits, min_tokens; RequestOutput objects."""
from sparsevllm.engine.recall import RequestRecall
from sparsevllm.engine.sequence import Sequence
from sparsevllm.outputs import CompletionOutput, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, recall_definition: str | None = None):
        self.tokenizer = tokenizer
        self.recall_definition = recall_definition   # the method's, when attention recall is measured
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._checked_chars: dict[int, int] = {}

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Called once per token the host learns (already appended). Stop conditions count only
        from min_tokens on (vLLM's rule)."""
        p = seq.params
        if seq.num_completion_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if p.stop and self._stop_string(seq):
                return "stop"
        if seq.num_completion_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _stop_string(self, seq: Sequence) -> bool:
        skip = seq.params.skip_special_tokens
        text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=skip)
        checked = self._checked_chars.get(seq.seq_id)
        if checked is None:
            # The first search (at min_tokens) covers only what the newest token added: a stop string
            # generated before min_tokens does not end the output later (vLLM's rule).
            checked = len(self.tokenizer.decode(seq.completion_token_ids[:-1], skip_special_tokens=skip))
        self._checked_chars[seq.seq_id] = len(text)
        best = None
        for stop in seq.params.stop:
            # Only a match ending in the newly decoded text is new; earlier text was searched before.
            at = text.find(stop, max(0, checked - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        seq.stop_reason = stop
        seq.output_text = text[:at + (len(stop) if seq.params.include_stop_str_in_output else 0)]
        return True

    def forget(self, seq: Sequence) -> None:
        self._checked_chars.pop(seq.seq_id, None)

    def text(self, seq: Sequence) -> str:
        if seq.output_text is not None:
            return seq.output_text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def request_output(self, request: Sequence) -> RequestOutput:
        """One request's RequestOutput: its n samples (request.group) as outputs."""
        outputs = [CompletionOutput(
            index=i, text=self.text(s), token_ids=s.completion_token_ids,
            cumulative_logprob=s.cumulative_logprob if s.output_logprobs is not None else None,
            logprobs=s.output_logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)
            for i, s in enumerate(request.group)]
        errors = [s.error for s in request.group if s.error]
        times = [s.token_times[-1] for s in request.group if s.token_times]
        firsts = [s.first_token_time for s in request.group if s.first_token_time is not None]
        metrics = {"arrival_time": request.arrival_time, "first_token_time": min(firsts) if firsts else None,
                   "finish_time": max(times) if times else request.arrival_time,
                   "token_times": list(request.token_times)}
        if request.sparse is not None:   # what it decoded with: the method, its knobs, why ("auto")
            metrics["sparse"] = request.sparse.report()
        if request.recall is not None:
            metrics["attention_recall"] = RequestRecall.summary([s.recall for s in request.group],
                                                                self.recall_definition)
        return RequestOutput(request_id=str(request.seq_id), prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids,
                             prompt_logprobs=request.prompt_logprobs, outputs=outputs,
                             finished=all(s.is_finished for s in request.group),
                             error=errors[0] if errors else None, metrics=metrics)
