"""RolloutClient's weight-update and memory calls, SGLang's endpoints one method each: pausing and
continuing generation around an update, tensor payloads, disk, update groups (distributed broadcast
and megarl's reshard), the commit and abort of staged updates, LoRA adapters, and releasing /
resuming the engine's memory.

A mixin: the transport (`_run`, `_control`, `_json`, retries) is RolloutClient's (client.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


class WeightCalls:
    """Every call here answers SGLang's {"success", "message"} (success false raises
    RolloutRequestError); the update-group calls are sent once, never retried."""

    # The transport, RolloutClient's: _run(coro) runs it on the client's event loop, and
    # _control(path, payload, retry) posts and checks {"success", "message"}.
    _run: Callable[..., Any]
    _control: Callable[..., Awaitable[dict]]
    _json: Callable[..., Awaitable[Any]]

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._run(self._json("POST", "/pause_generation", {"mode": mode}))

    def continue_generation(self) -> dict:
        return self._run(self._json("POST", "/continue_generation", {}))

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str] | str,
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        defer: bool = False,
    ) -> dict:
        """`serialized_named_tensors`: one weights_codec payload per TP rank of the server. Keep the
        tensors behind it alive until this returns. `defer` (megarl's engine only): stage the
        tensors for `weight_version` until /commit_weight_update."""
        payloads = [serialized_named_tensors] if isinstance(serialized_named_tensors, str) else serialized_named_tensors
        return self._run(
            self._control(
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": payloads,
                    "load_format": load_format,
                    "flush_cache": flush_cache,
                    "weight_version": weight_version,
                    "abort_all_requests": abort_all_requests,
                    **({"defer": True} if defer else {}),
                },
            )
        )

    def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict,
        serialized_named_tensors: list[str] | str,
        *,
        load_format: str | None = None,
    ) -> dict:
        """A PEFT adapter (its adapter_config.json and one weights_codec payload of its PEFT-named
        tensors per TP rank) loaded as `lora_name`; requests select it with lora_path."""
        payloads = [serialized_named_tensors] if isinstance(serialized_named_tensors, str) else serialized_named_tensors
        body = {"lora_name": lora_name, "config_dict": config_dict, "serialized_named_tensors": payloads}
        return self._run(self._control("/load_lora_adapter_from_tensors", {**body, "load_format": load_format}))

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> dict:
        """Label the weights the server holds (SGLang aborts in-flight requests by default; not here)."""
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return self._run(self._control("/update_weight_version", body))

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._run(self._control("/unload_lora_adapter", {"lora_name": lora_name}))

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict:
        return self._run(
            self._control(
                "/update_weights_from_disk",
                {
                    "model_path": model_path,
                    "weight_version": weight_version,
                    "flush_cache": flush_cache,
                    "abort_all_requests": abort_all_requests,
                },
            )
        )

    # The group calls below are sent once, never retried: the server matches each one with the
    # senders' collectives, and a re-sent request would wait for collectives nobody repeats.
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str | None = None,
    ) -> dict:
        """Returns once every engine rank has joined (the caller's own ranks must join meanwhile, from
        another thread or process). backend None: the server's default (gloo on CPU, nccl on CUDA)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
        }
        if backend is not None:
            body["backend"] = backend
        return self._run(self._control("/init_weights_update_group", body, retry=False))

    def destroy_weights_update_group(self, group_name: str) -> dict:
        return self._run(self._control("/destroy_weights_update_group", {"group_name": group_name}))

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        *,
        load_format: str | None = "flattened_bucket",
        flush_cache: bool = False,
        weight_version: str | None = None,
        defer: bool = False,
    ) -> dict:
        """Returns once the server has received the broadcast(s) from group rank 0 (the caller sends
        them meanwhile) and written or, with `defer`, staged them."""
        return self._run(
            self._control(
                "/update_weights_from_distributed",
                {
                    "names": names,
                    "dtypes": dtypes,
                    "shapes": shapes,
                    "group_name": group_name,
                    "load_format": load_format,
                    "flush_cache": flush_cache,
                    "weight_version": weight_version,
                    **({"defer": True} if defer else {}),
                },
                retry=False,
            )
        )  # SGLang refuses fields it does not know

    def update_weights_from_reshard(
        self, group_name: str, ranks: list[list[dict]], *, weight_version: str, defer: bool = True
    ) -> dict:
        """`ranks[r]`: the messages engine rank r receives ({src, tag, nbytes, entries})."""
        return self._run(
            self._control(
                "/update_weights_from_reshard",
                {"group_name": group_name, "ranks": ranks, "weight_version": weight_version, "defer": defer},
                retry=False,
            )
        )

    def commit_weight_update(self, weight_version: str) -> dict:
        return self._run(self._control("/commit_weight_update", {"weight_version": weight_version}))

    def abort_weight_update(self) -> dict:
        return self._run(self._control("/abort_weight_update", {}))

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._run(self._control("/release_memory_occupation", {"tags": tags}))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._run(self._control("/resume_memory_occupation", {"tags": tags}))
