"""The server's routes: build_app(AsyncLLM, model name, API key) is the FastAPI app.

/v1/completions and /v1/chat/completions (streaming over SSE or not), /v1/models, /health and
/metrics. Requests join the running batch as they arrive; a client that disconnects frees its KV at
once; a bad request gets a 4xx error in OpenAI's shape and the server goes on.
"""
import json
import time
import uuid

from sparsevllm.engine.async_engine import AsyncLLM
from sparsevllm.method_registry import request_sparsity
from sparsevllm.sampling_params import SamplingParams
from sparsevllm.sparse_params import SparseParams
from sparsevllm.serve.metrics import prometheus
from sparsevllm.serve.schema import APIError, ChatRequest, CompletionRequest, error_response, invalid_request

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import PlainTextResponse, StreamingResponse
except ImportError:   # the package still imports (for --help and a clear error) without the extra
    FastAPI = None


class _ApiKeyCheck:
    """`Authorization: Bearer KEY` on /v1/ routes, as plain ASGI: Starlette's @app.middleware("http")
    passes every streamed chunk through an extra task and memory stream."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and \
                dict(scope["headers"]).get(b"authorization") != self.expected:
            response = error_response(401, "invalid or missing API key", None, "authentication_error")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


async def last_output(gen, first, request: "Request"):
    """The finished snapshot of a non-streamed request; if the client disconnects first, the latest
    one (closing the generator aborts the request and frees its KV at once)."""
    out = first
    try:
        while not out.finished:
            if await request.is_disconnected():
                break
            out = await gen.__anext__()
    finally:
        await gen.aclose()
    return out


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None):
    if FastAPI is None:
        raise ImportError('the server needs FastAPI and uvicorn: pip install -e ".[server]"')
    app = FastAPI(title="Sparse-vLLM")
    engine = llm.engine
    method = engine.config.vllm_sparse_method
    tokenizer = engine.tokenizer

    app.add_exception_handler(RequestValidationError, invalid_request)

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.kind)

    if api_key:
        app.add_middleware(_ApiKeyCheck, api_key=api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(llm, model_name), media_type="text/plain; version=0.0.4")

    cfg = engine.config
    mixable = cfg.method.request_knobs is not None and cfg.tensor_parallel_size == 1
    # What a request's "sparse" field may choose (a request without one gets `default`): vanilla and
    # every hosted method (the engine's, mixed_methods'), with their per-request knobs.
    choices = {"default": method,
               "methods": list(dict.fromkeys([method] + (["vanilla", *cfg.hosted] if mixable else []))),
               "knobs": [k for cls, _ in cfg.hosted.values() for k in cls.request_knobs or ()] if mixable else []}
    if method == "auto":
        choices.update(auto_method=cfg.auto_method, auto_dense_below=cfg.auto_dense_below)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(llm.stats.started),
                                            "owned_by": "sparsevllm", "sparse_method": method, "sparse": choices,
                                            "max_model_len": engine.config.max_model_len}]}

    def sampling(req: CompletionRequest | ChatRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {model_name!r}",
                           "model", "not_found_error")
        return req.params(max_tokens, logprobs)

    def sparse_params(req: CompletionRequest | ChatRequest) -> SparseParams | None:
        """The request's SparseParams, checked against the engine here: a bad one is a 400 naming
        "sparse", not a request that fails after it was accepted."""
        sparse = req.sparse_params()
        if sparse is not None:
            try:
                request_sparsity(engine.config, sparse, 0, name="sparse")
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e), "sparse") from None
        return sparse

    async def first_output(gen):
        """The first snapshot; a request the engine refused (prompt too long, ...) is a 400."""
        try:
            out = await gen.__anext__()
        except (ValueError, TypeError) as e:   # add_request refused it: the client's error, not a 500
            raise APIError(400, str(e)) from None
        if out.error and not out.outputs[0].token_ids:
            raise APIError(400, out.error, "prompt")
        return out

    def token_text(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else str(t)

    def top_k(entry: dict, k: int) -> list:
        """(token id, Logprob) of a position's k most likely tokens, most likely first."""
        return sorted(((t, v) for t, v in entry.items() if v.rank <= k), key=lambda tv: tv[1].rank)

    def completion_logprobs(out, k: int, start_offset: int, begin: int = 0) -> dict:
        """Of the tokens from index begin on (a streamed chunk reports only its new tokens)."""
        first = out.outputs[0]
        tokens, token_lps, tops, offsets, offset = [], [], [], [], start_offset
        for t, entry in zip(first.token_ids[begin:], (first.logprobs or [])[begin:]):
            text = token_text(t)
            tokens.append(text)
            token_lps.append(entry[t].logprob)
            tops.append({token_text(a): v.logprob for a, v in top_k(entry, k)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(out, k: int, begin: int = 0) -> dict:
        def item(t, lp):
            text = token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        first = out.outputs[0]
        return {"content": [{**item(t, entry[t].logprob),
                             "top_logprobs": [item(a, v.logprob) for a, v in top_k(entry, k)]}
                            for t, entry in zip(first.token_ids[begin:], (first.logprobs or [])[begin:])]}

    def usage(out) -> dict:
        n = sum(len(o.token_ids) for o in out.outputs)
        return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": n,
                "total_tokens": len(out.prompt_token_ids) + n}

    def sse(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def stream(gen, first, make_chunk, final_usage: bool, stops: list[str]):
        """SSE chunks of the text as it grows. With stop strings, the last len(stop) - 1 characters
        wait, so a stop string split across tokens is never half sent."""
        sent, tokens, hold = 0, 0, max((len(s) for s in stops), default=1) - 1
        out = first
        try:
            while True:
                text = out.outputs[0].text
                done = out.finished
                upto = len(text) if done else max(sent, len(text) - hold)
                if not done and text[sent:upto].endswith("\ufffd"):
                    upto = sent   # an unfinished multi-byte character: wait for the rest
                # a chunk per arrival of tokens, so clients can time them even while text is held back
                if upto > sent or done or len(out.outputs[0].token_ids) > tokens:
                    yield sse(make_chunk(text[sent:upto], out.outputs[0].finish_reason if done else None, out,
                                         tokens))   # tokens: the first token id this chunk reports
                    sent, tokens = upto, len(out.outputs[0].token_ids)
                if done:
                    break
                out = await gen.__anext__()
            if final_usage:
                yield sse(make_chunk(None, None, out, usage_only=True))
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        params = sampling(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request (a list of one string, a string or token ids)",
                               "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str) and tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
        gen = llm.generate(prompt, params, sparse_params(req))
        first = await first_output(gen)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = ""
        if req.echo:   # the prompt's text, also when it came as token ids (vLLM decodes them)
            echo = first.prompt if first.prompt is not None else tokenizer.decode(first.prompt_token_ids) \
                if tokenizer is not None else ""
        offset = [len(echo)]   # text offset of the next token reported

        def body(out, text, finish, begin=0, usage_only=False):
            if usage_only:
                return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                        "choices": [], "usage": usage(out)}
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(out, req.logprobs, offset[0], begin)
                if lp["tokens"]:
                    offset[0] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}
        if req.stream:
            echoed = []   # the first chunk carries the echoed prompt

            def chunk(text, finish, out, begin=0, usage_only=False):
                if not usage_only and not echoed:
                    text, _ = echo + text, echoed.append(True)
                return body(out, text, finish, begin, usage_only)
            return StreamingResponse(stream(gen, first, chunk, req.include_usage, params.stop),
                                     media_type="text/event-stream")
        out = await last_output(gen, first, request)
        result = body(out, echo + out.outputs[0].text, out.outputs[0].finish_reason)
        result["usage"] = usage(out)
        return result

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        try:
            text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a malformed conversation is the client's error
            raise APIError(400, f"messages: {e}", "messages") from None
        prompt = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        if max_tokens is None:   # OpenAI's and vLLM's chat default: the rest of the context, not 16
            max_tokens = max(1, engine.config.max_model_len - len(prompt))
        params = sampling(req, max_tokens, k)
        gen = llm.generate(prompt, params, sparse_params(req))
        first = await first_output(gen)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        opened = []   # the first chunk carries the role

        def chunk(text, finish, out, begin=0, usage_only=False):
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}
            if usage_only:
                return {**base, "choices": [], "usage": usage(out)}
            delta = {"content": text} if text else {}
            if not opened:
                delta, _ = {"role": "assistant", "content": text or ""}, opened.append(True)
            lp = chat_logprobs(out, k, begin) if req.logprobs else None
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
        if req.stream:
            return StreamingResponse(stream(gen, first, chunk, req.include_usage, params.stop),
                                     media_type="text/event-stream")
        out = await last_output(gen, first, request)
        choice = {"index": 0, "message": {"role": "assistant", "content": out.outputs[0].text},
                  "logprobs": chat_logprobs(out, k) if req.logprobs else None,
                  "finish_reason": out.outputs[0].finish_reason}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [choice], "usage": usage(out)}

    return app
