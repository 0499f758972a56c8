"""The server's requests and errors: the JSON bodies of /v1/completions and /v1/chat/completions as
pydantic models, and errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`).

Types are strict, as SamplingParams checks them: a string is not a number or a bool, a float is not
an integer, a bool is neither; a JSON integer is a number. Values (ranges, an empty stop string) are
left to SamplingParams itself, so the server refuses exactly what the Python API refuses.
"""
from sparsevllm.sampling_params import SamplingParams, SamplingParamsError
from sparsevllm.sparse_params import SparseParams, SparseParamsError

try:
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict
except ImportError:   # the package still imports (for --help and a clear error) without the extra
    BaseModel, ConfigDict = object, dict


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


async def invalid_request(_, exc: "RequestValidationError"):
    """A body that is not JSON, or whose fields have the wrong names or types: a 400 whose param is
    the top-level field at fault."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":   # its loc is ("body", character offset): no field to name
        return error_response(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')} "
                                   f"at character {first['loc'][-1]}")
    loc = first.get("loc", ())[1:]   # after "body"
    if not loc:   # the body itself: a JSON list or string instead of an object
        return error_response(400, f"request body: {first.get('msg', 'invalid')}")
    field = str(loc[0])
    if first["type"] == "extra_forbidden":
        return error_response(400, f"unknown field {field!r}", field)
    if first["type"] == "missing":
        return error_response(400, f"{field}: {first['msg']}", field)
    # a union (stop, prompt) fails once per alternative, with the alternative's name in loc
    failed = [e for e in errors if e["loc"][1:2] == (field,)]
    reasons = dict.fromkeys(e["msg"] for e in failed)
    where = field if len(failed) > 1 else field + "".join(f"[{x}]" if isinstance(x, int) else f".{x}"
                                                          for x in loc[1:])
    return error_response(400, f"{where}: {' or '.join(reasons)}, got {first.get('input')!r}", field)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Sparsity of this request (the openai client's extra_body): {"method": ..., "<knob>": ...}, as
    # SparseParams; checked against the engine by the route (a 400 naming "sparse").
    sparse: dict | None = None

    def params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams; a value SamplingParams refuses is a 400 naming its field."""
        if self.n != 1:
            raise APIError(400, "n must be 1: this server returns one choice per request", "n")
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=max_tokens,
                min_tokens=self.min_tokens, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                logprobs=logprobs)
        except SamplingParamsError as e:
            raise APIError(400, str(e), self._request_field(e.field)) from None

    def sparse_params(self) -> SparseParams | None:
        """The request's SparseParams (types only; the engine's checks come after); a bad one is a 400."""
        if self.sparse is None:
            return None
        try:
            return SparseParams(**self.sparse)
        except SparseParamsError as e:
            raise APIError(400, f"sparse: {e}", "sparse") from None

    def _request_field(self, name: str) -> str:
        """The request field a SamplingParams field comes from."""
        return name

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False


class ChatRequest(_Sampling):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def _request_field(self, name: str) -> str:
        if name == "logprobs":
            return "top_logprobs"
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return name
