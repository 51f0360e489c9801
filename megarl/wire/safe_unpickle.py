"""Unpickling weight payloads without running whatever they name.

SGLang's `serialized_named_tensors` are pickles, and a pickle may call any importable function
while it loads (`os.system`, `builtins.exec`, ...). This unpickler resolves only the globals that
torch's tensor-handle reductions need: the set weights_codec's payloads reference (named lists
and flattened buckets; CPU tensors of every dtype, views, parameters, empty tensors; found by
recording `find_class` while loading real payloads), plus `rebuild_cuda_tensor`, whose arguments
are classes already allowed (read from torch's reduce_tensor; no GPU was at hand to record a CUDA
payload). SGLang's own bucket metadata class resolves to a local plain-data stand-in (so buckets
from SGLang's FlattenedTensorBucket load without sglang's code). A payload naming anything else is refused before that global is even imported, so
nothing of it runs.

Deliberately refused although torch produces them: `rebuild_storage_fd` and its
`multiprocessing.resource_sharer.DupFd` (torch's default file_descriptor sharing strategy) make
the receiver connect to an address the payload names and answer an authentication challenge with
its process key, and only ever work between a parent and its child anyway;
`torch.storage._load_from_bytes` (plain pickling of a tensor) calls torch.load. Senders use
weights_codec, which pickles CPU storages by shared-memory file name.

What the allowed functions still do with hostile arguments: map a shared-memory file or CUDA IPC
handle the payload names (that is the protocol) and allocate tensors of the payload's size, so
the endpoint stays behind the API key and a loopback bind, as SGLang's does.
"""

from __future__ import annotations

import io
import pickle
from types import SimpleNamespace

import torch
import torch.multiprocessing.reductions  # noqa: F401  (the rebuild functions must be importable)

_REDUCTIONS = "torch.multiprocessing.reductions"
ALLOWED_GLOBALS = frozenset(
    {
        (_REDUCTIONS, "rebuild_tensor"),
        (_REDUCTIONS, "rebuild_cuda_tensor"),
        (_REDUCTIONS, "rebuild_storage_filename"),
        (_REDUCTIONS, "rebuild_storage_empty"),
        (_REDUCTIONS, "rebuild_typed_storage"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch.storage", "UntypedStorage"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch", "TypedStorage"),  # rebuild_cuda_tensor's storage class
        ("torch", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch", "Size"),
        ("types", "SimpleNamespace"),  # flattened-bucket metadata
        ("collections", "OrderedDict"),  # _rebuild_tensor_v2's backward hooks
    }
)
_FD_HANDLE = (
    "a file-descriptor handle (torch's file_descriptor sharing strategy), which would make this "
    "server connect to an address the payload names; send with megarl.wire.weights_codec, "
    "which shares CPU tensors by shared-memory file name"
)
_WHY_REFUSED = {
    (_REDUCTIONS, "rebuild_storage_fd"): _FD_HANDLE,
    ("multiprocessing.resource_sharer", "DupFd"): _FD_HANDLE,
    (
        "torch.storage",
        "_load_from_bytes",
    ): "a tensor pickled by value, whose loader runs torch.load; send tensor handles made by "
    "megarl.wire.weights_codec instead",
}


class FlattenedTensorMetadata(SimpleNamespace):
    """Stands in for SGLang's `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata` (a plain
    dataclass: name, shape, dtype, start_idx, end_idx, numel), which buckets built by SGLang's own
    FlattenedTensorBucket carry (verl's and slime's payloads): they unpickle into attribute data
    here without sglang installed and without importing any of its code."""


# globals a payload may name that resolve to a local plain-data class instead of their module
_STAND_INS = {("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata}


class RefusedGlobal(ValueError):
    """A weight payload named a global outside the allow-list; nothing of it was run."""


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        if (module, name) in _STAND_INS:
            return _STAND_INS[module, name]
        why = _WHY_REFUSED.get((module, name), "not a torch tensor or storage rebuild function")
        raise RefusedGlobal(
            f"weight payload refused: it references {module}.{name} ({why}); nothing from "
            "it was run. Payloads may only rebuild torch tensors (see "
            "megarl/wire/safe_unpickle.py for the allowed globals)"
        )


def safe_loads(raw: bytes):
    """pickle.loads restricted to ALLOWED_GLOBALS (plus torch dtypes); RefusedGlobal otherwise."""
    try:
        return _AllowListUnpickler(io.BytesIO(raw)).load()
    except RefusedGlobal:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, IndexError) as exc:
        raise ValueError(f"the weight payload is not a valid pickle of tensors: {exc!r}") from exc
