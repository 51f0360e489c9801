"""Weight bridge: stream the trainer's weights to the rollout engines after every update.

One interface (transport.py), chosen by a typed spec (spec.py) and made by make_transport
(factory.py), one small class per transport:
`tensor` (colocated: shared-memory / CUDA-IPC handles, /update_weights_from_tensor), `disk`
(safetensors + /update_weights_from_disk), `distributed` (SGLang's update groups: each pipeline
stage and expert owner broadcasts its own full tensors) and `reshard` (a plan sends each rollout
rank exactly its shard, point to point, from many trainer ranks at once).
"""

from megarl.bridge.buckets import iter_buckets
from megarl.bridge.engines import WeightSyncError
from megarl.bridge.factory import make_transport
from megarl.bridge.spec import TRANSPORTS, BridgeSpec
from megarl.bridge.transport import WeightTransport

__all__ = ["BridgeSpec", "TRANSPORTS", "WeightSyncError", "WeightTransport", "iter_buckets", "make_transport"]
