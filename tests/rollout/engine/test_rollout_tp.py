"""The embedded rollout engine as a tensor-parallel mesh: pure sharding rules, then real server
processes — tp=1 (the reference), tp=2 on one node, and tp=2 over two "nodes" — compared on
log-probs, seeded samples, layout, weight updates (tensor, per-rank entries, disk), release /
resume, and a dead rank ending the engine.

Servers are module-scoped and started together; the tests that change weights apply the same
update to the tp=1 and the tp=2 server, so the two stay comparable, and the tests that kill a
rank come last.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.procs.net import free_port
from megarl.rollout.engine.runner.sharding import parameter_layout, shard_spec, tp_plan_for, validate_tp
from megarl.rollout.fleet.server_process import RolloutServerProcess
from megarl.wire.weights_codec import serialize_flattened_bucket, serialize_named_tensors

torch.set_num_threads(1)
TOL = 1e-5  # fp32: a row-parallel all-reduce only reorders sums
PROMPTS = [[2, 10, 11, 12, 13, 3], [2, 20, 21, 3], [2, 30, 31, 32, 33, 34, 35, 36, 3]]
HEARTBEAT_TIMEOUT_S = 6.0


# ---- pure rules (no processes) ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def config(tiny_model_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model_path)


def test_plan_shards_attention_experts_embedding_and_head_and_gathers_once_per_block(config):
    plan = tp_plan_for(config)
    assert plan["model.layers.*.self_attn.q_proj"] == "local_colwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "local_rowwise"
    assert plan["model.layers.*.mlp.experts.*.down_proj"] == "local_rowwise"
    assert plan["model.layers.*.self_attn"] == plan["model.layers.*.mlp"] == "gather"
    assert "model.layers.*.mlp.experts.*" not in plan  # no all-reduce per expert
    dims = {
        name: shard_spec(name, (64, 64), plan, 2, 1).dim
        for name in (
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.1.self_attn.k_proj.weight",
            "model.layers.1.self_attn.o_proj.weight",
            "model.layers.0.mlp.experts.3.up_proj.weight",
            "model.layers.0.mlp.experts.3.down_proj.weight",
            "model.layers.0.mlp.gate.weight",
        )
    }
    assert dims == {
        "model.embed_tokens.weight": 0,
        "lm_head.weight": 0,
        "model.layers.1.self_attn.k_proj.weight": 0,
        "model.layers.1.self_attn.o_proj.weight": 1,
        "model.layers.0.mlp.experts.3.up_proj.weight": 0,
        "model.layers.0.mlp.experts.3.down_proj.weight": 1,
        "model.layers.0.mlp.gate.weight": None,
    }
    spec = shard_spec("model.layers.0.self_attn.o_proj.weight", (64, 64), plan, 2, 1)
    assert (spec.start, spec.stop, spec.local_shape, spec.index()) == (32, 64, (64, 32), (slice(None), slice(32, 64)))


def test_tp_that_splits_a_kv_head_is_refused_naming_the_key(config):
    validate_tp(config, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        validate_tp(config, 4)


def test_layout_of_a_pure_plan_tiles_every_sharded_tensor(config):
    from megarl.rollout.engine.runner.sharding import full_shapes

    check_layout_tiles(parameter_layout(full_shapes(config), tp_plan_for(config), 4, nnodes=2), full_shapes(config))


def check_layout_tiles(layout: dict, shapes: dict) -> None:
    """Each sharded tensor is cut on one dim into consecutive, equal, non-overlapping ranges that
    cover it; replicated tensors are whole on every rank."""
    tp = layout["tp_size"]
    assert [r["rank"] for r in layout["ranks"]] == list(range(tp))
    assert [r["node_rank"] for r in layout["ranks"]] == [r * layout["nnodes"] // tp for r in range(tp)]
    for name, shape in shapes.items():
        entries = [r["params"][name] for r in layout["ranks"]]
        assert all(e["global_shape"] == list(shape) for e in entries), name
        dim = entries[0]["dim"]
        assert all(e["dim"] == dim for e in entries), name
        if dim is None:
            assert all(e["range"] is None and e["local_shape"] == list(shape) for e in entries), name
            continue
        assert entries[0]["range"][0] == 0 and entries[-1]["range"][1] == shape[dim], name
        for before, after in zip(entries, entries[1:]):
            assert before["range"][1] == after["range"][0], name  # no gap, no overlap
        for e in entries:
            expected = list(shape)
            expected[dim] = e["range"][1] - e["range"][0]
            assert e["local_shape"] == expected, name


# ---- real servers ------------------------------------------------------------------------------------
def _start_all(servers: list[RolloutServerProcess]) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        for future in [pool.submit(s.start) for s in servers]:
            future.result()


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory):
    """tp=1, tp=2 and a two-node tp=2 engine (node 1 answers /health at once, so starts first)."""
    common = dict(torch_threads=1, seed=0, max_batch_size=8)
    addr = f"127.0.0.1:{free_port()}"
    nodes = ("--tp", "2", "--nnodes", "2", "--dist-init-addr", addr, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    disk = ("--weight-dirs", str(tmp_path_factory.getbasetemp()))  # the tests' tmp_path checkpoints
    tp1 = RolloutServerProcess(tiny_model_path, extra_args=disk, **common)
    tp2 = RolloutServerProcess(tiny_model_path, extra_args=("--tp", "2", *disk), **common)
    node1 = RolloutServerProcess(tiny_model_path, extra_args=(*nodes, "--node-rank", "1"), **common)
    node0 = RolloutServerProcess(tiny_model_path, extra_args=(*nodes, "--node-rank", "0"), **common)
    all_servers = [tp1, tp2, node1, node0]
    try:
        node1.start()
        _start_all([tp1, tp2, node0])
        yield {"tp1": tp1, "tp2": tp2, "node0": node0, "node1": node1}
    finally:
        for server in all_servers:
            server.stop()


def post(server, path: str, status: int = 200, **body):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def logprobs(server, prompts=PROMPTS, max_new_tokens=6, temperature=1.0, seed=7):
    """(input log-probs, output ids, output log-probs) per prompt, sampled with fixed seeds."""
    params = [
        {"max_new_tokens": max_new_tokens, "temperature": temperature, "sampling_seed": seed + i, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    out = post(server, "/generate", input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
    return [
        (
            torch.tensor([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]),
            o["output_ids"],
            torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]),
        )
        for o in out
    ]


def assert_same(a, b, tol=TOL):
    for (in_a, ids_a, out_a), (in_b, ids_b, out_b) in zip(a, b, strict=True):
        torch.testing.assert_close(in_a, in_b, atol=tol, rtol=0)
        assert ids_a == ids_b
        torch.testing.assert_close(out_a, out_b, atol=tol, rtol=0)


def hf_input_logprobs(model_dir, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]


def test_tp2_logprobs_and_seeded_samples_equal_tp1_and_a_single_process_hf_forward(servers, tiny_model_path):
    tp1, tp2 = logprobs(servers["tp1"]), logprobs(servers["tp2"])
    assert_same(tp1, tp2)
    torch.testing.assert_close(tp2[2][0], hf_input_logprobs(tiny_model_path, PROMPTS[2]), atol=TOL, rtol=0)
    greedy = dict(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    assert [o["output_ids"] for o in post(servers["tp2"], "/generate", **greedy)] == [
        o["output_ids"] for o in post(servers["tp1"], "/generate", **greedy)
    ]


def test_two_node_engine_serves_like_tp1_and_node1_answers_health(servers):
    assert_same(logprobs(servers["tp1"], max_new_tokens=10), logprobs(servers["node0"], max_new_tokens=10))
    node1 = servers["node1"].url
    assert httpx.get(f"{node1}/health", timeout=5).status_code == 200
    assert httpx.post(f"{node1}/generate", json={"input_ids": [2]}, timeout=5).status_code == 404
    info = httpx.get(f"{servers['node0'].url}/get_server_info", timeout=5).json()
    assert (info["tp"], info["nnodes"], info["node_rank"]) == (2, 2, 0)


def test_tp2_rows_that_join_a_running_batch_answer_what_tp1_answers_alone(servers):
    """Continuous batching under TP: requests join the tp=2 engine's running batch (their prefill
    cache merged into the batch's on every rank, rows selected and columns trimmed there too)."""
    tp1, tp2 = servers["tp1"], servers["tp2"]

    def body(prompt, max_new, seed):
        return dict(
            input_ids=prompt,
            return_logprob=True,
            sampling_params={"max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": seed},
        )

    def stats():
        return httpx.get(f"{tp2.url}/get_server_info", timeout=10).json()["engine_stats"]

    def waiting():
        return httpx.get(f"{tp2.url}/get_load", timeout=10).json()[0]["num_waiting_reqs"]

    # a joiner's 100-token prompt is wider than the running row's cache: the running row is
    # left-padded by the merge, and the padding is trimmed again once that joiner leaves
    wide = [2] + [4 + (7 * i) % 60 for i in range(98)] + [3]
    bodies = [body([2, 40, 3], 150, 3), body(wide, 8, 20), body(PROMPTS[1], 13, 21)]
    before = stats()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, tp2, "/generate", **bodies[0])]
        while stats().get("forward_steps", 0) < before.get("forward_steps", 0) + 3:  # the long one decodes
            time.sleep(0.01)
        post(tp2, "/pause_generation", mode="in_place")  # returns with no forward step running
        futures += [pool.submit(post, tp2, "/generate", **b) for b in bodies[1:]]
        while waiting() != 2:
            time.sleep(0.01)
        post(tp2, "/continue_generation")
        joined = [f.result(timeout=60) for f in futures]
    assert stats().get("joined", 0) - before.get("joined", 0) == 2
    for b, result in zip(bodies, joined):
        alone = post(tp1, "/generate", **b)
        assert result["output_ids"] == alone["output_ids"]
        torch.testing.assert_close(
            torch.tensor([lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]),
            torch.tensor([lp for lp, _, _ in alone["meta_info"]["output_token_logprobs"]]),
            atol=TOL,
            rtol=0,
        )


