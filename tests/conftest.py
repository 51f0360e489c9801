import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Spawned test processes import `tests._dist` and `megarl` from the repo root.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A random-init tiny Qwen3-MoE HF checkpoint shared by the whole session (read-only)."""
    from megarl.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-qwen3-moe", seed=0)
