"""The control, memory and weight endpoints that slime, miles and verl call, each posted a body made
from SGLang's own request class (io_struct's *ReqInput, tests/rollout/sglang_upstream.py) at its
defaults and with other values; and every route of SGLang's HTTP server is either served by the
embedded server or named here as not served, with the reason (docs/rollout.md has the table)."""

from __future__ import annotations

import concurrent.futures
import re

import pytest
import torch
from safetensors.torch import load_file

from megarl.wire.update_group import host_store, new_update_group
from tests._trainer_side import broadcast_full, distributed_request
from tests.rollout import sglang_upstream as upstream

torch.set_num_threads(1)
PROMPT = [2, 10, 11, 12, 13, 3]
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def body(cls_name: str, **fields) -> dict:
    """The JSON body SGLang's HTTP clients post for this request class: its fields, defaults included."""
    return upstream.struct_asdict(upstream.io_struct()[cls_name](**fields))


def post(client, path: str, payload: dict, status: int = 200):
    response = client.post(path, json=payload)
    assert response.status_code == status, f"{path}: {response.status_code} {response.text}"
    return response


def greedy(client) -> list:
    return post(client, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()["output_ids"]


def logprobs(client) -> list:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    return [e[0] for e in post(client, "/generate", body).json()["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("fields", [{}, {"timeout_s": 5.0, "rid": "flush-1"}])
def test_flush_cache(client, fields):
    assert "Cache flushed" in post(client, "/flush_cache", body("FlushCacheReqInput", **fields)).text


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"rid": "nobody"},
        {"abort_all": True, "abort_message": "stop", "finished_reason": {"type": "abort", "message": "stop"}},
    ],
)
def test_abort_request(client, fields):
    post(client, "/abort_request", body("AbortReq", **fields))


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
@pytest.mark.parametrize("empty_cache", [True, False])
def test_pause_and_continue_generation(client, mode, empty_cache):
    pause = {} if mode == "abort" else {"mode": mode}  # "abort" is the class default
    assert post(client, "/pause_generation", body("PauseGenerationReqInput", **pause)).json()["success"]
    resumed = body("ContinueGenerationReqInput", **({} if empty_cache else {"torch_empty_cache": False}))
    assert post(client, "/continue_generation", resumed).json()["success"]
    assert len(greedy(client)) == 4


def test_update_weight_version_at_defaults_and_not(client):
    post(client, "/update_weight_version", body("UpdateWeightVersionReqInput", new_version="contract-a"))
    assert client.get("/get_weight_version").json()["weight_version"] == "contract-a"
    post(
        client,
        "/update_weight_version",
        body("UpdateWeightVersionReqInput", new_version="default", abort_all_requests=False),
    )
    assert client.get("/get_weight_version").json()["weight_version"] == "default"


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {
            "weight_version": "disk-1",
            "abort_all_requests": True,
            "flush_cache": False,
            "torch_empty_cache": True,
            "is_async": True,
            "keep_pause": True,
            "recapture_cuda_graph": True,
            "token_step": 3,
            "manifest": {"files": []},
        },
    ],
)
def test_update_weights_from_disk(client, tiny_model_path, fields):
    before = greedy(client)
    answer = post(
        client,
        "/update_weights_from_disk",
        body("UpdateWeightFromDiskReqInput", model_path=str(tiny_model_path), **fields),
    )
    assert answer.json()["success"] and answer.json()["num_paused_requests"] == 0
    assert greedy(client) == before  # the same checkpoint: the same answers


@pytest.mark.parametrize("tags", [None, ["kv_cache"], ["kv_cache", "weights", "cuda_graph"]])
def test_release_and_resume_memory_occupation(client, tiny_model_path, tags):
    before = greedy(client)
    fields = {} if tags is None else {"tags": tags}
    post(client, "/release_memory_occupation", body("ReleaseMemoryOccupationReqInput", **fields))
    post(client, "/resume_memory_occupation", body("ResumeMemoryOccupationReqInput", **fields))
    if tags is None or "weights" in tags:  # resumed weights hold no values until the next update
        post(client, "/update_weights_from_disk", body("UpdateWeightFromDiskReqInput", model_path=str(tiny_model_path)))
    assert greedy(client) == before


def test_init_weights_update_group_at_sglangs_default_backend_is_refused_on_cpu(client):
    request = body(
        "InitWeightsUpdateGroupReqInput", master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2
    )
    assert request["backend"] == "nccl"
    assert "backend='nccl' needs CUDA" in post(client, "/init_weights_update_group", request, 400).json()["message"]


