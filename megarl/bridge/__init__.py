"""Weight bridge: stream the trainer's weights to the rollout servers after every update.

The trainer side yields (hf_name, full tensor) pairs (engine.export_weights, a collective); a
sender packs them into buckets of a configured size and pushes each bucket to every server.
Transports: `tensor` (colocated: shared-memory / CUDA-IPC handles through SGLang's
/update_weights_from_tensor) and `disk` (safetensors + /update_weights_from_disk).
"""

from megarl.bridge.buckets import iter_buckets
from megarl.bridge.senders import DiskWeightSender, TensorWeightSender, make_weight_sender

__all__ = ["iter_buckets", "make_weight_sender", "TensorWeightSender", "DiskWeightSender"]
