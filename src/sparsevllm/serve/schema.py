"""The server's requests and errors: the JSON bodies of /v1/completions and /v1/chat/completions as
pydantic models, and errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`)."""
from sparsevllm.sampling_params import SamplingParams

try:
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict
except ImportError:   # the package still imports (for --help and a clear error) without the extra
    BaseModel, ConfigDict = object, dict


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
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
    stream_options: dict | None = None
    user: str | None = None

    def params(self, logprobs: int | None) -> SamplingParams:
        if self.n != 1:
            raise ValueError("n must be 1: this server returns one choice per request")
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=16 if self.max_tokens is None else self.max_tokens, min_tokens=self.min_tokens,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False


class ChatRequest(_Sampling):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


async def invalid_request(_, exc: "RequestValidationError"):
    err = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
    kind = err.get("type", "")
    message = ("request body is not valid JSON" if kind == "json_invalid" else
               f"unknown field {where!r}" if kind == "extra_forbidden" else f"{where}: {err.get('msg', 'invalid')}")
    return error_response(400, message, where or None)
