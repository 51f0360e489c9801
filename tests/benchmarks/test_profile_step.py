"""benchmarks/profile_step.py's sample categories: a rank's stacks all start in Ray's worker loop,
so Ray claims a sample only when its innermost frames are Ray's."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_step  # noqa: E402


def test_categories_look_at_the_innermost_frames_for_ray(tmp_path):
    ray = "<module> (ray/_private/workers/default_worker.py:323);main_loop (ray/_private/worker.py:1069)"
    raw = tmp_path / "rank.txt"
    raw.write_text(
        "\n".join(
            [
                f"{ray};update_actor (megarl/engine/megatron/actor.py:179);loss (megarl/engine/megatron/logprob.py:9) 5",
                f"{ray};forward (torch/nn/modules/module.py:1789);_wait (megarl/engine/megatron/cpu/collectives.py:150) 3",
                f"{ray};all_reduce (torch/distributed/distributed_c10d.py:3252) 2",
                f"{ray};deserialize (ray/_private/serialization.py:801) 7",
            ]
        )
        + "\n"
    )
    counts = profile_step.categorise(raw)
    assert counts == {
        "megarl (batches, packing, loss, bridge)": 5,
        "collective (gloo, shared memory)": 5,
        "Ray RPC, serialisation, idle loop": 7,
    }
