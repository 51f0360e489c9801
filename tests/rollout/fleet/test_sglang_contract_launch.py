"""Every SGLang command line megarl builds for a shipped config (each config in configs/ with
rollout.backend=sglang, colocated and disaggregated where the config allows it, every node of a
multi-node engine) parses with SGLang's own parser (prepare_server_args: ServerArgs.add_cli_args,
the --config YAML merge, argparse's choices, ServerArgs.from_cli_args) into the values megarl
meant.

Left out: ServerArgs.resolve_once and check_server_args, SGLang's start-up validation. Resolution
loads the model's Hugging Face config with transformers 5.x (megarl runs 4.57) and probes the
device (CUDA); sglang_launch.validate mirrors the layout checks among them, tested in
test_sglang_launch.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config.loader import load_config
from megarl.rollout.fleet.sglang_process import SGLangServerProcess
from megarl.trainer.runtime import engine_node_specs
from tests.rollout import sglang_upstream as upstream

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
PLACEMENTS = ("colocated", "disaggregated")


def _config(name: str, placement: str):
    overrides = ["rollout.backend=sglang", f"cluster.placement={placement}"]
    try:
        return load_config(ROOT / "configs" / name, overrides)
    except ValueError as exc:  # a placement this config's layout cannot take: said by validation
        pytest.fail(f"{name} with {overrides} does not load: {exc}")


def _commands(cfg, tmp_path, api_key):
    for engine in engine_node_specs(cfg, "/ckpt/model", tmp_path):
        for node in engine:
            dist_init_addr = "10.0.0.1:5000" if node.nnodes > 1 else None
            process = SGLangServerProcess(node, dist_init_addr, api_key, env={})
            yield node, process.command(30000 + node.node_rank)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_every_launch_command_of_a_shipped_config_parses_with_sglangs_parser(name, placement, tmp_path):
    cfg = _config(name, placement)
    seen = 0
    for node, argv in _commands(cfg, tmp_path, api_key="contract-key"):
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        args = upstream.parse_server_args(argv[3:])
        got = {k: getattr(args, k) for k in ("model_path", "tp_size", "ep_size", "dp_size", "nnodes", "node_rank")}
        assert got == {
            "model_path": "/ckpt/model",
            "tp_size": node.tp,
            "ep_size": node.ep,
            "dp_size": node.dp,
            "nnodes": node.nnodes,
            "node_rank": node.node_rank,
        }, argv
        assert args.port == 30000 + node.node_rank and args.random_seed == node.seed
        # rollout.dp is attention DP; 0.5.23 still takes the older spelling (--dp-size N
        # --enable-dp-attention) and resolves it into attn_dp_size, as 0.5.3 reads it
        assert args.enable_dp_attention is (node.dp > 1)
        assert args.enable_memory_saver is (placement == "colocated")
        assert args.enable_return_routed_experts is node.routed_experts
        assert args.api_key == "contract-key"  # read from the --config file, not the command line
        assert "contract-key" not in " ".join(argv)
        if node.nnodes > 1:
            assert args.dist_init_addr == "10.0.0.1:5000"
        if node.mem_fraction_static is not None:
            assert args.mem_fraction_static == node.mem_fraction_static
        seen += 1
    assert seen == cfg.rollout.num_servers * cfg.rollout.nnodes


def test_an_unknown_flag_is_refused_by_sglangs_parser():
    """The parser is strict, so the checks above could fail: a misspelt flag exits."""
    with pytest.raises(SystemExit):
        upstream.parse_server_args(["--model-path", "/m", "--tp-sise", "2"])


def _lora_args(tmp_path, *overrides):
    """SGLang's parse of the one engine's command line of quickstart-lora with `overrides`."""
    cfg = load_config(ROOT / "configs" / "quickstart-lora.yaml", ["rollout.backend=sglang", *overrides])
    for _, argv in _commands(cfg, tmp_path, api_key="contract-key"):  # the key file lives while iterating
        return upstream.parse_server_args(argv[3:])


def test_adapter_sync_flags_parse_with_sglangs_parser(tmp_path):
    """bridge.transport=adapter: LoRA on, the adapter's rank and target modules, as SGLang reads them."""
    args = _lora_args(tmp_path, "bridge.transport=adapter")
    assert args.enable_lora is True and args.max_lora_rank == 16 and list(args.lora_target_modules) == ["all"]
    args = _lora_args(tmp_path, "bridge.transport=adapter", "actor.lora.target_modules=[q_proj,v_proj,lm_head]")
    assert set(args.lora_target_modules) == {"q_proj", "v_proj", "lm_head"}
    assert not _lora_args(tmp_path, "bridge.transport=tensor").enable_lora
