import importlib.util
from pathlib import Path

import pytest

from megarl.rollout.fleet.sglang_launch import (
    REDACTED,
    SGLangServerSpec,
    api_key_config_yaml,
    node_specs,
    redacted_argv,
    server_argv,
    sglang_unavailable_reason,
    validate,
)

HEAD = ["py", "-m", "sglang.launch_server"]


def test_one_node_engine_tp2():
    spec = SGLangServerSpec(model_path="/ckpt/qwen", host="0.0.0.0", port=31000, tp_size=2, random_seed=7)
    assert server_argv(spec, python="py") == HEAD + [
        "--model-path",
        "/ckpt/qwen",
        "--host",
        "0.0.0.0",
        "--port",
        "31000",
        "--tp-size",
        "2",
        "--ep-size",
        "1",
        "--dp-size",
        "1",
        "--base-gpu-id",
        "0",
        "--dtype",
        "auto",
        "--random-seed",
        "7",
        "--log-level",
        "info",
    ]


def test_one_node_engine_colocated_with_every_option():
    spec = SGLangServerSpec(
        model_path="/ckpt/qwen",
        tokenizer_path="/ckpt/tok",
        port=30001,
        tp_size=2,
        ep_size=2,
        mem_fraction_static=0.6,
        enable_memory_saver=True,
        base_gpu_id=2,
        dtype="bfloat16",
        trust_remote_code=True,
        skip_server_warmup=True,
        log_level="warning",
        extra_args=("--disable-cuda-graph",),
    )
    assert server_argv(spec, python="py") == HEAD + [
        "--model-path",
        "/ckpt/qwen",
        "--tokenizer-path",
        "/ckpt/tok",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--tp-size",
        "2",
        "--ep-size",
        "2",
        "--dp-size",
        "1",
        "--mem-fraction-static",
        "0.6",
        "--enable-memory-saver",
        "--base-gpu-id",
        "2",
        "--dtype",
        "bfloat16",
        "--trust-remote-code",
        "--skip-server-warmup",
        "--log-level",
        "warning",
        "--disable-cuda-graph",
    ]


def test_two_node_engine_tp4_both_ranks():
    spec = SGLangServerSpec(
        model_path="/ckpt/moe",
        host="10.0.0.1",
        port=30000,
        tp_size=4,
        ep_size=4,
        nnodes=2,
        dist_init_addr="10.0.0.1:5000",
    )
    rank0, rank1 = node_specs(spec)
    common_tail = ["--base-gpu-id", "0", "--dtype", "auto", "--log-level", "info"]
    assert (
        server_argv(rank0, python="py")
        == HEAD
        + [
            "--model-path",
            "/ckpt/moe",
            "--host",
            "10.0.0.1",
            "--port",
            "30000",
            "--tp-size",
            "4",
            "--ep-size",
            "4",
            "--dp-size",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--dist-init-addr",
            "10.0.0.1:5000",
        ]
        + common_tail
    )
    argv0 = server_argv(rank0, python="py")
    at = argv0.index("--node-rank") + 1
    assert server_argv(rank1, python="py") == argv0[:at] + ["1"] + argv0[at + 1 :]


def test_colocated_differs_from_disaggregated_only_by_memory_saver():
    base = SGLangServerSpec(model_path="/m", tp_size=2)
    colocated = server_argv(SGLangServerSpec(model_path="/m", tp_size=2, enable_memory_saver=True), python="py")
    plain = server_argv(base, python="py")
    assert "--enable-memory-saver" not in plain
    assert [a for a in colocated if a != "--enable-memory-saver"] == plain


def test_routing_replay_turns_on_sglangs_routed_experts_capture(tmp_path):
    """actor.moe.routing_replay: every engine megarl launches records the experts it routed to
    (SGLang answers return_routed_experts only when started with the flag)."""
    from megarl.config.loader import load_config
    from megarl.trainer.runtime import engine_node_specs

    argv = server_argv(SGLangServerSpec(model_path="/m", enable_return_routed_experts=True), python="py")
    assert argv.count("--enable-return-routed-experts") == 1
    assert "--enable-return-routed-experts" not in server_argv(SGLangServerSpec(model_path="/m"), python="py")
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        validate(SGLangServerSpec(model_path="/m", extra_args=("--enable-return-routed-experts",)))
    root = Path(__file__).resolve().parents[3]
    for replay in (False, True):
        cfg = load_config(root / "configs/quickstart.yaml", [f"actor.moe.routing_replay={str(replay).lower()}"])
        nodes = [n for engine in engine_node_specs(cfg, "/m", tmp_path) for n in engine]
        assert nodes and all(n.routed_experts is replay for n in nodes)


