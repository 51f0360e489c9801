"""Partial rollout, client side: resume a request that was aborted mid-generation (a weight update
interrupted it) and merge the two answers into one.

An interrupted request answers with finish_reason abort and the tokens it generated so far, each
with its log-prob and the weights that produced it (meta_info weight_versions, SGLang's spans;
megarl/wire/weight_versions.py). To finish it after the weights changed, send the prompt + that partial
output as a new prompt with max_new_tokens (and min_new_tokens) reduced by what was generated and
otherwise the same sampling parameters (`resume_request`), then concatenate (`merge_partial`):
output_ids, output log-probs and weight_versions of the merged answer are those of the first
part followed by those of the resumed part, so every token keeps the log-prob of the weights that
produced it, which is what off-policy corrections need. MoE routing records (meta_info
routed_experts, megarl/wire/routing.py) are kept the same way: the resumed request asks for the
records from the first token the first part did not feed (routed_experts_start_len), so every
token keeps the experts of the forward that produced its successor, under the version that ran
it. `resume_partial` does both with a RolloutClient, as often as the request keeps being
interrupted.

What a resumed request cannot know, compared with one that ran uninterrupted (SGLang's partial
rollout has the same limits): frequency / presence / repetition penalties count only the resumed
part's tokens (the partial output is prompt now); a stop string that straddles the boundary is
not seen; a sampling_seed restarts its random stream; the merged text is the two texts
concatenated (a tokenizer may decode the joined ids slightly differently).
"""

from __future__ import annotations

import dataclasses

from megarl.rollout.client.client import GenerateOutput
from megarl.wire import routing
from megarl.wire.weight_versions import runs_from_spans, spans_from_runs

_COUNTED = ("max_new_tokens", "min_new_tokens")  # reduced by the tokens already generated


def is_partial(output: GenerateOutput) -> bool:
    """An answer that was interrupted (finish_reason abort) and can be resumed."""
    return (output.finish_reason or {}).get("type") == "abort"


def resume_request(input_ids: list[int], sampling_params: dict, partial: GenerateOutput) -> tuple[list[int], dict]:
    """(input_ids, sampling_params) of the request that continues `partial`, an aborted answer to
    (input_ids, sampling_params). Raises ValueError for n > 1 (resume each sample on its own)."""
    if int(sampling_params.get("n", 1) or 1) != 1:
        raise ValueError(
            f"sampling_params n={sampling_params['n']}: a partial answer is one sample; resume each "
            "sample as its own request with n=1"
        )
    if "max_new_tokens" not in sampling_params or sampling_params["max_new_tokens"] is None:
        raise ValueError(
            "sampling_params has no max_new_tokens: without it the resumed request's budget "
            "cannot be reduced by the tokens already generated; set max_new_tokens"
        )
    done = len(partial.output_ids)
    params = dict(sampling_params)
    for key in _COUNTED:
        if params.get(key) is not None:
            params[key] = max(0, int(params[key]) - done)
    return list(input_ids) + list(partial.output_ids), params


