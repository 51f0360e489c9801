"""A size limit on request bodies for the embedded rollout server (pure ASGI middleware).

Without one, any caller (or, below the API key, anyone on a loopback-only host) could make the
server buffer and parse a body of any size: every route reads its whole body into memory before
looking at it. A request whose Content-Length is over the limit is answered 413 before a byte of
its body is read; a body without Content-Length (chunked) is counted as the route reads it and
refused as soon as it passes the limit. The answer is SGLang's error shape naming the limit and
the flag that raises it.

Order with ApiKeyMiddleware (app.py): the key is checked first (outermost), so a keyless
request is answered 401 from its headers alone, whatever its size, and no byte of its body is
read or buffered; only a caller with the key ever reaches the limit (and learns it).

Pure ASGI, not BaseHTTPMiddleware, for the reason auth.py gives (streamed responses must still
see client disconnects).
"""

from __future__ import annotations

import json
import math

MAX_BODY_FLAG = "--max-body-mb"
# The largest legitimate bodies: /update_weights_from_tensor carries tensor *handles*, not bytes
# (weights_codec): a flattened bucket's payload is ~120 bytes of base64 per tensor, so even a whole
# 40k-tensor MoE (Qwen3-235B, DeepSeek-V3) in one bucket, one payload per rank of a tp=8 engine, is
# ~40 MB; /update_weights_from_reshard's per-rank message lists are of the same order; a batched
# /generate of 256 prompts of 32k tokens is ~60 MB of JSON. 256 MB leaves room above all of them.
DEFAULT_MAX_BODY_MB = 256.0


class BodyTooLarge(Exception):
    """Raised from receive() once a body without Content-Length passes the limit."""


def max_body_bytes(mb: float) -> int:
    if not (mb > 0 and math.isfinite(mb)):
        raise ValueError(f"{MAX_BODY_FLAG}={mb} must be a positive number of megabytes")
    return int(mb * 2**20)


class BodySizeLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"BodySizeLimitMiddleware needs max_bytes > 0, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await _answer(send, 400, f"Content-Length {declared[:40]!r} is not a number")
            if size > self.max_bytes:
                return await _answer(send, 413, self._message(f"the request body ({size} bytes)"))
        received, started = 0, False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge()
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if started:  # no route answers before reading its body; if one did, end the connection
                raise
            await _answer(
                send, 413, self._message(f"the request body (at least {received} bytes, sent without Content-Length)")
            )

    def _message(self, what: str) -> str:
        mb = self.max_bytes / 2**20
        return (
            f"{what} is over this server's limit of {mb:g} MB ({self.max_bytes} bytes); start the "
            f"server with {MAX_BODY_FLAG} N to accept larger bodies"
        )


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