def test_adapter_sync_launches_sglang_with_lora_enabled(tmp_path):
    """bridge.transport=adapter: SGLang loads the policy's adapter at run time, so it starts with LoRA
    on, the adapter's rank and its target modules (flags of SGLang's own parser)."""
    from megarl.config.loader import load_config
    from megarl.trainer.runtime import engine_node_specs

    root = Path(__file__).resolve().parents[3]
    for transport, want in (
        ("tensor", None),
        ("adapter", ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"]),
    ):
        cfg = load_config(root / "configs/quickstart-lora.yaml", [f"bridge.transport={transport}"])
        [[node]] = engine_node_specs(cfg, "/m", tmp_path)
        spec = SGLangServerSpec(
            model_path="/m", max_lora_rank=node.lora_rank, lora_target_modules=node.lora_target_modules
        )
        argv = server_argv(spec, python="py")
        if want is None:
            assert "--enable-lora" not in argv
        else:
            start = argv.index("--enable-lora")
            assert argv[start : start + len(want)] == want
    named = server_argv(
        SGLangServerSpec(model_path="/m", max_lora_rank=8, lora_target_modules=("q_proj", "v_proj")), python="py"
    )
    assert named[named.index("--lora-target-modules") + 1 :][:2] == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="max_lora_rank"):
        validate(SGLangServerSpec(model_path="/m", extra_args=("--max-lora-rank", "8")))


def test_dp_attention_flag():
    spec = SGLangServerSpec(
        model_path="/m", tp_size=8, dp_size=4, enable_dp_attention=True, nnodes=2, dist_init_addr="h:1"
    )
    argv = server_argv(spec, python="py")
    assert argv[argv.index("--dp-size") + 1] == "4" and "--enable-dp-attention" in argv


def test_api_key_is_redacted():
    argv = server_argv(SGLangServerSpec(model_path="/m", api_key="s3cret"), python="py")
    assert argv[argv.index("--api-key") + 1] == "s3cret"
    shown = redacted_argv(argv)
    assert "s3cret" not in " ".join(shown)
    assert shown[shown.index("--api-key") + 1] == REDACTED
    assert [a for a in shown if a != REDACTED] == [a for a in argv if a != "s3cret"]
    assert redacted_argv(["x", "--api-key=abc", "--admin-api-key", "def", "--port", "1"]) == [
        "x",
        f"--api-key={REDACTED}",
        "--admin-api-key",
        REDACTED,
        "--port",
        "1",
    ]


def test_api_key_from_config_file_stays_off_the_command_line():
    argv = server_argv(SGLangServerSpec(model_path="/m", api_key_config="/run/key.yaml"), python="py")
    assert argv[argv.index("--config") + 1] == "/run/key.yaml" and "--api-key" not in argv
    assert api_key_config_yaml('k"ey:1') == 'api-key: "k\\"ey:1"\n'


