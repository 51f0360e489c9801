"""One embedded engine per test module and the server's app in front of it (FastAPI's TestClient)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from megarl.rollout.engine.generation import GenerationEngine

    engine = GenerationEngine(str(tiny_model_path), max_batch_size=16, seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from megarl.rollout.server.app import create_app

    return TestClient(create_app(engine))
