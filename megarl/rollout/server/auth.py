"""Who may talk to the embedded rollout server: an API key, as SGLang's --api-key works.

With a key, every request needs `Authorization: Bearer KEY`, except what SGLang exempts so that
liveness probes and metric scrapers need no secret: paths starting with /health (so also
/health_generate) or /metrics, and CORS preflight (OPTIONS). Without a key the server must bind
a loopback address only. The key comes from --api-key or, so that it never has to appear on a
command line (where `ps` shows it) or in a launcher's log, from MEGARL_ROLLOUT_API_KEY. It is
compared in constant time and never echoed or logged.
"""

from __future__ import annotations

import hmac
import json
import os

API_KEY_ENV = "MEGARL_ROLLOUT_API_KEY"
_EXEMPT_PREFIXES = ("/health", "/metrics")


def resolve_api_key(flag_value: str | None) -> str | None:
    """--api-key wins; else the environment variable; an empty value means no key."""
    key = flag_value if flag_value is not None else os.environ.get(API_KEY_ENV)
    return key or None


def redacted(server_args: dict) -> dict:
    """server_args safe to echo: the key replaced by a marker that only says one is set."""
    return {**server_args, "api_key": "<set>" if server_args.get("api_key") else None}


class ApiKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so streamed responses still see client disconnects."""

    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("ApiKeyMiddleware needs a non-empty api_key")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self._exempt(scope) or self._authorized(scope):
            return await self.app(scope, receive, send)
        body = json.dumps(
            {
                "error": {
                    "message": "missing or wrong API key: send the header "
                    "'Authorization: Bearer <key>' (the server's --api-key)"
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def _exempt(scope) -> bool:
        return scope.get("method") == "OPTIONS" or scope.get("path", "").startswith(_EXEMPT_PREFIXES)

    def _authorized(self, scope) -> bool:
        given = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)
