"""Model rewards (megarl/reward/{remote,serve,genrm,model}.py) and scoring that overlaps generation.

Remote: RemoteReward and RowScorer against the reference server (`python -m megarl.reward.serve`,
a real subprocess started once for the module, hosting the rule verifiers) and, for the transport
faults a real server does not make on demand (5xx, a hang past the timeout, a short answer), a
purpose-built fault-injecting endpoint served by uvicorn in a thread. GenRM: template and parsing
units; the parse path against a fake SGLang-API judge (a FastAPI app returning canned answers,
so the scores are known); and the real text path against an embedded rollout server on the tiny
model (its answers are random characters: what is checked is that each one is parsed exactly as
an independent greedy request's answer parses). Overlap: RolloutManager's on_rows callback
against a real embedded server (every prompt once, before generate returns, with the rows'
responses) and OverlapScoring's ordering, completeness and hidden-time accounting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megarl.config.schema import RewardConfig, RewardModelConfig
from megarl.data.batch import Batch
from megarl.procs.net import free_port
from megarl.reward import RewardError, score
from megarl.reward.genrm import DEFAULT_TEMPLATE, GenerativeReward, fill_template, parse_score
from megarl.reward.model import RowColumns, RowScorer, _union
from megarl.reward.remote import Failure, RemoteReward
from megarl.reward.serve import RewardServerProcess
from megarl.rollout.client.client import GenerateOutput, RolloutClient
from megarl.rollout.client.manager import RolloutManager, SamplingSpec
from megarl.rollout.fleet.server_process import RolloutServerProcess
from tests._http import ThreadedServer

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]


def row(data_source="megarl/digits", response="2", ground_truth="2", prompt="382"):
    return {
        "data_source": data_source,
        "prompt": prompt,
        "messages": [{"role": "user", "content": prompt}],
        "response": response,
        "ground_truth": ground_truth,
        "extra_info": {"index": np.int64(3)},
    }


def columns(rows: list[dict], first: int = 0) -> RowColumns:
    return RowColumns(
        list(range(first, first + len(rows))),
        [r["data_source"] for r in rows],
        [r["messages"] for r in rows],
        [r["response"] for r in rows],
        [r["ground_truth"] for r in rows],
        [r["extra_info"] for r in rows],
    )


def scorer(**model) -> RowScorer:
    overlap = model.pop("overlap", None)
    return RowScorer(RewardConfig(model=RewardModelConfig(**model), overlap=overlap))


def faulty_endpoint(fail_first: int = 0, hang_first: int = 0, short: bool = False) -> FastAPI:
    """The remote contract with faults: the first `fail_first` POSTs get 503, the first
    `hang_first` answer after 3 s; `short` answers one score too few. A row's score is the length
    of its response. Records every batch's size."""
    app = FastAPI()
    app.state.sizes, app.state.posts = [], 0

    @app.post("/score")
    async def score_rows(request: Request):
        body = await request.json()
        app.state.posts += 1
        post = app.state.posts
        if post <= fail_first:
            return JSONResponse({"error": "warming up"}, status_code=503)
        if post <= hang_first:
            await asyncio.sleep(3.0)
        app.state.sizes.append(len(body["rows"]))
        scores = [float(len(r["response"])) for r in body["rows"]]
        return {"scores": scores[:-1] if short else scores}

    return app


@pytest.fixture(scope="module")
def reward_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("reward-server") / "serve.log"
    with RewardServerProcess(free_port(), log_path=log) as server:
        yield server


# ---- remote ---------------------------------------------------------------------------------------
def test_reference_server_scores_like_the_local_rule_verifiers(reward_server):
    rows = [row("megarl/digits", r, g) for r, g in [("2", "2"), ("7", "2"), ("45", "45"), ("40", "45")]]
    rows += [row("megarl/arith", r, g) for r, g in [("it is 1,024", "1024"), ("12 or 13", "12")]]
    client = RemoteReward(reward_server.url, batch_size=4, concurrency=2)
    try:
        got = client.score(rows)
    finally:
        client.close()
    expected = [score(r["data_source"], r["response"], r["ground_truth"]) for r in rows]
    assert got == expected == [1.0, 0.0, 1.0, 0.5, 1.0, 0.0]


