"""API key checks and request-size guards, without a server."""

from __future__ import annotations

from router.security import HttpGuard, bearer_ok


def test_bearer_ok() -> None:
    assert bearer_ok(None, None)  # no key configured: open
    assert bearer_ok("Bearer s3cret", "s3cret")
    assert bearer_ok("bearer s3cret", "s3cret")
    assert not bearer_ok(None, "s3cret")
    assert not bearer_ok("Bearer wrong", "s3cret")
    assert not bearer_ok("Basic s3cret", "s3cret")
    assert not bearer_ok("s3cret", "s3cret")


def scope(path: str, headers: dict[str, str]) -> dict[str, object]:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http", "path": path, "headers": raw}


def test_guard_order_and_statuses() -> None:
    guard = HttpGuard(api_key="k", max_body_bytes=100, max_header_bytes=200)
    assert guard.check(scope("/health", {})) is None
    for path in ("/v1/models", "/metrics", "/slo", "/v1/completions", "/nope"):
        error = guard.check(scope(path, {}))
        assert error is not None and error.status == 401, path
        assert guard.check(scope(path, {"Authorization": "Bearer k"})) is None
    big_header = guard.check(scope("/health", {"x-pad": "a" * 300}))
    assert big_header is not None and big_header.status == 431
    big_body = guard.check(scope("/v1/completions", {"content-length": "101"}))
    assert big_body is not None and big_body.status == 413
    bad_length = guard.check(scope("/v1/completions", {"content-length": "-5"}))
    assert bad_length is not None and bad_length.status == 413
    assert big_body.body()["error"]["code"] == "request_too_large"