def test_layout_endpoint_slices_tile_each_full_tensor(servers, tiny_model_path):
    layout = httpx.get(f"{servers['tp2'].url}/get_parallelism_config", timeout=10).json()
    shapes = {name: tuple(t.shape) for name, t in load_file(str(tiny_model_path / "model.safetensors")).items()}
    assert layout["tp_size"] == 2 and layout["nnodes"] == 1 and set(layout["ranks"][0]["params"]) == set(shapes)
    check_layout_tiles(layout, shapes)
    q = layout["ranks"][1]["params"]["model.layers.0.self_attn.q_proj.weight"]
    assert q == {"global_shape": [64, 64], "dim": 0, "range": [32, 64], "local_shape": [32, 64]}
    assert layout["ranks"][1]["params"]["model.norm.weight"]["dim"] is None
    node_layout = httpx.get(f"{servers['node0'].url}/get_parallelism_config", timeout=10).json()
    assert [r["node_rank"] for r in node_layout["ranks"]] == [0, 1]
    tp1 = httpx.get(f"{servers['tp1'].url}/get_parallelism_config", timeout=10).json()
    assert tp1["tp_size"] == 1 and all(p["dim"] is None for p in tp1["ranks"][0]["params"].values())


def _modified(tiny_model_path, scale: float, seed: int, where=("layers.1", "lm_head", "embed_tokens")):
    generator = torch.Generator().manual_seed(seed)
    state = load_file(str(tiny_model_path / "model.safetensors"))
    return {
        n: t + scale * torch.randn(t.shape, generator=generator) for n, t in state.items() if any(w in n for w in where)
    }


