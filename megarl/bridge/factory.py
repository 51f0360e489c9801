"""The transport a BridgeSpec names, made on one trainer rank (the interface is transport.py).

    transport = make_transport(spec, rank, world_size, address)   # once per run, on every trainer rank

Kept apart from the interface: every transport module builds on `WeightTransport`, and this
module builds on every transport, so the interface never imports its implementations.
"""

from __future__ import annotations

from megarl.bridge.spec import BridgeSpec
from megarl.bridge.transport import WeightTransport


def make_transport(spec: BridgeSpec, rank: int = 0, world_size: int = 1, address: str = "127.0.0.1") -> WeightTransport:
    # imported here: `import megarl.bridge` (for BridgeSpec) stays as light as it was, and a
    # process loads only the transport it uses
    from megarl.bridge.adapter import AdapterTransport
    from megarl.bridge.disk import DiskTransport
    from megarl.bridge.distributed import DistributedTransport
    from megarl.bridge.reshard import ReshardTransport
    from megarl.bridge.tensor import TensorTransport

    kinds = {
        "tensor": TensorTransport,
        "disk": DiskTransport,
        "distributed": DistributedTransport,
        "reshard": ReshardTransport,
        "adapter": AdapterTransport,
    }
    return kinds[spec.transport](spec, rank, world_size, address)