def test_rows_go_in_batches_and_come_back_in_order():
    with ThreadedServer(faulty_endpoint()) as endpoint:
        client = RemoteReward(f"{endpoint.url}/score", batch_size=3, concurrency=2)
        rows = [row(response="x" * k) for k in range(10)]
        assert client.score(rows) == [float(k) for k in range(10)]
        assert sorted(endpoint.app.state.sizes) == [1, 3, 3, 3]
        client.close()


def test_5xx_and_timeouts_are_retried_and_counted():
    with ThreadedServer(faulty_endpoint(fail_first=2)) as endpoint:
        client = RemoteReward(f"{endpoint.url}/score", max_retries=3, backoff_s=0.01)
        assert client.score([row(response="abc")]) == [3.0]
        assert client.take_stats() == {"reward/model_retries": 2.0}
        client.close()
    with ThreadedServer(faulty_endpoint(hang_first=1)) as endpoint:
        client = RemoteReward(f"{endpoint.url}/score", timeout_s=0.5, max_retries=1, backoff_s=0.01)
        assert client.score([row(response="ab")]) == [2.0]
        assert client.take_stats() == {"reward/model_retries": 1.0}
        client.close()


def test_exhausted_retries_4xx_and_bad_answers_are_failures_not_zeros(reward_server):
    with ThreadedServer(faulty_endpoint(fail_first=100)) as endpoint:
        client = RemoteReward(f"{endpoint.url}/score", max_retries=1, backoff_s=0.01)
        out = client.score([row(), row()])
        assert all(isinstance(f, Failure) for f in out)
        assert "failed 2 time(s)" in out[0].reason and "HTTP 503" in out[0].reason
        client.close()
    with ThreadedServer(faulty_endpoint(short=True)) as endpoint:
        client = RemoteReward(f"{endpoint.url}/score")
        out = client.score([row(), row()])
        assert all(isinstance(f, Failure) and "1 scores for a batch of 2 rows" in f.reason for f in out)
        client.close()
    wrong_path = reward_server.url.replace("/score", "/nowhere")
    client = RemoteReward(wrong_path, max_retries=3)
    out = client.score([row()])
    assert isinstance(out[0], Failure) and "HTTP 404" in out[0].reason
    assert client.take_stats() == {"reward/model_retries": 0.0}  # a 4xx is not retried
    client.close()
    bad = httpx.post(reward_server.url, json={"rows": [{"data_source": "x"}]}, timeout=10)
    assert bad.status_code == 400 and "response" in bad.json()["error"]["message"]


def test_a_failed_row_raises_naming_the_row_and_data_source(reward_server):
    rows = [row(), row(), row("no/such-source", "1", "1"), row()]
    s = scorer(kind="remote", url=reward_server.url)
    with pytest.raises(RewardError, match=r"row 12 \(data_source 'no/such-source'.*no reward rule"):
        s.score_columns(columns(rows, first=10))
    s.close()


def test_fallback_scores_failed_rows_and_counts_them(reward_server):
    rows = [row(response="2"), row("no/such-source", "1", "1"), row(response="5")]
    s = scorer(kind="remote", url=reward_server.url, on_failure="fallback", fallback_score=-1.0)
    assert s.score_columns(columns(rows)).tolist() == [1.0, -1.0, 0.0]
    metrics = s.take_metrics()
    assert metrics["reward/model_failures"] == 1.0 and metrics["reward/model_unparsable"] == 0.0
    assert metrics["reward/model_mean"] == 0.5  # the two rows the model scored
    assert s.take_metrics()["reward/model_failures"] == 0.0  # reset after each take
    s.close()


def test_combine_add_sums_rule_and_model_scores(reward_server):
    rows = [row(response="2"), row(response="9")]
    s = scorer(kind="remote", url=reward_server.url, combine="add")
    assert s.score_columns(columns(rows)).tolist() == [2.0, 0.0]  # rule 1 + model 1, 0 + 0
    s.close()


# ---- genrm: units ---------------------------------------------------------------------------------
def test_template_fills_placeholders_once_and_keeps_other_braces():
    text = fill_template(
        "P={prompt} R={response} G={ground_truth} \\boxed{N}",
        {"prompt": "a", "response": "{ground_truth}", "ground_truth": "7"},
    )
    assert text == "P=a R={ground_truth} G=7 \\boxed{N}"
    assert "\\boxed{N}" in fill_template(DEFAULT_TEMPLATE, row())


