"""Request bodies and control answers shared by the embedded server's route modules."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse


class ApiError(Exception):
    """Answered as SGLang's {"error": {"message": ...}} with `status` (server.py's handler)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def read_body(request: Request) -> dict:
    """The JSON object body, or the query parameters when the body is empty (GET-style calls)."""
    raw = await request.body()
    if not raw.strip():
        return dict(request.query_params)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def control(ok: bool, message: str, **extra) -> JSONResponse:
    """SGLang's control answer: {"success", "message"}, 200 on success and 400 on failure."""
    return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)
