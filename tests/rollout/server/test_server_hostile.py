"""Hostile requests against ONE embedded rollout server, launched as the fleet launches it
(EngineLauncher: key by environment, --weight-dirs, --max-body-mb): every endpoint of the app gets
missing and wrong keys, non-JSON bodies, wrong JSON types, absurd numbers, oversized bodies,
pickles that would run code, and model paths that escape the allowed directories. Each answer is
a 4xx (never a 5xx; every request has a timeout, so a hang fails too), nothing runs, and afterwards
the server's greedy output is exactly what it was. The key is in no command line and no log."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import secrets
from types import SimpleNamespace

import httpx
import psutil
import pytest
import torch

from megarl.rollout.fleet.engine_launcher import EngineLauncher, EngineNodeSpec
from megarl.rollout.server.app import create_app
from megarl.wire.weights_codec import serialize_flattened_bucket, serialize_named_tensors
from tests.rollout.server.test_rollout_security import _CreatesFile, _RunsCommand

torch.set_num_threads(1)
KEY = secrets.token_urlsafe(24)
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY_MB = 0.25  # small, so oversized bodies are cheap; every legitimate body here is far smaller
LIMIT = int(MAX_BODY_MB * 2**20)
PROMPT = [2, 10, 11, 12, 13, 3]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
TIMEOUT_S = 30.0


def _app(**kwargs):
    """The app the server runs, on a stand-in engine: routes and middleware need no model."""
    return create_app(SimpleNamespace(model_path="/nonexistent"), weight_dirs=["/nonexistent"], **kwargs)


def _routes(routes) -> list:
    """Every route of an app, the routers it includes opened up (FastAPI keeps them nested)."""
    out = []
    for r in routes:
        included = getattr(r, "original_router", None)
        out += _routes(included.routes) if included is not None else [r]
    return out


ROUTES = sorted((method, r.path) for r in _routes(_app(api_key="k").routes) for method in r.methods if method != "HEAD")
GUARDED = [(m, p) for m, p in ROUTES if not p.startswith(("/health", "/metrics"))]
POSTS = sorted({p for m, p in ROUTES if m == "POST"})


# ---- the server --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    weights, outside = run_dir / "weights", tmp_path_factory.mktemp("outside")
    weights.mkdir()
    (weights / "escape").symlink_to(tiny_model_path, target_is_directory=True)
    (weights / "linked_file").mkdir()
    (weights / "linked_file" / "model.safetensors").symlink_to(tiny_model_path / "model.safetensors")
    (weights / "garbage").mkdir()
    (weights / "garbage" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    (weights / "empty").mkdir()
    spec = EngineNodeSpec(
        backend="embedded",
        model_path=str(tiny_model_path),
        engine=0,
        max_batch_size=4,
        log_path=str(run_dir / "rollout_server_0.log"),
        startup_timeout_s=120,
        weight_dirs=(str(weights),),
        max_body_mb=MAX_BODY_MB,
    )
    launcher = EngineLauncher(spec, api_key=KEY)
    url = launcher.start()
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT_S, headers=AUTH) as client:
            yield SimpleNamespace(
                url=url,
                client=client,
                launcher=launcher,
                run_dir=run_dir,
                weights=weights,
                model=tiny_model_path,
                markers=outside,
                before=_state(client),
            )
    finally:
        launcher.stop()


def _state(client: httpx.Client) -> dict:
    out = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
    assert out.status_code == 200, out.text
    info = client.get("/get_server_info").json()
    return {
        "output_ids": out.json()["output_ids"],
        "weight_version": info["weight_version"],
        "paused": info["paused"],
        "weights_ready": info["weights_ready"],
        "model_path": info["model_path"],
    }


# ---- the key: every route of the app, so a route added later cannot escape ---------------------------
def test_every_control_endpoint_is_behind_the_key():
    control = {
        "/generate",
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/update_weights_from_distributed",
        "/update_weights_from_reshard",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/commit_weight_update",
        "/abort_weight_update",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
    }
    assert control <= {p for _, p in GUARDED}
    assert {p for _, p in ROUTES} - {p for _, p in GUARDED} == {"/health", "/health_generate"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}], ids=["no-key", "wrong-key"])
@pytest.mark.parametrize("method,path", GUARDED, ids=[f"{m} {p}" for m, p in GUARDED])
def test_without_the_key_every_route_answers_401(server, method, path, headers):
    response = httpx.request(method, server.url + path, json={"tags": ["weights"]}, headers=headers, timeout=TIMEOUT_S)
    assert response.status_code == 401 and KEY not in response.text


@pytest.mark.parametrize(
    "value", ["KEY", "Bearer KEYx", "bearer KEY", "Basic KEY", "Bearer  KEY", "Bearer", "Bearer KEY,KEY"]
)
def test_near_miss_authorization_headers_are_refused(server, value):
    response = httpx.post(
        server.url + "/pause_generation",
        json={},
        timeout=TIMEOUT_S,
        headers={"Authorization": value.replace("KEY", KEY)},
    )
    assert response.status_code == 401


def test_a_keyless_body_of_any_size_is_never_read():
    """The key is checked before the body limiter and the routes: nothing of the body is received."""
    reads, sent = [], []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": b"x" * 2**20, "more_body": True}

    async def send(message):
        sent.append(message)

    def call(app, headers):
        scope = {
            "type": "http",
            "http_version": "1.1",
            "method": "POST",
            "path": "/update_weights_from_tensor",
            "raw_path": b"/update_weights_from_tensor",
            "root_path": "",
            "scheme": "http",
            "query_string": b"",
            "headers": [(b"transfer-encoding", b"chunked"), *headers],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        reads.clear(), sent.clear()
        asyncio.run(app(scope, receive, send))
        return sent[0]["status"], len(reads)

    app = _app(api_key=KEY, max_body_mb=2)
    assert call(app, []) == (401, 0)
    assert call(app, [(b"content-length", b"%d" % 2**40)]) == (401, 0)  # the key first, then the limit
    # with the key, a chunked body is counted as it is read and refused past the limit (2 MB: 3 reads)
    assert call(app, [(b"authorization", AUTH["Authorization"].encode())]) == (413, 3)


# ---- hostile bodies ----------------------------------------------------------------------------------
# the code-running pickles of test_rollout_security (_CreatesFile, _RunsCommand), imported above


def _evil(kind, flattened):
    def body(s):
        thing = kind(s.markers / f"pwned-{kind.__name__}-{flattened}")
        obj = {"flattened_tensor": thing, "metadata": []} if flattened else [("lm_head.weight", thing)]
        return {
            "serialized_named_tensors": [base64.b64encode(pickle.dumps(obj)).decode()],
            "load_format": "flattened_bucket" if flattened else None,
        }

    return body


def _payload(named, flattened=False):
    return [serialize_flattened_bucket(named) if flattened else serialize_named_tensors(named)]


def _disk(path_of, **extra):
    return lambda s: {"model_path": path_of(s), **extra}


GROUP = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
T, D = "/update_weights_from_tensor", "/update_weights_from_disk"
# (path, body: a dict, or a function of the server fixture returning one, expected status or None: any 4xx)
CASES = {
    "gen/input_ids-str": ("/generate", {"input_ids": "abc"}, 400),
    "gen/input_ids-dict": ("/generate", {"input_ids": {"a": 1}}, 400),
    "gen/input_ids-float": ("/generate", {"input_ids": [1.5, 2]}, 400),
    "gen/input_ids-negative": ("/generate", {"input_ids": [-1, 2]}, 400),
    "gen/input_ids-huge-id": ("/generate", {"input_ids": [10**12]}, 400),
    "gen/input_ids-empty": ("/generate", {"input_ids": []}, 400),
    "gen/input_ids-empty-prompt": ("/generate", {"input_ids": [[]]}, 400),
    "gen/input_ids-mixed": ("/generate", {"input_ids": [[1], 2]}, 400),
    "gen/input_ids-bool": ("/generate", {"input_ids": True}, 400),
    "gen/both-text-and-ids": ("/generate", {"input_ids": PROMPT, "text": "hi"}, 400),
    "gen/neither": ("/generate", {"sampling_params": GREEDY}, 400),
    "gen/text-int": ("/generate", {"text": 5}, 400),
    "gen/text-dict": ("/generate", {"text": {"a": 1}}, 400),
    "gen/params-str": ("/generate", {"input_ids": PROMPT, "sampling_params": "hot"}, 400),
    "gen/params-list-single": ("/generate", {"input_ids": PROMPT, "sampling_params": [GREEDY]}, 400),
    "gen/temperature-str": ("/generate", {"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, 400),
    "gen/temperature-negative": ("/generate", {"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, 400),
    "gen/temperature-nan": ("/generate", {"input_ids": PROMPT, "sampling_params": {"temperature": "NaN"}}, 400),
    "gen/max_new_tokens-negative": ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}}, 400),
    "gen/max_new_tokens-absurd": (
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10**12}},
        400,
    ),
    "gen/max_new_tokens-float": ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2.5}}, 400),
    "gen/top_p-over-1": ("/generate", {"input_ids": PROMPT, "sampling_params": {"top_p": 2}}, 400),
    "gen/top_k-str": ("/generate", {"input_ids": PROMPT, "sampling_params": {"top_k": "x"}}, 400),
    "gen/n-zero": ("/generate", {"input_ids": PROMPT, "sampling_params": {"n": 0}}, 400),
    "gen/n-absurd": ("/generate", {"input_ids": PROMPT, "sampling_params": {"n": 10**9}}, 400),
    "gen/n-absurd-batch": ("/generate", {"input_ids": [PROMPT] * 64, "sampling_params": {"n": 10**6}}, 400),
    "gen/unknown-sampling-field": ("/generate", {"input_ids": PROMPT, "sampling_params": {"bogus": 1}}, 400),
    "gen/unknown-field": ("/generate", {"input_ids": PROMPT, "bogus_field": 1}, 400),
    "gen/rid-dup": ("/generate", {"input_ids": [PROMPT, PROMPT], "rid": ["a", "a"]}, 400),
    "gen/rid-count": ("/generate", {"input_ids": [PROMPT, PROMPT], "rid": ["a"]}, 400),
    "gen/rid-dict": ("/generate", {"input_ids": PROMPT, "rid": {"a": 1}}, 400),
    "gen/return_logprob-str": ("/generate", {"input_ids": PROMPT, "return_logprob": "yes"}, 400),
    "gen/stream-str": ("/generate", {"input_ids": PROMPT, "stream": "yes"}, 400),
    "gen/logprob_start_len-str": ("/generate", {"input_ids": PROMPT, "logprob_start_len": "x"}, 400),
    "gen/logprob_start_len-negative": ("/generate", {"input_ids": PROMPT, "logprob_start_len": -5}, 400),
    "gen/top_logprobs_num-negative": ("/generate", {"input_ids": PROMPT, "top_logprobs_num": -1}, 400),
    "gen/token_ids_logprob-str": ("/generate", {"input_ids": PROMPT, "token_ids_logprob": ["x"]}, 400),
    "abort/rid-int": ("/abort_request", {"rid": 5}, 400),
    "abort/rid-list": ("/abort_request", {"rid": ["a"]}, 400),
    "abort/abort_all-str": ("/abort_request", {"abort_all": "yes"}, 400),
    "abort/abort_all-int": ("/abort_request", {"abort_all": 1}, 400),
    "abort/message-dict": ("/abort_request", {"rid": "x", "abort_message": {"a": 1}}, 400),
    "pause/mode-unknown": ("/pause_generation", {"mode": "explode"}, 400),
    "pause/mode-int": ("/pause_generation", {"mode": 5}, 400),
    "pause/mode-list": ("/pause_generation", {"mode": ["abort"]}, 400),
    "release/tags-int": ("/release_memory_occupation", {"tags": 5}, 400),
    "release/tags-unknown": ("/release_memory_occupation", {"tags": ["bogus"]}, 400),
    "release/tags-unknown-str": ("/release_memory_occupation", {"tags": "bogus"}, 400),
    "release/tags-nested": ("/release_memory_occupation", {"tags": [["weights"]]}, 400),
    "release/tags-dict": ("/release_memory_occupation", {"tags": {"weights": True}}, 400),
    "release/tags-empty-dict": ("/release_memory_occupation", {"tags": {}}, 400),
    "release/tags-zero": ("/release_memory_occupation", {"tags": 0}, 400),
    "release/tags-false": ("/release_memory_occupation", {"tags": False}, 400),
    "release/tags-empty-str": ("/release_memory_occupation", {"tags": ""}, 400),
    "resume/tags-int": ("/resume_memory_occupation", {"tags": 7}, 400),
    "resume/tags-unknown": ("/resume_memory_occupation", {"tags": ["weights", "gpu"]}, 400),
    "tensor/missing": (T, {}, 400),
    "tensor/int": (T, {"serialized_named_tensors": 5}, 400),
    "tensor/empty-list": (T, {"serialized_named_tensors": []}, 400),
    "tensor/list-of-int": (T, {"serialized_named_tensors": [5]}, 400),
    "tensor/not-base64": (T, {"serialized_named_tensors": ["%%% not base64 %%%"]}, 400),
    "tensor/not-a-pickle": (T, {"serialized_named_tensors": [base64.b64encode(b"garbage").decode()]}, 400),
    "tensor/pickled-int": (T, {"serialized_named_tensors": [base64.b64encode(pickle.dumps(7)).decode()]}, 400),
    "tensor/evil-open": (T, _evil(_CreatesFile, False), 400),
    "tensor/evil-system": (T, _evil(_RunsCommand, False), 400),
    "tensor/evil-open-bucket": (T, _evil(_CreatesFile, True), 400),
    "tensor/evil-system-bucket": (T, _evil(_RunsCommand, True), 400),
    "tensor/unknown-name": (T, lambda s: {"serialized_named_tensors": _payload([("bogus.w", torch.zeros(2))])}, 400),
    "tensor/wrong-shape": (
        T,
        lambda s: {"serialized_named_tensors": _payload([("model.norm.weight", torch.zeros(3))])},
        400,
    ),
    "tensor/bucket-as-list": (
        T,
        lambda s: {"serialized_named_tensors": _payload([("model.norm.weight", torch.zeros(3))], True)},
        400,
    ),
    "tensor/load_format-int": (
        T,
        lambda s: {"serialized_named_tensors": _payload([("x", torch.zeros(1))]), "load_format": 5},
        400,
    ),
    "tensor/load_format-unknown": (
        T,
        lambda s: {"serialized_named_tensors": _payload([("x", torch.zeros(1))]), "load_format": "direct"},
        400,
    ),
    "tensor/version-dict": (T, {"serialized_named_tensors": ["AAAA"], "weight_version": {"v": 1}}, 400),
    "tensor/defer-str": (T, {"serialized_named_tensors": ["AAAA"], "defer": "yes"}, 400),
    "tensor/abort-str": (T, {"serialized_named_tensors": ["AAAA"], "abort_all_requests": "yes"}, 400),
    "disk/missing": (D, {}, 400),
    "disk/int": (D, {"model_path": 5}, 400),
    "disk/empty": (D, {"model_path": ""}, 400),
    "disk/nul": (D, lambda s: {"model_path": f"{s.weights}/\x00x"}, 400),
    "disk/etc": (D, {"model_path": "/etc"}, 403),
    "disk/root": (D, {"model_path": "/"}, 403),
    "disk/relative": (D, {"model_path": "."}, 403),
    "disk/dotdot": (D, _disk(lambda s: f"{s.weights}/../../{os.path.relpath(s.model, s.weights.parent.parent)}"), 403),
    "disk/dotdot-prefix": (D, _disk(lambda s: f"{s.weights}/empty/../../weights-not"), 403),
    "disk/sibling-prefix": (D, _disk(lambda s: f"{s.weights}2"), 403),
    "disk/symlinked-dir": (D, _disk(lambda s: f"{s.weights}/escape"), 403),
    "disk/symlinked-file": (D, _disk(lambda s: f"{s.weights}/linked_file"), 403),
    "disk/model-dir-not-allowed": (D, _disk(lambda s: str(s.model)), 403),
    "disk/no-safetensors": (D, _disk(lambda s: f"{s.weights}/empty"), 400),
    "disk/not-there": (D, _disk(lambda s: f"{s.weights}/nope"), 400),
    "disk/garbage-file": (D, _disk(lambda s: f"{s.weights}/garbage"), 400),
    "disk/version-list": (D, _disk(lambda s: f"{s.weights}/empty", weight_version=[1]), 400),
    "disk/abort-str": (D, _disk(lambda s: f"{s.weights}/empty", abort_all_requests="x"), 400),
    "version/missing": ("/update_weight_version", {}, 400),
    "version/dict": ("/update_weight_version", {"new_version": {}}, 400),
    "version/list": ("/update_weight_version", {"new_version": [1]}, 400),
    "version/bool": ("/update_weight_version", {"new_version": True}, 400),
    "version/abort-str": ("/update_weight_version", {"new_version": "evil", "abort_all_requests": "x"}, 400),
    "group/missing": ("/init_weights_update_group", {}, 400),
    "group/address-int": ("/init_weights_update_group", {**GROUP, "master_address": 5}, 400),
    "group/port-str": ("/init_weights_update_group", {**GROUP, "master_port": "x"}, 400),
    "group/port-negative": ("/init_weights_update_group", {**GROUP, "master_port": -1}, 400),
    "group/port-over": ("/init_weights_update_group", {**GROUP, "master_port": 70000}, 400),
    "group/port-absurd": ("/init_weights_update_group", {**GROUP, "master_port": 10**30}, 400),
    "group/rank-negative": ("/init_weights_update_group", {**GROUP, "rank_offset": -1}, 400),
    "group/rank-outside": ("/init_weights_update_group", {**GROUP, "rank_offset": 5}, 400),
    "group/world-zero": ("/init_weights_update_group", {**GROUP, "world_size": 0}, 400),
    "group/world-float": ("/init_weights_update_group", {**GROUP, "world_size": 2.5}, 400),
    "group/backend": ("/init_weights_update_group", {**GROUP, "backend": "mpi"}, 400),
    "group/name-list": ("/init_weights_update_group", {**GROUP, "group_name": ["g"]}, 400),
    "destroy/name-int": ("/destroy_weights_update_group", {"group_name": 5}, 400),
    "destroy/name-dict": ("/destroy_weights_update_group", {"group_name": {"g": 1}}, 400),
    "destroy/unknown": ("/destroy_weights_update_group", {"group_name": "nope"}, 400),
    "dist/name-dict": ("/update_weights_from_distributed", {"group_name": {"g": 1}}, 400),
    "dist/no-group": (
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
        400,
    ),
    "dist/names-int": ("/update_weights_from_distributed", {"group_name": "nope", "names": 5}, 400),
    "dist/shapes-absurd": (
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[10**15]]},
        400,
    ),
    "dist/defer-str": ("/update_weights_from_distributed", {"defer": "x"}, 400),
    "reshard/missing": ("/update_weights_from_reshard", {}, 400),
    "reshard/name-int": ("/update_weights_from_reshard", {"group_name": 5}, 400),
    "reshard/ranks-str": ("/update_weights_from_reshard", {"group_name": "nope", "ranks": "x"}, 400),
    "reshard/version-list": ("/update_weights_from_reshard", {"group_name": "nope", "weight_version": []}, 400),
    "reshard/defer-str": ("/update_weights_from_reshard", {"group_name": "nope", "defer": "no"}, 400),
    "commit/missing": ("/commit_weight_update", {}, 400),
    "commit/dict": ("/commit_weight_update", {"weight_version": {"v": 1}}, 400),
    "commit/nothing-staged": ("/commit_weight_update", {"weight_version": "v-evil"}, 400),
    "get/pause-query": ("GET /pause_generation?mode=explode", None, 400),
    "get/release-query": ("GET /release_memory_occupation?tags=bogus", None, 400),
    "method/get-generate": ("GET /generate", None, 405),
    "method/delete-tensor": ("DELETE " + T, None, 405),
    "method/get-disk": ("GET " + D, None, 405),
    "path/unknown": ("/update_weights_from_everywhere", {}, 404),
}
NOT_JSON = {
    "text": b"not json",
    "truncated": b'{"a": ',
    "array": b"[1, 2]",
    "string": b'"s"',
    "null": b"null",
    "bad-utf8": b"\xff\xfe{}",
}
for _path in POSTS:
    for _name, _raw in NOT_JSON.items():
        CASES[f"{_path.strip('/')}/{_name}"] = (_path, _raw, 400)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_request_gets_a_4xx(server, name):
    target, body, expected = CASES[name]
    method, path = target.split(" ") if " " in target else ("POST", target)
    body = body(server) if callable(body) else body
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    response = server.client.request(method, path, **kwargs)
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    assert response.status_code == expected, response.text[:500]
    if path == D and expected == 403:
        assert str(server.weights) in response.json()["message"]


# ---- oversized bodies ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", POSTS)
def test_an_oversized_body_gets_413_naming_the_limit_and_the_flag(server, path):
    response = server.client.post(path, content=b"[" + b"1," * (LIMIT // 2) + b"1]")
    assert response.status_code == 413
    message = response.json()["error"]["message"]
    assert f"{LIMIT} bytes" in message and "--max-body-mb" in message


@pytest.mark.parametrize("path", ["/generate", T])
def test_an_oversized_chunked_body_gets_413(server, path):
    chunks = (b"x" * 65536 for _ in range(LIMIT // 65536 + 2))  # a generator: sent chunked, no length
    response = server.client.post(path, content=chunks)
    assert response.status_code == 413 and "without Content-Length" in response.json()["error"]["message"]


# ---- afterwards (keep these last) ----------------------------------------------------------------------
def test_nothing_ran_and_the_server_answers_exactly_as_before(server):
    assert list(server.markers.iterdir()) == []
    assert _state(server.client) == server.before


def test_the_key_is_in_no_command_line_and_no_log(server):
    from megarl.rollout.fleet.router import RouterProcess

    router = RouterProcess([server.url], api_key=KEY, log_path=server.run_dir / "router.log")
    with router:
        assert (
            httpx.post(
                router.url + "/generate",
                json={"input_ids": PROMPT, "sampling_params": GREEDY},
                headers=AUTH,
                timeout=TIMEOUT_S,
            ).json()["output_ids"]
            == server.before["output_ids"]
        )
        pids = [server.launcher.server_pid(), router.process.pid]
        processes = [psutil.Process(pid) for pid in pids]
        processes += [child for p in processes for child in p.children(recursive=True)]
        for process in processes:
            assert KEY not in " ".join(process.cmdline()), process
    files = [p for p in server.run_dir.rglob("*") if p.is_file()]
    assert {"rollout_server_0.log", "router.log"} <= {p.name for p in files}
    for path in files:
        assert KEY.encode() not in path.read_bytes(), path
