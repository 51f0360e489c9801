"""parse_generate's reuse of a batched call's sampling_params (rollout/server/generate_input.py): rows whose
dicts differ only in sampling_seed share one parse; every row still gets exactly what parsing it
alone gives, and every row's own values are still checked."""

from __future__ import annotations

import pytest

from megarl.rollout.engine.protocol import InvalidRequest
from megarl.rollout.server.generate_input import parse_generate, parse_sampling_params


class _Engine:  # what parse_generate asks of an engine for token-id prompts
    context_length, vocab_size, routing = 64, 100, None

    def validate(self, req, where):
        pass


def _body(params):
    return {"input_ids": [[1, 2, 3]] * len(params), "sampling_params": params, "return_logprob": True}


def test_rows_differing_in_seed_get_what_a_parse_of_each_gives():
    params = [
        {"max_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "stop": "x", "sampling_seed": s}
        for s in (5, 6, None, 7)
    ]
    params.insert(2, {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "sampling_seed": 9})
    params.append({"max_new_tokens": None, "logit_bias": {"4": -1.5}, "sampling_seed": 1})  # not a plain dict
    call = parse_generate(_body(params), _Engine())
    alone = [parse_sampling_params(p, f"sampling_params[{i}]", room=64 - 3)[0] for i, p in enumerate(params)]
    assert [r.params for r in call.requests] == alone
    assert [r.params.sampling_seed for r in call.requests] == [5, 6, 9, None, 7, 1]
    assert call.requests[0].params is not call.requests[1].params
    assert call.requests[-1].params.max_new_tokens == 61 and call.requests[-1].params.logit_bias == ((4, -1.5),)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"temperature": True}, "sampling_params[1].temperature=True must be a finite number"),  # True == 1 as a key
        ({"temperature": 1, "sampling_seed": "7"}, "sampling_params[1].sampling_seed='7' must be an integer"),
        ({"temperature": 1, "sampling_seed": 1.5}, "sampling_params[1].sampling_seed=1.5 must be an integer"),
    ],
)
def test_a_row_like_an_earlier_one_is_still_checked(bad, message):
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_generate(_body([{"temperature": 1, "sampling_seed": 3}, bad]), _Engine())
