"""What the loop tests assert of a step's weight-sync parity metrics.

A stale or broken sync moves every row: rows one update behind differ by ~0.09 per token on
average on the tiny MoE, and every row is beyond bridge.parity_atol. With the right weights the
two sides agree to ~1e-7, except that an MoE router whose top-k experts are near-tied can route
one token differently in the trainer and the engine, which moves that one row by 1e-4..1e-2 (the
trainer's own check tolerates such isolated rows: bridge.parity_rows_off). So a test asserts the
mean and the number of rows off, not the single worst token.
"""

from __future__ import annotations

MEAN_BOUND = 1e-4  # per token: right weights ~1e-7 (one near-tied token adds <= ~1e-5); stale ~0.09


def assert_served_by_the_trainers_weights(metrics: dict, prefix: str = "rollout/logprob_") -> None:
    """The step's rows were sampled by the weights the trainer holds (prefix "parity/": the
    engines' re-scoring of a few rows after a sync, in the asynchronous loops)."""
    parity = {k: v for k, v in metrics.items() if k.startswith(prefix)}
    assert metrics[prefix + "diff_mean"] < MEAN_BOUND and metrics[prefix + "rows_off"] <= 1, parity
    assert metrics[prefix + "nonfinite"] == 0, parity
