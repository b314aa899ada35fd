"""Errors in the OpenAI shape, and the exceptions that carry them across Ray.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}` with
a 4xx/5xx status, never a traceback. `ApiError` is raised anywhere in the ingress
and rendered once by the exception handlers in `cluster/api/ingress.py`.

The replica raises `ReplicaOverloaded` / `ReplicaRejected` / `ReplicaUnavailable`
instead of the engine's own exception classes, so the ingress can recognise them
without importing the engine (and torch). They pickle with plain arguments because Ray ships them back
wrapped in a `RayTaskError`.
"""
from __future__ import annotations

import json
import logging
import math

from ray.exceptions import RayActorError
from starlette.responses import JSONResponse

logger = logging.getLogger("ray.serve")

# (status, OpenAI error type) for the errors we emit.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class ApiError(Exception):
    """An error the client is told about, in the OpenAI shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.error_type = error_type or _TYPES.get(status, "server_error" if status >= 500
                                                   else "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)

    def headers(self) -> dict[str, str] | None:
        if self.retry_after_s is None:
            return None
        # NOTE: Retry-After takes whole seconds; never 0, so clients do back off.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def error_body(message: str, error_type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def sse_error_event(error: ApiError) -> bytes:
    """The last event of a stream that failed after its headers went out."""
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


class ReplicaOverloaded(Exception):
    """The replica's engine queue is full; the ingress answers 429 + Retry-After."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s)
        self.message = message
        self.retry_after_s = retry_after_s


class ReplicaRejected(Exception):
    """The engine refused the request's input (a ValueError); the ingress answers 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ReplicaUnavailable(Exception):
    """The replica's engine died or stalled; the ingress tries another replica, or
    answers 503 (retry later). `replica_id`: the replica that refused, if known."""

    def __init__(self, message: str, replica_id: str | None = None) -> None:
        super().__init__(message, replica_id)
        self.message = message
        self.replica_id = replica_id


def is_replica_lost(exc: BaseException) -> bool:
    """Whether a call failed because its engine replica is gone (its actor died or
    cannot be reached) or its engine died, rather than because of the request: a
    request that got no token yet may then run on another replica."""
    cause = replica_cause(exc)
    if isinstance(cause, ReplicaUnavailable):
        return cause.replica_id is not None
    return isinstance(cause, RayActorError) or isinstance(exc, RayActorError)


def replica_cause(exc: BaseException) -> BaseException:
    """The exception the replica raised, unwrapped from Ray's RayTaskError."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def replica_error(exc: BaseException) -> ApiError:
    """The HTTP error for a failed call to an engine replica."""
    cause = replica_cause(exc)
    if isinstance(cause, ReplicaOverloaded):
        return ApiError(429, f"The server is overloaded: {cause.message}",
                        code="rate_limit_exceeded", retry_after_s=cause.retry_after_s)
    if isinstance(cause, ReplicaRejected):
        return bad_request(cause.message)
    if isinstance(cause, ReplicaUnavailable):
        logger.warning("engine unavailable: %s", cause.message)
        return ApiError(503, "The engine is unavailable (it failed or stalled); retry later",
                        code="engine_unavailable", retry_after_s=1.0)
    if isinstance(cause, ApiError):
        return cause
    name = type(cause).__name__
    if name == "BackPressureError":  # Serve's own queue limit on the handle
        return ApiError(503, "The server is overloaded: too many queued requests",
                        code="overloaded", retry_after_s=1.0)
    if isinstance(cause, StopAsyncIteration):
        return ApiError(500, "The engine ended the stream without output", code="engine_error")
    logger.warning("replica call failed: %s: %s", name, cause)
    # NOTE: a replica lost with its node fails calls before Serve stops routing to
    # it; the others keep serving, so a client's retry soon succeeds.
    return ApiError(503, f"The engine is unavailable ({name}); retry later",
                    code="engine_unavailable", retry_after_s=1.0)


def replica_cause_message(exc: BaseException) -> str:
    return replica_error(exc).message