@pytest.mark.parametrize(
    "fields, field_named",
    [
        (dict(tp_size=3, nnodes=2, dist_init_addr="h:1"), "tp_size=3 is not divisible by nnodes=2"),
        (dict(tp_size=4, nnodes=2), "dist_init_addr is required"),
        (dict(tp_size=4, nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank=2"),
        (dict(tp_size=4, nnodes=2, node_rank=-1, dist_init_addr="h:1"), "node_rank=-1"),
        (dict(tp_size=4, ep_size=3), "ep_size=3 does not divide tp_size=4"),
        (dict(tp_size=0), "tp_size=0"),
        (dict(tp_size=4, dp_size=2, nnodes=2, dist_init_addr="h:1"), "enable_dp_attention"),
        (dict(tp_size=4, dp_size=3, enable_dp_attention=True), "dp_size=3 does not divide tp_size=4"),
        (dict(dist_init_addr="nohost"), "dist_init_addr='nohost'"),
        (dict(mem_fraction_static=1.5), "mem_fraction_static=1.5"),
        (dict(dtype="fp8"), "dtype='fp8'"),
        (dict(log_level="loud"), "log_level='loud'"),
        (dict(port=0), "port=0"),
        (dict(base_gpu_id=-1), "base_gpu_id=-1"),
        (dict(api_key="k", api_key_config="/k.yaml"), "api_key and api_key_config"),
        (dict(api_key=""), "api_key is empty"),
        (dict(extra_args=("--tp-size", "8")), "field tp_size"),
        (dict(extra_args=("--api-key=x",)), "field api_key"),
        (dict(api_key_config="/k.yaml", extra_args=("--config", "/other.yaml")), "one --config"),
        (dict(model_path=""), "model_path"),
    ],
)
def test_validation_names_the_field(fields, field_named):
    spec = SGLangServerSpec(**({"model_path": "/m"} | fields))
    with pytest.raises(ValueError, match=field_named.replace("(", r"\(").replace("[", r"\[")):
        validate(spec)
    with pytest.raises(ValueError):
        server_argv(spec)


def test_unavailable_reason_on_this_machine():
    import torch

    reason = sglang_unavailable_reason()
    has_sglang = importlib.util.find_spec("sglang") is not None
    if has_sglang and torch.cuda.is_available():
        assert reason is None
        return
    assert reason is not None and "rollout.backend=embedded" in reason
    if not has_sglang:
        assert "sglang package is not installed" in reason
    if not torch.cuda.is_available():
        assert "CUDA is not available" in reason


def test_launcher_process_for_sglang_keeps_the_key_in_a_private_config_file(tmp_path):
    """The engine launcher's SGLang process: argv from the engine node's layout, the per-run key
    only in a 0600 --config file, never on the command line."""
    import os
    import stat

    from megarl.rollout.fleet.engine_launcher import EngineNodeSpec
    from megarl.rollout.fleet.sglang_process import SGLangServerProcess

    node = EngineNodeSpec(
        backend="sglang",
        model_path="/ckpt",
        engine=1,
        node_rank=1,
        nnodes=2,
        tp=4,
        ep=2,
        colocated=True,
        seed=7,
        log_path=str(tmp_path / "e.log"),
    )
    proc = SGLangServerProcess(node, "10.0.0.1:5000", "secret-key", env={})
    argv = proc.command(31000)
    assert "secret-key" not in " ".join(argv)
    flags = dict(zip(argv, argv[1:]))
    assert (flags["--tp-size"], flags["--ep-size"], flags["--nnodes"], flags["--node-rank"]) == ("4", "2", "2", "1")
    assert flags["--dist-init-addr"] == "10.0.0.1:5000" and flags["--port"] == "31000"
    assert "--enable-memory-saver" in argv and flags["--random-seed"] == "7"
    config = flags["--config"]
    assert stat.S_IMODE(os.stat(config).st_mode) == 0o600 and "secret-key" in open(config).read()


def test_sglang_servers_and_the_router_run_under_megarl_sglang_python(tmp_path, monkeypatch):
    """$MEGARL_SGLANG_PYTHON (what the Dockerfile sets: its image's own Python, whose transformers
    SGLang needs) starts the run's SGLang servers, built from a config's engine specs, and
    sglang-router; without it, the trainer's own interpreter."""
    import sys

    from megarl.config.loader import load_config
    from megarl.rollout.fleet.router import RouterProcess
    from megarl.rollout.fleet.sglang_process import SGLangServerProcess
    from megarl.trainer.runtime import engine_node_specs

    cfg = load_config(Path(__file__).resolve().parents[3] / "configs/quickstart.yaml", ["rollout.backend=sglang"])
    node = engine_node_specs(cfg, "/ckpt", tmp_path)[0][0]

    def interpreters():
        server = SGLangServerProcess(node, None, None, env={}).command(30000)[0]
        return server, RouterProcess(["http://127.0.0.1:1"], log_path=tmp_path / "r.log").python

    monkeypatch.delenv("MEGARL_SGLANG_PYTHON", raising=False)
    assert interpreters() == (sys.executable, sys.executable)
    monkeypatch.setenv("MEGARL_SGLANG_PYTHON", "/usr/local/bin/sglang-python")
    assert interpreters() == ("/usr/local/bin/sglang-python", "/usr/local/bin/sglang-python")
    assert server_argv(SGLangServerSpec(model_path="/m"), python="py")[0] == "py"  # an explicit one wins
