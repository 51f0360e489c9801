"""The loop's weight-sync check: the rollout server sampled with the weights the trainer just
scored with, so their log-probs of the same tokens must agree, or the sync is broken.

    metrics = check_parity(rows, step, cfg.bridge, weight_version, lambda: engine_versions(fleet))

Where rows may come from older weight versions (the asynchronous loops), check_current_rows checks
the rows served by the trainer's version and logs how far the others are off.

Where the loop takes the rollout's log-probs as the old ones (actor.old_log_prob: rollout), the
update's first mini-batch (its forward runs on the weights the rollout sampled with) is checked
instead: each rank reports parity_stats of its rows, merged and judged here.

Tolerances: `bridge.parity_atol` per token; up to `bridge.parity_rows_off` of the rows may exceed
it (isolated rows: an MoE router's near-tied experts take different branches in the two engines'
numerics), by at most `bridge.parity_row_max`; more, or further, raise ParityError, whose message
says where the disagreement is and what version every engine serves. A non-finite log-prob on
either side always raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megarl.algo.corrections import merge_parity_stats, parity_stats
from megarl.data.batch import Batch


class ParityError(RuntimeError):
    """The rollout server and the trainer disagree on the log-probs of the same tokens."""


def check_parity_stats(
    stats: dict, step: int, bridge, weight_version: int, detail: Callable[[], str], least_allowed: int = 0
) -> dict:
    """rollout/logprob_* metrics of merged parity_stats; raises ParityError when more rows than
    bridge.parity_rows_off allows (at least `least_allowed` where it is > 0) are off (and
    bridge.check_parity is on). `detail()`: where the disagreement is, asked only for the message."""
    rows_off, worst = int(stats["rows_off"]), stats["diff_max"]
    allowed = int(bridge.parity_rows_off * stats["rows"])
    allowed = max(allowed, least_allowed) if bridge.parity_rows_off > 0 else 0
    nonfinite = int(stats.get("nonfinite", 0))
    if bridge.check_parity and nonfinite:
        raise ParityError(
            f"step {step}: {nonfinite} response tokens have a non-finite log-prob on the rollout "
            f"server's or the trainer's side, for weight version {weight_version}. " + detail()
        )
    if bridge.check_parity and rows_off and worst > bridge.parity_row_max:
        raise ParityError(
            f"step {step}: rollout server and trainer log-probs differ by {worst:.2e} at one token, "
            f"beyond bridge.parity_row_max={bridge.parity_row_max} (what an isolated row tolerated by "
            f"bridge.parity_rows_off may differ by), for weight version {weight_version}. " + detail()
        )
    if bridge.check_parity and rows_off > allowed:
        raise ParityError(
            f"step {step}: rollout server and trainer log-probs differ by up to {worst:.2e} "
            f"(bridge.parity_atol={bridge.parity_atol}) in {rows_off} rows, more than the "
            f"{allowed} bridge.parity_rows_off={bridge.parity_rows_off} allows (of {int(stats['rows'])} "
            f"rows checked), for weight version {weight_version}; the weight sync did not reproduce "
            "the trainer's weights. " + detail()
        )
    return {
        "rollout/logprob_diff_max": worst,
        "rollout/logprob_rows_off": float(rows_off),
        "rollout/logprob_nonfinite": float(nonfinite),
        "rollout/logprob_diff_mean": stats["diff_sum"] / stats["tokens"] if stats["tokens"] else 0.0,
    }


def check_parity(rows: Batch, step: int, bridge, weight_version: int, engine_versions: Callable[[], list[str]]) -> dict:
    """rollout/logprob_* metrics of `rows` (old_log_probs vs rollout_log_probs on the response);
    raises ParityError when more rows than bridge.parity_rows_off allows are off (and
    bridge.check_parity is on). `engine_versions()`: "url: version" of every engine, asked only
    for the error message."""
    stats = parity_stats(rows["old_log_probs"], rows["rollout_log_probs"], rows["response_mask"], bridge.parity_atol)

    def detail() -> str:
        mask = rows["response_mask"].bool()
        per_token = (rows["old_log_probs"] - rows["rollout_log_probs"]).abs()
        per_token = torch.where(mask, torch.where(per_token.isfinite(), per_token, torch.inf), 0.0)
        return parity_detail(rows, per_token, bridge.parity_atol, engine_versions())

    return check_parity_stats(stats, step, bridge, weight_version, detail)


def version_number(label) -> int | None:
    """A served weight_version label as the trainer's integer version ("default" is the initial 0)."""
    if label in (None, "", "default"):
        return 0 if label == "default" else None
    try:
        return int(label)
    except (TypeError, ValueError):
        return None


