"""Errors the router reports to clients, with their HTTP status and gRPC code.

One exception type carries everything both front doors need, so the request flow raises a
single kind of error and each front door only translates it: HTTP answers ``status`` with the
OpenAI error body ``{"error": {"message", "type", "param", "code"}}``; gRPC aborts with
``grpc_code`` and the message.
"""

from __future__ import annotations

from typing import Any

import grpc


class RouterError(Exception):
    """A request failed for a reason the client should see.

    ``status`` is the HTTP status, ``error_type`` the OpenAI error ``type``, ``param`` the
    offending request field (or None), ``code`` a short machine-readable reason.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        grpc_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type
        self.param = param
        self.code = code
        self.grpc_code = grpc_code
        self.metered = False  # already counted in the request metrics

    @property
    def kind(self) -> str:
        """The ``status`` label of the request metrics: the code, else the error type."""
        return self.code or self.error_type

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error body."""
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, OpenAI's error shape."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    """400: the request itself is wrong; retrying it unchanged will fail again."""
    return RouterError(message, param=param, code=code)


def too_large(message: str, status: int = 413) -> RouterError:
    """413 (body) or 431 (headers): the request is over the server's size limits."""
    error = invalid_request(message, code="request_too_large")
    error.status = status
    return error


def no_instance(message: str) -> RouterError:
    """503: no healthy instance can serve the request right now."""
    return RouterError(
        message,
        status=503,
        error_type="service_unavailable",
        code="no_healthy_instance",
        grpc_code=grpc.StatusCode.UNAVAILABLE,
    )


def overloaded(message: str) -> RouterError:
    """429: the router or every instance is at capacity; retry later."""
    return RouterError(
        message,
        status=429,
        error_type="rate_limit_error",
        code="overloaded",
        grpc_code=grpc.StatusCode.RESOURCE_EXHAUSTED,
    )


def upstream_failure(message: str) -> RouterError:
    """502: an instance failed in a way retrying elsewhere did not fix."""
    return RouterError(
        message,
        status=502,
        error_type="upstream_error",
        code="upstream_failure",
        grpc_code=grpc.StatusCode.INTERNAL,
    )


def request_failed(message: str) -> RouterError:
    """500: the request failed inside a node's engine (its own doing: not retried)."""
    return RouterError(
        message,
        status=500,
        error_type="server_error",
        code="request_failed",
        grpc_code=grpc.StatusCode.INTERNAL,
    )


def unauthorized(message: str = "invalid or missing API key") -> RouterError:
    """401: the Bearer token is missing or wrong."""
    return RouterError(
        message,
        status=401,
        error_type="authentication_error",
        code="invalid_api_key",
        grpc_code=grpc.StatusCode.UNAUTHENTICATED,
    )
