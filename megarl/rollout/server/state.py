"""What the embedded server's routes share: the engine and the server's settings, one object on app.state.

create_app (app.py) sets it once; every route module (routes/) reads it through `server_of`, so a
route reaches the engine the same way whichever router it is on.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from megarl.rollout.engine.generation import GenerationEngine


@dataclass(frozen=True)
class ServerState:
    engine: GenerationEngine
    server_args: dict  # the command line and create_app's settings, the API key redacted (/get_server_info)
    weight_dirs: list[str]  # the only directories /update_weights_from_disk may read (weight_dirs.py)


def server_of(request: Request) -> ServerState:
    return request.app.state.server


def engine_of(request: Request) -> GenerationEngine:
    return request.app.state.server.engine
