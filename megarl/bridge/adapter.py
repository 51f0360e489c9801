"""Adapter transport: a LoRA policy's adapters, not its merged weights, into engines that load
LoRA adapters (SGLang's /load_lora_adapter_from_tensors; the embedded engine merges them itself).

Every sync gathers the adapters as full PEFT-named tensors (a collective over the trainer ranks)
and rank 0 sends them with their adapter_config.json as one flattened bucket per engine, under one
name (ADAPTER_NAME) that the rollout's requests then carry as lora_path. SGLang refuses to load a
name it holds, so each engine first unloads it (best effort: an engine that has none, the first
time or after a restart, answers no). Moves the adapters' bytes, a fraction of the adapted
weights'; the engines keep their base weights.
"""

from __future__ import annotations

import logging

from megarl.bridge.buckets import tensor_bytes
from megarl.bridge.transport import WeightTransport

log = logging.getLogger(__name__)

ADAPTER_NAME = "megarl-policy"


class AdapterTransport(WeightTransport):
    def _sync(self, source, version, urls):
        config, state = source.export_adapter()  # every rank: the gather is a collective
        if self.rank != 0:
            return {}
        from megarl.wire.weights_codec import serialize_flattened_bucket

        named = sorted(state.items())
        payload = serialize_flattened_bucket(named)  # kept alive until every engine answered

        def load(engine):
            _unload_quietly(engine.client)
            engine.client.load_lora_adapter_from_tensors(
                ADAPTER_NAME, config, [payload] * engine.tp, load_format="flattened_bucket"
            )
            engine.applied = True  # one request, all or nothing: no staged update to commit
            engine.client.update_weight_version(version)

        def send(_):
            self.engines.each(lambda i, e: load(e), "load_lora_adapter_from_tensors")

        self._staged(version, urls, send, iter(()))
        return {"bridge/tensors": len(named), "bridge/bytes": sum(tensor_bytes(t) for _, t in named)}


def _unload_quietly(client) -> None:
    try:
        client.unload_lora_adapter(ADAPTER_NAME)
    except Exception as exc:  # noqa: BLE001  (nothing loaded under the name: the load that follows decides)
        log.debug("unload_lora_adapter before a load: %s", exc)