@pytest.mark.parametrize(
    "answer,expected",
    [
        ("good. \\boxed{7}", 0.7),
        ("\\boxed{2} no, \\boxed{ 10 }", 1.0),
        ("\\boxed{0.5}", 0.05),
    ],
)
def test_parse_reads_the_last_boxed_score_on_the_scale(answer, expected):
    pattern = re.compile(RewardModelConfig().score_pattern)
    assert parse_score(answer, pattern, 0.0, 10.0) == pytest.approx(expected, abs=1e-12)


def test_parse_failures_say_why():
    pattern = re.compile(RewardModelConfig().score_pattern)
    unparsable = parse_score("I think 7", pattern, 0.0, 10.0)
    assert isinstance(unparsable, Failure) and unparsable.unparsable and "I think 7" in unparsable.reason
    outside = parse_score("\\boxed{11}", pattern, 0.0, 10.0)
    assert isinstance(outside, Failure) and not outside.unparsable and "outside its scale" in outside.reason
    assert parse_score("score 3 then 4", re.compile(r"\d"), 0.0, 4.0) == 1.0  # no group: the whole match


# ---- genrm: a fake judge with canned answers (the parse path) --------------------------------------
def canned_judge() -> FastAPI:
    """SGLang's /generate for text input: an answer per prompt, chosen by the response graded."""
    app = FastAPI()
    app.state.bodies = []

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        answers = []
        for text in body["text"]:
            graded = text.split("Answer to grade:\n")[1].split("\n")[0]
            answers.append({"right": "Correct. \\boxed{10}", "half": "Partly. \\boxed{5}"}.get(graded, "no idea"))
        return [{"text": a, "output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}} for a in answers]

    return app


def test_genrm_scores_parse_and_failures_against_a_fake_judge():
    with ThreadedServer(canned_judge()) as judge:
        rows = [row(response="right"), row(response="half"), row(response="???"), row(response="right")]
        s = scorer(kind="genrm", url=judge.url, batch_size=3, max_new_tokens=32, on_failure="fallback")
        assert s.score_columns(columns(rows)).tolist() == [1.0, 0.5, 0.0, 1.0]
        metrics = s.take_metrics()
        assert metrics["reward/model_failures"] == metrics["reward/model_unparsable"] == 1.0
        bodies = judge.server.config.app.state.bodies
        assert sorted(len(b["text"]) for b in bodies) == [1, 3]
        assert all(b["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 32} for b in bodies)
        assert "Problem:\n382" in bodies[0]["text"][0] and "Reference answer:\n2" in bodies[0]["text"][0]
        strict = scorer(kind="genrm", url=judge.url)
        with pytest.raises(RewardError, match=r"row 2 \(data_source 'megarl/digits'.*no match of score_pattern"):
            strict.score_columns(columns(rows))
        s.close()
        strict.close()


# ---- genrm and overlap against a real embedded server ----------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("judge") / "server.log"
    with RolloutServerProcess(
        tiny_model_path, port=0, max_batch_size=64, seed=0, torch_threads=1, log_path=log
    ) as server:
        yield server


def test_genrm_end_to_end_against_an_embedded_server(engine, tiny_model_path):
    rows = [row(response=str(k), ground_truth=str(k % 3)) for k in range(5)]
    kw = dict(score_pattern=r"(\d)", score_min=0.0, score_max=9.0, max_new_tokens=6)
    judge = GenerativeReward(engine.url, batch_size=2, tokenizer_path=str(tiny_model_path), **kw)
    got = judge.score(rows)
    # independently: the same prompts, one greedy request each, parsed here
    with RolloutClient(engine.url) as client:
        answers = [
            client.generate_text([judge.judge_prompt(r)], {"temperature": 0.0, "max_new_tokens": 6})[0].text
            for r in rows
        ]
    for value, answer in zip(got, answers):
        digits = re.findall(r"\d", answer)
        if digits:
            assert value == pytest.approx(int(digits[-1]) / 9.0)
        else:
            assert isinstance(value, Failure) and value.unparsable
    assert judge.judge_prompt(rows[0]).startswith("<|user|>")  # the judge's chat template wraps it
    judge.close()


def prompt_batch(k: int) -> Batch:
    return Batch(
        non_tensors={
            "raw_prompt_ids": [[2, 10 + i, 3] for i in range(k)],
            "raw_prompt": [[{"role": "user", "content": str(i)}] for i in range(k)],
            "data_source": ["megarl/digits"] * k,
            "ground_truth": ["1"] * k,
            "extra_info": [{"index": i} for i in range(k)],
        }
    )


@pytest.mark.parametrize("batched", [False, True])
def test_on_rows_hands_every_prompt_once_before_generate_returns(engine, batched):
    calls, returned = [], threading.Event()

    def on_rows(idx, outputs):
        assert not returned.is_set()
        calls.append((list(idx), [[o.text for o in outs] for outs in outputs]))

    manager = RolloutManager([engine.url], batched=batched, max_retries=0)
    try:
        n, prompts = 2, prompt_batch(5)
        rows = manager.generate(prompts, SamplingSpec(n=n, max_new_tokens=3), on_rows=on_rows)
        returned.set()
    finally:
        manager.close()
    assert len(calls) == (5 if not batched else 1)
    delivered = sorted(i for idx, _ in calls for i in idx)
    assert delivered == list(range(5))
    for idx, texts in calls:
        for i, outs in zip(idx, texts):
            assert outs == [rows["response_text"][i * n + j] for j in range(n)]


def test_overlap_scoring_matches_scoring_after_generation_in_any_order():
    n, prompts = 3, prompt_batch(4)
    texts = [[f"{i}{j}" for j in range(n)] for i in range(4)]
    rows = prompts.select(*prompts.non_tensors).repeat_interleave(n)
    rows = rows.union(Batch(non_tensors={"response_text": [t for ts in texts for t in ts]}))
    s = scorer(overlap=True)  # kind none: the rule verifier, in worker threads
    overlap = s.start_overlap(prompts, n)
    outs = lambda i: [GenerateOutput([1], t, [0.0], {}, {}) for t in texts[i]]  # noqa: E731
    overlap.on_rows([2], [outs(2)])
    overlap.on_rows([3, 0], [outs(3), outs(0)])
    with pytest.raises(RuntimeError, match="never delivered"):
        overlap.collect(rows)
    overlap.on_rows([1], [outs(1)])
    with pytest.raises(RuntimeError, match="delivered twice"):
        overlap.on_rows([1], [outs(1)])
    concurrent.futures.wait([job[2] for job in overlap.jobs])  # every row scored before "generation" ends
    got = overlap.collect(rows)
    assert got.tolist() == s.score_batch(rows).tolist() == [float(t[0] == "1") for ts in texts for t in ts]
    metrics = s.take_metrics()
    # the overlapped calls ran before collect, the after-generation score_batch call after it
    assert 0 < metrics["perf/reward_hidden_s"] < metrics["perf/reward_scoring_s"]
    s.close()


def test_scorer_without_model_or_overlap_adds_no_metrics():
    s = scorer()
    assert s.start_overlap(prompt_batch(1), 1) is None
    assert s.score_columns(columns([row(response="2"), row(response="3")])).tolist() == [1.0, 0.0]
    assert s.take_metrics() == {}
    s.close()


def test_union_of_intervals():
    assert _union([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert _union([]) == 0.0


# ---- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,key",
    [
        (["reward.model.kind=remote"], "reward.model.url"),
        (["reward.model.kind=remote", "reward.model.url=localhost:8000"], "reward.model.url"),
        (["reward.model.kind=genrm"], "reward.model.path"),
        (
            ["reward.model.kind=genrm", "reward.model.url=http://x:1", "reward.model.score_pattern=(\\d"],
            "reward.model.score_pattern",
        ),
        (
            ["reward.model.kind=genrm", "reward.model.url=http://x:1", "reward.model.prompt_template=grade {prompt}"],
            "reward.model.prompt_template",
        ),
        (
            ["reward.model.kind=genrm", "reward.model.url=http://x:1", "reward.model.score_max=0"],
            "reward.model.score_min",
        ),
        (
            ["reward.model.kind=remote", "reward.model.url=http://x:1/score", "reward.model.batch_size=0"],
            "reward.model.batch_size",
        ),
    ],
)
def test_bad_model_reward_settings_are_refused_naming_the_key(overrides, key):
    from megarl.config.loader import ConfigError, load_config
    from megarl.config.validate import validate

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(load_config(ROOT / "configs/quickstart.yaml", overrides))


def test_a_remote_model_reward_config_validates():
    from megarl.config.loader import load_config
    from megarl.config.validate import validate

    cfg = validate(
        load_config(
            ROOT / "configs/quickstart.yaml",
            ["reward.model.kind=remote", "reward.model.url=http://127.0.0.1:8000/score"],
        )
    )
    assert cfg.reward.model.kind == "remote" and cfg.reward.overlap is True  # auto: on with a model