def test_update_group_lifecycle_with_sglangs_request_bodies(client, tiny_model_path):
    """init (gloo) -> update_weights_from_distributed at defaults and not -> destroy, with this test
    as the trainer's rank 0."""
    norm = load_file(str(next(tiny_model_path.glob("*.safetensors"))))["model.norm.weight"]
    before = logprobs(client)
    store = host_store("127.0.0.1", 60.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        init = body(
            "InitWeightsUpdateGroupReqInput",
            master_address="127.0.0.1",
            master_port=store.port,
            rank_offset=1,
            world_size=2,
            group_name="contract",
            backend="gloo",
        )
        joined = pool.submit(client.post, "/init_weights_update_group", json=init)
        group = new_update_group(store, "contract", 0, 2, timeout_s=60.0)
        assert joined.result().status_code == 200, joined.result().text
        try:
            for named, fields in [
                ([("model.norm.weight", norm * 2.0)], {}),
                (
                    [("model.norm.weight", norm.clone())],
                    {
                        "weight_version": "dist-1",
                        "flush_cache": False,
                        "torch_empty_cache": True,
                        "load_format": "flattened_bucket",
                    },
                ),
            ]:
                names, dtypes, shapes = distributed_request(named)
                request = body(
                    "UpdateWeightsFromDistributedReqInput",
                    names=names,
                    dtypes=dtypes,
                    shapes=shapes,
                    group_name="contract",
                    **fields,
                )
                updated = pool.submit(client.post, "/update_weights_from_distributed", json=request)
                broadcast_full(group, named, fields.get("load_format"))
                assert updated.result().status_code == 200, updated.result().text
                moved = logprobs(client) != pytest.approx(before, abs=1e-6)
                assert moved == (not fields), "the doubled norm moves the log-probs; the restored one not"
        finally:
            post(
                client,
                "/destroy_weights_update_group",
                body("DestroyWeightsUpdateGroupReqInput", group_name="contract"),
            )
            group.destroy()
    assert client.get("/get_weight_version").json()["weight_version"] == "dist-1"


# ---- every route of SGLang's HTTP server --------------------------------------------------------
# Routes of SGLang 0.5.23's http_server.py that the embedded server does not serve, by reason
# (docs/rollout.md's endpoint table says the same).
NOT_SERVED = {
    "OpenAI-compatible and other API front ends: megarl's rollout speaks /generate": (
        "/v1/audio/transcriptions /v1/chat/completions /v1/completions /v1/decisions /v1/messages "
        "/v1/messages/count_tokens /v1/models /v1/models/{model:path} /v1/responses /v1/responses/{response_id} "
        "/v1/responses/{response_id}/cancel /v1/score /v1/systemone /invocations /classify /encode "
        "/parse_function_call /separate_reasoning /v1/loads /v1/classify /v1/embeddings /v1/rerank /tokenize "
        "/detokenize /v1/tokenize /v1/detokenize"
    ),
    "sessions are not kept by this engine": "/open_session /close_session",
    "hierarchical / external KV caches: this engine keeps no cache between batches": (
        "/hicache/storage-backend /hicache/storage-backend/clear /get_hicache_l3_cache_layout "
        "/add_external_corpus /list_external_corpora /remove_external_corpus"
    ),
    "remote-instance and IPC weight transfer: megarl's transports are tensor, distributed, disk and reshard": (
        "/init_weights_send_group_for_remote_instance /send_weights_to_remote_instance "
        "/get_remote_instance_transfer_engine_info /remote_instance_transfer_engine_info /update_weights_from_ipc "
        "/begin_weight_update /end_weight_update /get_transfer_engine_info /register_transfer_engine_info"
    ),
    "elastic expert parallelism: the engine's parallelism is fixed when it starts": "/scale_elastic_ep /is_scaling_elastic_ep",
    "reading weights back: tests compare against the checkpoint instead": "/get_weights_by_name /weights_checker",
    "profiling, tracing, logging and debugging hooks of SGLang's scheduler": (
        "/start_profile /stop_profile /start_expert_distribution_record /stop_expert_distribution_record "
        "/dump_expert_distribution_record /configure_logging /set_trace_level /freeze_gc /dumper/{method} "
        "/set_internal_state /slow_down"
    ),
    "prefill/decode disaggregation: this server runs both phases itself": "/pd_role_switch",
    "readiness probes of SGLang's launcher; /health answers them here": "/ / /ping /ready",
}


def sglang_routes() -> set[str]:
    """Every path SGLang's HTTP server registers (http_server.py and the routers it includes)."""
    import importlib.metadata

    root = importlib.metadata.distribution("sglang").locate_file("sglang/srt/entrypoints")
    paths = set()
    for path in root.glob("*.py"):
        paths |= set(re.findall(r'@(?:app|router)\.(?:get|post|put|delete|api_route)\(\s*"([^"]+)"', path.read_text()))
    return paths


def test_every_sglang_route_is_served_or_named_as_not_served(client):
    upstream.sglang_version()
    served = set(client.app.openapi()["paths"])
    not_served = {p for group in NOT_SERVED.values() for p in group.split()}
    routes = sglang_routes()
    assert "/generate" in routes and "/update_weights_from_tensor" in routes  # the scan found the server
    unknown = sorted(routes - served - not_served)
    assert not unknown, f"SGLang {upstream.PINNED} routes neither served nor listed in NOT_SERVED: {unknown}"
    stale = sorted(not_served - routes)
    assert not stale, f"NOT_SERVED names routes SGLang {upstream.PINNED} does not have: {stale}"
    assert not not_served & served, f"listed as not served but served: {sorted(not_served & served)}"
