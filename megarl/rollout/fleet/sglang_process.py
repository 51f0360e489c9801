"""SGLangServerProcess: one node of a real SGLang engine, run like the embedded server.

The same process handling as RolloutServerProcess (own process group, log file, health wait,
stop), with the command from megarl.rollout.fleet.sglang_launch. The API key goes to SGLang in a
`--config` YAML file readable only by this user, so it is never on a command line or in a log.
The launcher has already set CUDA_VISIBLE_DEVICES to this node's GPUs, so --base-gpu-id is 0.
Written for GPU nodes; not run on the CPU machines this project is developed on.
"""

from __future__ import annotations

import os
import tempfile

from megarl.rollout.fleet.server_process import RolloutServerProcess
from megarl.rollout.fleet.sglang_launch import SGLangServerSpec, api_key_config_yaml, server_argv


class SGLangServerProcess(RolloutServerProcess):
    def __init__(self, node, dist_init_addr: str | None, api_key: str | None, env: dict):
        super().__init__(
            node.model_path,
            host=node.host,
            port=node.port,
            env=env,
            log_path=node.log_path,
            startup_timeout_s=node.startup_timeout_s,
        )
        self.node, self.dist_init_addr = node, dist_init_addr
        self._key_file = _write_key_file(api_key) if api_key else None

    def command(self, port: int) -> list[str]:
        n = self.node
        spec = SGLangServerSpec(
            model_path=n.model_path,
            host=n.host,
            port=port,
            tp_size=n.tp,
            ep_size=n.ep,
            dp_size=n.dp,
            enable_dp_attention=n.dp > 1,  # rollout.dp is attention data parallelism inside the engine
            nnodes=n.nnodes,
            node_rank=n.node_rank,
            dist_init_addr=self.dist_init_addr,
            enable_memory_saver=n.colocated,
            random_seed=n.seed,
            api_key_config=self._key_file,
            mem_fraction_static=n.mem_fraction_static,
            enable_return_routed_experts=n.routed_experts,
            max_lora_rank=n.lora_rank,
            lora_target_modules=n.lora_target_modules,
        )
        return server_argv(spec)

    def __del__(self):
        if self._key_file and os.path.exists(self._key_file):
            os.unlink(self._key_file)


def _write_key_file(api_key: str) -> str:
    fd, path = tempfile.mkstemp(prefix="megarl-sglang-", suffix=".yaml")  # mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(api_key_config_yaml(api_key))
    return path