def test_tensor_update_changes_tp2_logprobs_to_what_tp1_gives(servers, tiny_model_path):
    before = logprobs(servers["tp2"])
    new = _modified(tiny_model_path, 0.05, seed=1)
    for key in ("tp1", "tp2"):  # one flattened bucket, one entry: every rank reads it
        reply = post(
            servers[key],
            "/update_weights_from_tensor",
            load_format="flattened_bucket",
            weight_version="v1",
            serialized_named_tensors=[serialize_flattened_bucket(list(new.items()))],
        )
        assert reply["success"], reply
    after = logprobs(servers["tp2"])
    assert not torch.allclose(before[0][0], after[0][0])
    assert_same(logprobs(servers["tp1"]), after)


def test_per_rank_entries_are_read_by_their_rank(servers, tiny_model_path):
    """SGLang's rule: rank r reads entry r. Different entries give each rank a different source, so
    the engine ends up with rank 0's slice of entry 0 next to rank 1's slice of entry 1."""
    name = "model.layers.0.self_attn.q_proj.weight"  # split on dim 0: rows 0-31 on rank 0, 32-63 on rank 1
    first, second = (
        _modified(tiny_model_path, 0.1, seed=2, where=(name,)),
        _modified(tiny_model_path, 0.1, seed=3, where=(name,)),
    )
    mixed = torch.cat([first[name][:32], second[name][32:]])
    post(
        servers["tp2"],
        "/update_weights_from_tensor",
        serialized_named_tensors=[
            serialize_named_tensors([(name, first[name])]),
            serialize_named_tensors([(name, second[name])]),
        ],
    )
    post(
        servers["tp1"],
        "/update_weights_from_tensor",
        serialized_named_tensors=[serialize_named_tensors([(name, mixed)])],
    )
    assert_same(logprobs(servers["tp1"]), logprobs(servers["tp2"]))


