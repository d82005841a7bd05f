"""What every HTTP request passes before a route sees it: the API key, the body's size and its bytes.

Plain ASGI, not a ``BaseHTTPMiddleware``: that would hide a client's disconnect from the routes, and with it the
abort that frees the request's cache. In order:

1. API key (vLLM's scope): every path under ``/v1`` and the admin routes (``ADMIN_PATHS``) need
   ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``); ``/health``, ``/metrics``, ``/version``,
   ``/tokenize``, ``/detokenize`` and ``OPTIONS`` (CORS preflight) stay open. A key is compared by its SHA-256
   digest in constant time; any of several keys is accepted.
2. Body size: the body is read here, whatever its framing (``Content-Length`` or chunked), and its bytes are
   counted as they arrive. Past ``max_body_bytes`` the answer is 413 at once, the rest is never read and the
   connection is closed.
3. Bytes: a header value that is not UTF-8, a body that is not UTF-8 (RFC 8259: JSON between systems is UTF-8)
   and a JSON string holding a lone UTF-16 surrogate (``"\\ud800"``, which no UTF-8 text can carry) are each a
   400 that names the place; the connection stays open.

The body, read whole, is then handed to the routes as one message; later ``receive`` calls go to the server, so
a client's disconnect still reaches them.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets

from . import openai_format as fmt

ADMIN_PATHS = ("/reset_prefix_cache",)  # vLLM exposes it only in dev mode; here it is behind the key
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def needs_key(method: str, path: str) -> bool:
    """vLLM's ``AuthenticationMiddleware``: a path starting with ``/v1``, any method but OPTIONS."""
    return method != "OPTIONS" and (path.startswith("/v1") or path in ADMIN_PATHS)


class Guard:
    def __init__(self, app, api_key: str | list[str] | None = None, max_body_bytes: int = 8 << 20):
        """``api_key``: one key or several (vLLM's ``--api-key k1 k2``), any of which is accepted."""
        self.app, self.max_body_bytes = app, max_body_bytes
        keys = [api_key] if isinstance(api_key, str) else [k for k in api_key or [] if k]
        self.key_digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = [(k.decode("latin-1").lower(), v) for k, v in scope["headers"]]
        if self.key_digests and needs_key(scope["method"], scope["path"]) and not self._key_ok(headers):
            return await _error(send, 401, "missing or wrong API key", "authentication_error")
        size = next((v for k, v in headers if k == "content-length"), b"")
        if size.isdigit() and int(size) > self.max_body_bytes:
            return await self._too_large(send, f"request body of {int(size)} bytes")
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_body_bytes:
                return await self._too_large(send, f"request body of over {self.max_body_bytes} bytes (chunked)")
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        bad = _bad_header(headers) or _bad_body(body)
        if bad is not None:
            return await _error(send, 400, bad, "invalid_request_error")
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _key_ok(self, headers) -> bool:
        """``Authorization: Bearer KEY``, or Anthropic clients' ``x-api-key: KEY``."""
        value = next((v for k, v in headers if k == "authorization"), b"")
        scheme, _, token = value.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            token = next((v for k, v in headers if k == "x-api-key"), b"").decode("latin-1")
        digest = hashlib.sha256(token.encode("latin-1")).digest()
        # every key is compared, so the time taken does not say which one came close
        return any([secrets.compare_digest(digest, k) for k in self.key_digests]) and bool(token)

    async def _too_large(self, send, what: str):
        """413, then the connection closes: the unread rest of the body is never parsed."""
        message = f"{what} exceeds the limit of {self.max_body_bytes} (--max-body-bytes)"
        await _error(send, 413, message, "invalid_request_error", close=True)


def _bad_header(headers) -> str | None:
    for name, value in headers:
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as e:
            return (
                f"the header {name!r} is not valid UTF-8 (byte 0x{value[e.start]:02x} at offset {e.start}); "
                "header values must be ASCII or UTF-8"
            )
    return None


def _bad_body(body: bytes) -> str | None:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return (
            f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start}); "
            "send JSON encoded as UTF-8"
        )
    if not _ESCAPED_SURROGATE.search(text):  # an escaped pair (an emoji from an ASCII-only client) is fine
        return None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None  # the route's parser says what is wrong with it
    where = _lone_surrogate_at(obj)
    if where is None:
        return None
    return (
        f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); "
        "JSON strings must be valid Unicode"
    )


def _lone_surrogate_at(obj) -> str | None:
    """The dotted place of the first string (key or value) with a lone surrogate, or None."""
    stack = [((), obj)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            if _SURROGATE.search(x):
                return ".".join(path) or "the body"
        elif isinstance(x, dict):
            for k, v in x.items():
                if _SURROGATE.search(k):
                    return f"a key in {'.'.join(path) or 'the body'}"
                stack.append(((*path, k), v))
        elif isinstance(x, list):
            stack.extend(((*path, str(i)), v) for i, v in enumerate(x))
    return None


async def _error(send, status: int, message: str, type_: str, close: bool = False) -> None:
    body = json.dumps(fmt.error_body(message, type_, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
