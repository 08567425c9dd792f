"""Errors in the shape each client family expects.

TGI clients read `{"error": str, "error_type": str}` and map error_type to exception classes; OpenAI
clients read `{"error": {"message", "type", "param", "code"}}`. An APIError carries both views; the
route family decides which body is written.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse


class ErrorKind(enum.StrEnum):
    VALIDATION = "validation"  # bad input: TGI 422, OpenAI 400
    OVERLOADED = "overloaded"  # concurrency limit: 429
    GENERATION = "generation"  # the engine failed this request: TGI 424, OpenAI 500
    INCOMPLETE = "incomplete_generation"  # the stream ended early: 500
    UNAVAILABLE = "unavailable"  # loading or draining: 503
    UNAUTHORIZED = "unauthorized"  # 401
    FORBIDDEN = "forbidden"  # 403: a route this server's configuration keeps closed
    NOT_FOUND = "not_found"  # unknown model or route: 404
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405
    TOO_LARGE = "payload_too_large"  # 413


class Family(enum.Enum):
    TGI = "tgi"
    OPENAI = "openai"


_TGI_STATUS = {
    ErrorKind.VALIDATION: 422,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.GENERATION: 424,
    ErrorKind.INCOMPLETE: 500,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.UNAUTHORIZED: 401,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.METHOD_NOT_ALLOWED: 405,
    ErrorKind.TOO_LARGE: 413,
}
_OPENAI_STATUS = {**_TGI_STATUS, ErrorKind.VALIDATION: 400, ErrorKind.GENERATION: 500}
_OPENAI_TYPE = {
    ErrorKind.VALIDATION: "BadRequestError",
    ErrorKind.OVERLOADED: "RateLimitError",
    ErrorKind.GENERATION: "InternalServerError",
    ErrorKind.INCOMPLETE: "InternalServerError",
    ErrorKind.UNAVAILABLE: "ServiceUnavailableError",
    ErrorKind.UNAUTHORIZED: "AuthenticationError",
    ErrorKind.FORBIDDEN: "PermissionDeniedError",
    ErrorKind.NOT_FOUND: "NotFoundError",
    ErrorKind.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    ErrorKind.TOO_LARGE: "BadRequestError",
}

# Seconds a client should wait before retrying (RFC 9110 section 10.2.3), sent with 429 and 503: a slot
# frees within a few tokens' time; loading and draining take longer (and a drained pod's clients
# should go to another replica, which a load balancer does on the 503 itself).
RETRY_AFTER_S = {ErrorKind.OVERLOADED: 1, ErrorKind.UNAVAILABLE: 5}


@dataclass
class APIError(Exception):
    kind: ErrorKind
    message: str
    param: str | None = None

    def __str__(self) -> str:
        return self.message

    def status(self, family: Family) -> int:
        return (_TGI_STATUS if family is Family.TGI else _OPENAI_STATUS)[self.kind]

    def body(self, family: Family) -> dict[str, Any]:
        if family is Family.TGI:
            return {"error": self.message, "error_type": self.kind.value}
        status = self.status(family)
        return {
            "error": {
                "message": self.message,
                "type": _OPENAI_TYPE[self.kind],
                "param": self.param,
                "code": status,
            }
        }

    def headers(self) -> dict[str, str]:
        retry = RETRY_AFTER_S.get(self.kind)
        return {"Retry-After": str(retry)} if retry is not None else {}

    def response(self, family: Family, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(
            self.body(family), status_code=self.status(family), headers={**self.headers(), **(headers or {})}
        )


def validation(message: str, param: str | None = None) -> APIError:
    return APIError(ErrorKind.VALIDATION, message, param)


# vLLM's routes outside /v1 that answer in OpenAI's error shape (vLLM's ErrorResponse); /rerank is
# TEI's too and keeps TEI's shape
_OPENAI_PATHS = frozenset({"/pooling", "/score", "/classify"})


def family_of_path(path: str) -> Family:
    return Family.OPENAI if path.startswith("/v1/") or path in _OPENAI_PATHS else Family.TGI