def check_current_rows(
    rows: Batch, step: int, bridge, weight_version: int, engine_versions: Callable[[], list[str]]
) -> dict:
    """The check where rows may come from older versions (the asynchronous loops): rows served by
    the version the trainer holds are checked as check_parity does; rows from older versions
    cannot agree with it, so their difference is logged, not checked (it is how far off-policy
    they are), with async/staleness_{mean,max}. A row that spans versions (fully_async's partial
    rollouts, rollout_start_version) counts from the one it started under."""
    served = [version_number(v) for v in rows["rollout_weight_version"]]
    if "rollout_start_version" in rows.non_tensors:
        served = [
            None if v is None else min(v, version_number(s)) for v, s in zip(served, rows["rollout_start_version"])
        ]
    behind = [weight_version - v for v in served if v is not None]
    current = bool(behind) and max(behind) == 0 and len(behind) == len(served)
    bridge = bridge if current else dataclasses.replace(bridge, check_parity=False)
    metrics = check_parity(rows, step, bridge, weight_version, engine_versions)
    if behind:
        metrics["async/staleness_mean"] = sum(behind) / len(behind)
        metrics["async/staleness_max"] = float(max(behind))
    return metrics


def probe_engines(
    rows: Batch, step: int, bridge, weight_version: int, fleet, temperature: float, probe_rows: int
) -> dict:
    """The check of the last sync where the step's rows cannot give it (they were sampled by older
    versions: the asynchronous loops). `probe_rows` of the step's rows, spread over the batch, are
    scored teacher-forced by every engine under the weights it holds now (RolloutClient.score) and
    compared with the trainer's old log-probs of the same tokens, computed by the version it
    holds; every engine must answer with that version. parity/* metrics; ParityError as
    check_parity (one isolated row tolerated while bridge.parity_rows_off > 0). An engine that does
    not answer (dead, being restarted: the fleet resyncs it before it serves) is counted, not judged.
    The two halves: `start_probe` (before the trainer's old log-probs exist: the engines score
    while the trainer computes them) and `judge_probe`."""
    return judge_probe(start_probe(rows, fleet, temperature, probe_rows), rows, step, bridge, weight_version)


@dataclasses.dataclass
class Probe:
    picked: list[int]  # the probed rows
    scoring: dict  # engine URL -> the Future of its scores, or the exception that refused the call


def start_probe(rows: Batch, fleet, temperature: float, probe_rows: int, routed: bool = False) -> Probe:
    """Send the probe rows to every engine to score; returns at once (probe_engines). `routed`
    (routing replay): the engines return the experts they routed to (judge_probe's `replay`)."""
    k = min(probe_rows, len(rows))
    picked = [round(i * (len(rows) - 1) / max(k - 1, 1)) for i in range(k)]
    mask = rows["response_mask"][picked]
    ends = [int(m.nonzero().max()) + 1 if m.any() else 0 for m in mask]
    starts = [int(rows["prompt_lengths"][i]) for i in picked]
    sequences = [rows["input_ids"][i, : p + e].tolist() for i, p, e in zip(picked, starts, ends)]
    scoring = {}
    for url in fleet.engine_urls:
        try:
            client = fleet.kept_client(url, max_retries=0, timeout_s=60.0)
            scoring[url] = client.score_later(sequences, starts, temperature, return_routed_experts=routed)
        except Exception as exc:  # noqa: BLE001  (judged as unreachable)
            scoring[url] = exc
    return Probe(picked, scoring)


def judge_probe(
    probe: Probe,
    rows: Batch,
    step: int,
    bridge,
    weight_version: int,
    replay: Callable[[Batch], torch.Tensor] | None = None,
) -> dict:
    """The engines' scores of `probe` against the trainer's old log-probs in `rows` (probe_engines).
    With routing replay the old log-probs replayed the rollout's experts, which the version the
    engines hold now need not choose: `replay(rows)` then gives the trainer's log-probs of the
    probe rows replaying the experts each engine chose for them (start_probe's `routed`), so both
    sides route alike, as in the sync loop's check."""
    picked = probe.picked
    mask = rows["response_mask"][picked]
    want = {str(weight_version)} | ({"default", "0", None} if weight_version == 0 else set())
    old, parts, unreachable, replayed = rows["old_log_probs"][picked], [], 0, {}
    for url, scoring in probe.scoring.items():
        try:
            if isinstance(scoring, Exception):
                raise scoring
            scored = scoring.result()
        except Exception:  # noqa: BLE001  (a dead engine is the fleet's to restart; counted)
            unreachable += 1
            continue
        served = {answer[1] for answer in scored}
        if not served <= want:
            raise ParityError(
                f"step {step}: engine {url} answers with weight version {sorted(map(str, served))} after "
                f"the sync of version {weight_version}: the sync did not reach it"
            )
        engine = torch.full_like(old, float("nan"))
        for j, (lps, *_) in enumerate(scored):
            engine[j, : len(lps)] = torch.tensor(lps[: old.shape[1]], dtype=old.dtype)
        trainer = old
        if replay is not None:
            records = tuple(answer[2] for answer in scored)
            if records not in replayed:
                replayed[records] = replay(_with_records(rows[picked], records))
            trainer = replayed[records]
        parts.append(parity_stats(trainer, engine, mask, bridge.parity_atol))
    metrics = {"parity/engines": float(len(parts)), "parity/engines_unreachable": float(unreachable)}
    if not parts:
        return metrics
    stats = merge_parity_stats(parts)
    checked = check_parity_stats(
        stats, step, bridge, weight_version, lambda: f"Probe rows {picked} on {len(parts)} engines.", least_allowed=1
    )
    metrics["parity/rows"] = stats["rows"]  # rows x engines
    return {**metrics, **{k.replace("rollout/logprob_", "parity/"): v for k, v in checked.items()}}