@pytest.mark.parametrize(
    "bad, needle",
    [
        ([("model.norm.weight", torch.ones(64)), ("no.such.weight", torch.ones(3))], "no.such.weight"),
        ([("model.norm.weight", torch.ones(64)), ("lm_head.weight", torch.ones(3, 64))], "lm_head.weight"),
    ],
)
def test_bad_update_is_refused_naming_the_tensor_and_nothing_is_written(servers, bad, needle):
    before = logprobs(servers["tp2"])
    reply = post(
        servers["tp2"],
        "/update_weights_from_tensor",
        status=400,
        serialized_named_tensors=[serialize_named_tensors(bad)],
    )
    assert needle in reply["message"] and "nothing was written" in reply["message"]
    assert_same(before, logprobs(servers["tp2"]), tol=0)


def test_entry_count_must_match_the_ranks(servers):
    entry = serialize_named_tensors([("model.norm.weight", torch.ones(64))])
    reply = post(servers["tp2"], "/update_weights_from_tensor", status=400, serialized_named_tensors=[entry] * 3)
    assert "3 entries for a tp=2 engine" in reply["message"]


def test_disk_update_then_release_resume_refill(servers, tiny_model_path, tmp_path):
    state = load_file(str(tiny_model_path / "model.safetensors"))
    state.update(_modified(tiny_model_path, 0.05, seed=4, where=("layers.0", "embed_tokens")))
    save_file(state, str(tmp_path / "model.safetensors"))
    for key in ("tp1", "tp2"):
        assert post(servers[key], "/update_weights_from_disk", model_path=str(tmp_path))["success"]
    expected = logprobs(servers["tp1"])
    assert_same(expected, logprobs(servers["tp2"]))

    tp2 = servers["tp2"]
    assert post(tp2, "/release_memory_occupation", tags=["weights"])["success"]
    assert "resume_memory_occupation" in post(tp2, "/generate", 503, input_ids=[2, 5])["error"]["message"]
    assert post(tp2, "/resume_memory_occupation", tags=["weights"])["success"]
    assert "not refilled" in post(tp2, "/generate", 503, input_ids=[2, 5])["error"]["message"]
    assert post(tp2, "/update_weights_from_disk", model_path=str(tmp_path))["success"]
    assert_same(expected, logprobs(tp2))


# ---- a dead rank ends the engine (these tests stop their servers: keep them last) ---------------------
def _wait_for_exit(server: RolloutServerProcess, within_s: float) -> float:
    start = time.monotonic()
    while server.process.poll() is None:
        assert time.monotonic() - start < within_s, f"the engine is still running {within_s}s after a rank died"
        time.sleep(0.1)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)
    return time.monotonic() - start


def test_killing_a_follower_rank_ends_the_engine(servers):
    server = servers["tp2"]
    children = [p for p in psutil.Process(server.process.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(children) == 1
    children[0].kill()  # SIGKILL rank 1 while rank 0 idles: the watchdog sees its child exit
    _wait_for_exit(server, within_s=10)


def test_killing_node1_ends_the_engine_on_node0(servers):
    node0, node1 = servers["node0"], servers["node1"]
    node1.process.kill()  # a whole "node" vanishes while rank 0 idles: its heartbeat stops
    _wait_for_exit(node0, within_s=HEARTBEAT_TIMEOUT_S + 10)
