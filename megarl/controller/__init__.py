"""megarl.controller: the runtime layer. Worker groups of SPMD Ray actors and @register dispatch.

    from megarl.controller import Dispatch, RayCluster, RayWorkerGroup, Worker, register

dispatch and decorator are pure Python; the Ray/torch-backed names are imported on first use so
that `import megarl.controller.dispatch` stays cheap and Ray-free.
"""

from megarl.controller.decorator import Registration, register, registration_of
from megarl.controller.dispatch import Dispatch, MeshCoord, MeshError, collect_outputs, split_args, validate_mesh

_LAZY = {
    "Worker": "megarl.controller.worker",
    "RayWorkerGroup": "megarl.controller.worker_group",
    "PendingCall": "megarl.controller.worker_group",
    "WorkerError": "megarl.controller.worker_group",
    "RayCluster": "megarl.controller.cluster",
}

__all__ = [
    "Dispatch",
    "MeshCoord",
    "MeshError",
    "Registration",
    "collect_outputs",
    "register",
    "registration_of",
    "split_args",
    "validate_mesh",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megarl.controller' has no attribute {name!r}")