def merge_partial(first: GenerateOutput, resumed: GenerateOutput) -> GenerateOutput:
    """One answer: `first`'s tokens, log-probs and weight versions, then `resumed`'s; the finish
    reason, weight_version and other meta_info of `resumed` (whose prompt_tokens counted the
    partial output: the original prompt's count is restored). Routing records are joined when
    both parts have them (`resumed` asked from routed_experts_start_len = resume_start(first)),
    else dropped: a record that covers only a part would misalign with the tokens."""
    if (first.output_logprobs is None) != (resumed.output_logprobs is None):
        raise ValueError(
            "one part of a partial rollout has output log-probs and the other not; ask both with return_logprob=true"
        )
    meta_a, meta_b = first.meta_info, resumed.meta_info
    meta = dict(meta_b)
    meta["completion_tokens"] = len(first.output_ids) + len(resumed.output_ids)
    if "prompt_tokens" in meta_a:
        meta["prompt_tokens"] = meta_a["prompt_tokens"]
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs", "output_token_entropy"):
        if key in meta_a and key in meta_b:
            meta[key] = list(meta_a[key]) + list(meta_b[key])
        else:
            meta.pop(key, None)  # one part lacks it: a half list would misalign with output_ids
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        meta.pop(key, None)
        if key in meta_a:  # the original prompt's, not those of prompt + partial output
            meta[key] = meta_a[key]
    meta.pop("routed_experts", None)
    if isinstance(meta_a.get("routed_experts"), str) and isinstance(meta_b.get("routed_experts"), str):
        meta["routed_experts"] = routing.concat(meta_a["routed_experts"], meta_b["routed_experts"])
    runs_a, runs_b = token_version_runs(first), token_version_runs(resumed)
    if runs_a is not None and runs_b is not None:
        meta["weight_versions"] = spans_from_runs(merge_runs(runs_a, runs_b), meta.get("weight_version"))
    else:
        meta.pop("weight_versions", None)
    if "e2e_latency" in meta_a and "e2e_latency" in meta_b:
        meta["e2e_latency"] = meta_a["e2e_latency"] + meta_b["e2e_latency"]
    meta["num_partial_resumes"] = meta_a.get("num_partial_resumes", 0) + 1
    logprobs = None if first.output_logprobs is None else list(first.output_logprobs) + list(resumed.output_logprobs)
    return GenerateOutput(
        output_ids=list(first.output_ids) + list(resumed.output_ids),
        text=first.text + resumed.text,
        output_logprobs=logprobs,
        finish_reason=resumed.finish_reason,
        meta_info=meta,
    )


def token_version_runs(output: GenerateOutput) -> list | None:
    """The weight version of each output token as runs [[version, count], ...]: the engine's own
    record (meta_info weight_versions: megarl's embedded engine, SGLang from 0.5.23), or, from an
    engine that reports only the version an answer ended under (weight_version), that version for all of its
    tokens: each segment of a resumed answer was generated whole by one version (the pause
    between segments is where the weights changed). None when neither is known."""
    spans = output.meta_info.get("weight_versions")
    if spans is not None:
        return runs_from_spans(spans)
    version = output.meta_info.get("weight_version")
    if version is None:
        return None
    return [[version, len(output.output_ids)]] if output.output_ids else []


def merge_runs(a: list, b: list) -> list[list]:
    """Concatenate two run-length lists [[version, count], ...], joining the runs that meet."""
    runs = [list(run) for run in a]
    for version, count in b:
        if runs and runs[-1][0] == version:
            runs[-1][1] += count
        else:
            runs.append([version, count])
    return runs


async def resume_partial(
    client,
    input_ids: list[int],
    sampling_params: dict,
    partial: GenerateOutput,
    return_logprob: bool = True,
    rid: str | None = None,
    return_routed_experts: bool = False,
) -> GenerateOutput:
    """Finish `partial` (an answer to input_ids / sampling_params) with `client` (a RolloutClient;
    its `agenerate`) and return the merged answer. An answer that is not partial is returned as
    it is; one that is interrupted again comes back partial (merged so far): call again.
    A partial answer that already has all its tokens is finished with finish_reason length."""
    if not is_partial(partial):
        return partial
    ids, params = resume_request(input_ids, sampling_params, partial)
    if params["max_new_tokens"] == 0:
        budget = sampling_params["max_new_tokens"]
        return GenerateOutput(
            partial.output_ids,
            partial.text,
            partial.output_logprobs,
            {"type": "length", "length": budget},
            {**partial.meta_info, "finish_reason": {"type": "length", "length": budget}},
        )
    routed = {"return_routed_experts": True, "routed_experts_start_len": resume_start(input_ids, partial)}
    if return_routed_experts and not partial.output_ids:  # nothing of the first part is kept
        partial = dataclasses.replace(partial, meta_info={**partial.meta_info, "routed_experts": ""})
    (resumed,) = await client.agenerate(
        [ids],
        [params],
        return_logprob=return_logprob,
        rids=None if rid is None else [rid],
        **(routed if return_routed_experts else {}),
    )
    return merge_partial(partial, resumed)


def resume_start(input_ids: list[int], partial: GenerateOutput) -> int:
    """The first token whose routing record the resumed request must return: the first part fed
    prompt + output - 1 tokens (its last sampled token never went through the model), or nothing
    when it was aborted before its prefill produced a token."""
    return len(input_ids) + len(partial.output_ids) - 1 if partial.output_ids else 0
