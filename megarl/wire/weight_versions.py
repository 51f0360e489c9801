"""meta_info["weight_versions"]: which weights produced each output token, in SGLang's shape
(0.5.23's `add_weight_versions_to_meta_info`, the `WeightVersionSpan` of its sglang.api.v1 schema):
`[{"version": v, "start": i, "end": j}, ...]`, spans of output-token indices [i, j) in order,
each starting where the previous one ended. Engines keep the same record as runs
`[[version, n_tokens], ...]`; these convert between the two."""

from __future__ import annotations


def spans_from_runs(runs: list, version_if_empty: str | None = None) -> list[dict]:
    """SGLang's spans of `runs`. An answer with no output tokens gets one empty span of the
    version it ran under (`version_if_empty`), as SGLang reports it."""
    spans, start = [], 0
    for version, count in runs:
        if count:
            spans.append({"version": version, "start": start, "end": start + count})
            start += count
    if not spans and version_if_empty is not None:
        spans.append({"version": version_if_empty, "start": 0, "end": 0})
    return spans


def runs_from_spans(spans: list) -> list[list]:
    """`[[version, n_tokens], ...]` of SGLang's spans (empty spans dropped)."""
    runs: list[list] = []
    for span in spans:
        count = int(span["end"]) - int(span["start"])
        if count > 0:
            runs.append([span["version"], count])
    return runs
