"""The loop's weight-sync check: the rollout server sampled with the weights the trainer just
scored with, so their log-probs of the same tokens must agree, or the sync is broken.

    metrics = check_parity(rows, step, cfg.bridge, weight_version, lambda: engine_versions(fleet))

Tolerances: `bridge.parity_atol` per token; up to `bridge.parity_rows_off` of the rows may exceed
it (isolated rows: an MoE router's near-tied experts take different branches in the two engines'
numerics); more raise ParityError, whose message says where the disagreement is and what version
every engine serves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megarl.data.batch import Batch


class ParityError(RuntimeError):
    """The rollout server and the trainer disagree on the log-probs of the same tokens."""


def check_parity(rows: Batch, step: int, bridge, weight_version: int,
                 engine_versions: Callable[[], list[str]]) -> dict:
    """rollout/logprob_* metrics of `rows` (old_log_probs vs rollout_log_probs on the response);
    raises ParityError when more rows than bridge.parity_rows_off allows are off (and
    bridge.check_parity is on). `engine_versions()`: "url: version" of every engine, asked only
    for the error message."""
    mask = rows["response_mask"].bool()
    per_token = (rows["old_log_probs"] - rows["rollout_log_probs"]).abs() * mask
    diff = per_token[mask]
    worst = float(diff.max()) if diff.numel() else 0.0
    rows_off = int((per_token > bridge.parity_atol).any(1).sum())
    allowed = int(bridge.parity_rows_off * len(rows))
    if bridge.check_parity and rows_off > allowed:
        raise ParityError(
            f"step {step}: rollout server and trainer log-probs differ by up to {worst:.2e} "
            f"(bridge.parity_atol={bridge.parity_atol}) in {rows_off} rows, more than the {allowed} "
            f"bridge.parity_rows_off={bridge.parity_rows_off} allows, for weight version "
            f"{weight_version}; the weight sync did not reproduce the trainer's weights. "
            + parity_detail(rows, per_token, bridge.parity_atol, engine_versions()))
    return {"rollout/logprob_diff_max": worst, "rollout/logprob_rows_off": float(rows_off),
            "rollout/logprob_diff_mean": float(diff.mean()) if diff.numel() else 0.0}


def parity_detail(rows: Batch, per_token: torch.Tensor, atol: float, engines: list[str]) -> str:
    """Where the disagreement is: the worst row, the version it was served with, how many tokens
    and rows are off, and the version each engine reports now. Every row off and engines on
    another version: stale weights. One row, a few tokens, the right version: the two sides'
    numerics took different branches (an MoE router's near-tied experts)."""
    row, token = divmod(int(per_token.argmax()), per_token.shape[1])
    served = rows["rollout_weight_version"][row] if "rollout_weight_version" in rows.non_tensors else None
    off = per_token > atol
    return (f"Worst: row {row} ({rows['prompt_lengths'][row].item()}-token prompt, response token {token}: "
            f"trainer {rows['old_log_probs'][row, token].item():.6f}, server "
            f"{rows['rollout_log_probs'][row, token].item():.6f}), served with weight_version {served!r}; "
            f"{int(off.sum())} tokens in {int(off.any(1).sum())} of {len(rows)} rows exceed the "
            f"tolerance; engines report weight versions {', '.join(engines) or 'none'}")


def engine_versions(fleet) -> list[str]:
    """"url: 'version'" for every engine of `fleet`, or "url: unreachable (Error)"."""
    out = []
    for url in fleet.engine_urls:
        try:
            with fleet.client(url, max_retries=0, timeout_s=10.0) as client:
                out.append(f"{url}: {client.get_weight_version()!r}")
        except Exception as exc:  # noqa: BLE001  (a diagnostic: say what happened, go on)
            out.append(f"{url}: unreachable ({type(exc).__name__})")
    return out
