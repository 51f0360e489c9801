"""Command lines for real SGLang engines: pure functions, no processes, importable without sglang.

    spec = SGLangServerSpec(model_path="/ckpt/qwen3-30b-a3b", host="10.0.0.1", port=30000,
                            tp_size=16, ep_size=16, nnodes=2, node_rank=1,
                            dist_init_addr="10.0.0.1:5000", enable_memory_saver=True)
    argv = server_argv(spec)           # what the rollout actor on node 1 runs
    log.info(" ".join(redacted_argv(argv)))

One engine may span nodes: every node runs the same command with its own --node-rank, and tp_size
counts the GPUs of the whole engine (tp_size / nnodes per node). Only node rank 0 serves the HTTP
API; the other ranks run schedulers and answer only /health on their port, so only node 0's URL is
ever given to the router.

Flag names are checked against SGLang 0.5.3 (`python/sglang/srt/server_args.py`) and 0.5.23 (where
the flags derive from the ServerArgs field names in `srt/arg_groups/fields/`): --model-path,
--tokenizer-path, --host, --port, --tp-size, --ep-size, --dp-size, --enable-dp-attention
(deprecated in 0.5.23 but still accepted), --nnodes, --node-rank, --dist-init-addr,
--mem-fraction-static, --enable-memory-saver, --base-gpu-id, --dtype, --random-seed, --api-key,
--trust-remote-code, --skip-server-warmup, --log-level, --config. The checks below mirror the
assertions SGLang makes at start-up, so a bad layout fails here, naming the field, instead of
minutes later on a GPU node.

API keys. SGLang reads its key only from --api-key (no environment variable), which puts it in the
world-readable command line for the server's whole life. It also reads any option from a YAML file
given as `--config PATH` (keys are flag names), so a launcher that writes api_key_config_yaml(key)
to a file only it can read (mode 0600) and sets `api_key_config=PATH` keeps the key out of `ps`.
SGLang leaves /health* open without the key, which the router's health checks rely on.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
REDACTED = "<redacted>"
_SECRET_FLAGS = ("--api-key", "--admin-api-key")


@dataclass(frozen=True)
class SGLangServerSpec:
    """One node of one SGLang engine."""

    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1  # GPUs of the whole engine, over all its nodes
    ep_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # "host:port" of node rank 0; required when nnodes > 1
    mem_fraction_static: float | None = None
    enable_memory_saver: bool = False  # colocated: weights and KV cache can be released and resumed
    enable_return_routed_experts: bool = False  # MoE routing replay: meta_info.routed_experts on request
    max_lora_rank: int = 0  # > 0: --enable-lora, adapters up to this rank loaded at run time
    lora_target_modules: tuple[str, ...] = ()
    base_gpu_id: int = 0
    dtype: str = "auto"
    random_seed: int | None = None
    api_key: str | None = None
    api_key_config: str | None = None  # path of a YAML file holding the key (see api_key_config_yaml)
    trust_remote_code: bool = False
    skip_server_warmup: bool = False
    log_level: str = "info"
    extra_args: tuple[str, ...] = ()


# The flags a spec field owns; extra_args must not repeat them (argparse would keep the last one).
_FIELD_OF_FLAG = {
    "--model-path": "model_path",
    "--model": "model_path",
    "--tokenizer-path": "tokenizer_path",
    "--host": "host",
    "--port": "port",
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--ep-size": "ep_size",
    "--expert-parallel-size": "ep_size",
    "--ep": "ep_size",
    "--dp-size": "dp_size",
    "--data-parallel-size": "dp_size",
    "--enable-dp-attention": "enable_dp_attention",
    "--nnodes": "nnodes",
    "--node-rank": "node_rank",
    "--dist-init-addr": "dist_init_addr",
    "--nccl-init-addr": "dist_init_addr",
    "--mem-fraction-static": "mem_fraction_static",
    "--enable-memory-saver": "enable_memory_saver",
    "--enable-return-routed-experts": "enable_return_routed_experts",
    "--base-gpu-id": "base_gpu_id",
    "--dtype": "dtype",
    "--random-seed": "random_seed",
    "--api-key": "api_key",
    "--trust-remote-code": "trust_remote_code",
    "--skip-server-warmup": "skip_server_warmup",
    "--log-level": "log_level",
    "--enable-lora": "max_lora_rank",
    "--max-lora-rank": "max_lora_rank",
    "--lora-target-modules": "lora_target_modules",
}


def validate(spec: SGLangServerSpec) -> None:
    """Raise ValueError naming the field when SGLang would reject `spec` (or start it wrongly)."""
    if not spec.model_path:
        raise ValueError("model_path is empty: give the Hugging Face checkpoint directory of the rollout model")
    for name in ("tp_size", "ep_size", "dp_size", "nnodes"):
        if getattr(spec, name) < 1:
            raise ValueError(f"{name}={getattr(spec, name)} must be >= 1")
    if not 1 <= spec.port <= 65535:
        raise ValueError(f"port={spec.port} is not a TCP port (1-65535)")
    if spec.tp_size % spec.nnodes:
        raise ValueError(
            f"tp_size={spec.tp_size} is not divisible by nnodes={spec.nnodes}: each node of an "
            f"engine holds tp_size / nnodes GPUs"
        )
    if not 0 <= spec.node_rank < spec.nnodes:
        raise ValueError(f"node_rank={spec.node_rank} must be in [0, nnodes={spec.nnodes})")
    if spec.nnodes > 1 and not spec.dist_init_addr:
        raise ValueError(
            f"dist_init_addr is required when nnodes={spec.nnodes} > 1: set it to "
            f"'<node 0 address>:<free port>', the same on every node"
        )
    if spec.dist_init_addr is not None:
        _check_host_port("dist_init_addr", spec.dist_init_addr)
    if spec.tp_size % spec.ep_size:
        raise ValueError(
            f"ep_size={spec.ep_size} does not divide tp_size={spec.tp_size}: SGLang places the "
            f"expert-parallel group inside the tensor-parallel group"
        )
    if spec.dp_size > 1 and spec.nnodes > 1 and not spec.enable_dp_attention:
        raise ValueError(
            f"dp_size={spec.dp_size} with nnodes={spec.nnodes} needs enable_dp_attention=True: "
            f"SGLang has no multi-node data parallelism otherwise; run one engine per replica"
        )
    if spec.enable_dp_attention and spec.tp_size % spec.dp_size:
        raise ValueError(
            f"dp_size={spec.dp_size} does not divide tp_size={spec.tp_size}, which enable_dp_attention requires"
        )
    if spec.mem_fraction_static is not None and not 0.0 < spec.mem_fraction_static < 1.0:
        raise ValueError(f"mem_fraction_static={spec.mem_fraction_static} must be in (0, 1)")
    if spec.base_gpu_id < 0:
        raise ValueError(f"base_gpu_id={spec.base_gpu_id} must be >= 0")
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype={spec.dtype!r} is not one of {', '.join(DTYPES)}")
    if spec.log_level not in LOG_LEVELS:
        raise ValueError(f"log_level={spec.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    if spec.api_key is not None and spec.api_key_config is not None:
        raise ValueError(
            "api_key and api_key_config are both set: give the key one way (api_key_config "
            "keeps it out of the process list)"
        )
    if spec.api_key == "":
        raise ValueError("api_key is empty: use None for no key")
    _check_extra_args(spec.extra_args)
    if spec.api_key_config is not None and any(a.split("=", 1)[0] == "--config" for a in spec.extra_args):
        raise ValueError(
            "extra_args has --config and api_key_config is set: SGLang reads one --config file; "
            "put the api-key line (api_key_config_yaml) in yours"
        )


def _check_host_port(name: str, value: str) -> None:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{name}={value!r} is not 'host:port'")


def _check_extra_args(extra_args: tuple[str, ...]) -> None:
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in _FIELD_OF_FLAG:
            raise ValueError(
                f"extra_args repeats {flag}, which the field {_FIELD_OF_FLAG[flag]} sets; set the field instead"
            )


def sglang_python() -> str:
    """The interpreter SGLang's servers and sglang-router run under: $MEGARL_SGLANG_PYTHON, read on
    the node that starts them, else this process's own. SGLang pins a transformers release that
    megarl's mbridge cannot load, so an environment may keep SGLang in an interpreter of its own
    (the Dockerfile does: its image's Python, with megarl in a virtual environment on top)."""
    return os.environ.get("MEGARL_SGLANG_PYTHON") or sys.executable


def server_argv(spec: SGLangServerSpec, python: str | None = None) -> list[str]:
    """The `python -m sglang.launch_server` argv for this node of the engine (python: sglang_python())."""
    validate(spec)
    argv = [python or sglang_python(), "-m", "sglang.launch_server", "--model-path", spec.model_path]
    # SGLang has no --weight-dirs / --max-body-mb: disk-update paths and body sizes are not confined there.
    if spec.tokenizer_path:
        argv += ["--tokenizer-path", spec.tokenizer_path]
    argv += [
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--tp-size",
        str(spec.tp_size),
        "--ep-size",
        str(spec.ep_size),
        "--dp-size",
        str(spec.dp_size),
    ]
    if spec.enable_dp_attention:
        argv.append("--enable-dp-attention")
    if spec.nnodes > 1:
        argv += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank)]
    if spec.dist_init_addr:
        argv += ["--dist-init-addr", spec.dist_init_addr]
    if spec.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if spec.enable_memory_saver:
        argv.append("--enable-memory-saver")
    if spec.enable_return_routed_experts:
        argv.append("--enable-return-routed-experts")
    if spec.max_lora_rank:
        argv += ["--enable-lora", "--max-lora-rank", str(spec.max_lora_rank), "--lora-target-modules"]
        argv += list(spec.lora_target_modules)
    argv += ["--base-gpu-id", str(spec.base_gpu_id), "--dtype", spec.dtype]
    if spec.random_seed is not None:
        argv += ["--random-seed", str(spec.random_seed)]
    if spec.api_key is not None:
        argv += ["--api-key", spec.api_key]
    if spec.api_key_config is not None:
        argv += ["--config", spec.api_key_config]
    if spec.trust_remote_code:
        argv.append("--trust-remote-code")
    if spec.skip_server_warmup:
        argv.append("--skip-server-warmup")
    argv += ["--log-level", spec.log_level]
    return argv + list(spec.extra_args)