def _with_records(rows: Batch, records: tuple) -> Batch:
    """The probe rows with the engine's routing records as their `routed_experts` column."""
    from megarl.wire import routing

    column = torch.full_like(rows["routed_experts"], routing.NO_EXPERT)
    for j, record in enumerate(records):
        m = rows["response_mask"][j]
        fed = int(rows["prompt_lengths"][j]) + (int(m.nonzero().max()) + 1 if m.any() else 0) - 1  # start_probe's
        ids = routing.decode(record, fed)
        column[j, : len(ids)] = torch.from_numpy(ids.astype("int16"))
    out = rows.select("input_ids", "prompt_lengths", "responses", "response_mask")
    out["routed_experts"] = column
    return out


def check_update_parity(
    per_rank: list[dict], step: int, bridge, weight_version: int, engine_versions: Callable[[], list[str]]
) -> dict:
    """The check and rollout/entropy from the update's first mini-batch, whose forward ran on the
    weights the rollout sampled with (actor.old_log_prob=rollout): the parity/* sums leave each
    rank's metrics (`per_rank`, changed in place) and are merged here. Half the step's rows or
    fewer are checked (reshuffled every step); a failure raises after the update, before the sync."""
    sums = [{k[len("parity/") :]: d.pop(k) for k in list(d) if k.startswith("parity/")} for d in per_rank if d]
    sums = [s for s in sums if s]
    if not sums:
        raise RuntimeError("actor.old_log_prob=rollout: the update returned no parity sums")
    stats = merge_parity_stats(sums)
    entropy = sum(s["entropy_sum"] for s in sums) / max(sum(s["entropy_tokens"] for s in sums), 1.0)

    def detail() -> str:
        return (
            "Checked on the update's first mini-batch; actor.old_log_prob=recompute checks every "
            "row and names the worst. Engines report weight versions " + ", ".join(engine_versions())
        )

    return {
        **check_parity_stats(stats, step, bridge, weight_version, detail),
        "rollout/entropy": entropy,
        "rollout/logprob_rows_checked": stats["rows"],
    }


def parity_detail(rows: Batch, per_token: torch.Tensor, atol: float, engines: list[str]) -> str:
    """Where the disagreement is: the worst row, the version it was served with, how many tokens
    and rows are off, and the version each engine reports now. Every row off and engines on
    another version: stale weights. One row, a few tokens, the right version: the two sides'
    numerics took different branches (an MoE router's near-tied experts)."""
    row, token = divmod(int(per_token.argmax()), per_token.shape[1])
    served = rows["rollout_weight_version"][row] if "rollout_weight_version" in rows.non_tensors else None
    off = per_token > atol
    return (
        f"Worst: row {row} ({rows['prompt_lengths'][row].item()}-token prompt, response token {token}: "
        f"trainer {rows['old_log_probs'][row, token].item():.6f}, server "
        f"{rows['rollout_log_probs'][row, token].item():.6f}), served with weight_version {served!r}; "
        f"{int(off.sum())} tokens in {int(off.any(1).sum())} of {len(rows)} rows exceed the "
        f"tolerance; engines report weight versions {', '.join(engines) or 'none'}"
    )


def engine_versions(fleet) -> list[str]:
    """ "url: 'version'" for every engine of `fleet`, or "url: unreachable (Error)"."""
    out = []
    for url in fleet.engine_urls:
        try:
            with fleet.client(url, max_retries=0, timeout_s=10.0) as client:
                out.append(f"{url}: {client.get_weight_version()!r}")
        except Exception as exc:  # noqa: BLE001  (a diagnostic: say what happened, go on)
            out.append(f"{url}: unreachable ({type(exc).__name__})")
    return out