def node_specs(spec: SGLangServerSpec) -> list[SGLangServerSpec]:
    """The spec of every node of the engine, node rank 0 first."""
    return [dataclasses.replace(spec, node_rank=rank) for rank in range(spec.nnodes)]


def redacted_argv(argv: list[str]) -> list[str]:
    """`argv` with every API key replaced, for logs and error messages."""
    out, hide_next = [], False
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        if hide_next:
            out.append(REDACTED)
        elif eq and flag in _SECRET_FLAGS:
            out.append(f"{flag}={REDACTED}")
        else:
            out.append(arg)
        hide_next = not hide_next and arg in _SECRET_FLAGS
    return out


def api_key_config_yaml(api_key: str) -> str:
    """The body of a `--config` YAML file that gives SGLang its API key."""
    # A JSON string is a valid YAML double-quoted scalar, whatever characters the key holds.
    return f"api-key: {json.dumps(api_key)}\n"


def sglang_unavailable_reason() -> str | None:
    """None when SGLang engines can start here, else a sentence saying what is missing and what to do."""
    missing = []
    if importlib.util.find_spec("sglang") is None:
        missing.append("the sglang package is not installed")
    else:
        try:
            importlib.import_module("sglang")
        except Exception as exc:  # a broken install is as unusable as a missing one; say why
            missing.append(f"the sglang package does not import ({type(exc).__name__}: {exc})")
    cuda = _cuda_problem()
    if cuda:
        missing.append(cuda)
    if not missing:
        return None
    return (
        f"rollout.backend=sglang needs the sglang package and a CUDA GPU, but {' and '.join(missing)}; "
        f"install sglang on a GPU machine, or use rollout.backend=embedded"
    )


def _cuda_problem() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed, so CUDA is not available"
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    return None
