"""Named tensors <-> SGLang's `serialized_named_tensors` strings (MultiprocessingSerializer format).

The wire format is SGLang's: ``base64(ForkingPickler.dumps(list[(name, tensor)]))``. A tensor is
pickled as a *handle* to its memory (torch.multiprocessing's reductions), not as its bytes, so a
10 GB bucket still makes a request body of a few hundred bytes. Both sides must run on the same
host; CUDA tensors travel as CUDA IPC handles, CPU tensors as shared memory.

What happens to CPU tensors between two UNRELATED processes (the trainer's Ray worker sends, the
rollout server, started elsewhere, receives) — measured with torch 2.13 on Linux:

* torch's default sharing strategy, ``file_descriptor``, pickles a ``multiprocessing.reduction.DupFd``.
  Outside a parent/child pair this means ``resource_sharer``: the sender registers the fd with a
  listener thread and the receiver must connect to it and pass an HMAC challenge keyed by
  ``current_process().authkey``. Unrelated processes have different random authkeys, so the
  receiver fails with ``AuthenticationError: digest sent was rejected`` (and the sender's listener
  logs "digest received was wrong"); the fd stays registered (open) in the sender.
  It only works between processes that inherited one authkey (mp.Process children).
* the ``file_system`` strategy pickles the *name* of a POSIX shared-memory file (/dev/shm/torch_*)
  plus the socket of the sender's ``torch_shm_manager``. Any process of the same user on the same
  host can open it by name: it works between unrelated processes. It is zero-copy on the receiving
  side (both processes map the same pages; a write in one is seen by the other). On the sending
  side the tensor's storage is moved into shared memory once (one memcpy; later sends of the same
  storage reuse the file). Pickling increments the file's refcount (kept in the file itself) and
  unpickling decrements it, so the file outlives the sender's tensor until the receiver opened it.
  If a payload is never loaded, that reference leaks until every process attached to the sender's
  torch_shm_manager has exited; the manager then unlinks its files. The receiver stays attached to
  that manager for its whole life, so the manager (a small daemon the sender spawned, holding the
  sender's stdio open) outlives the sender until the server exits: capture a sender's output in
  files, not pipes, or the reader never sees EOF.

So this codec always uses the file_system reduction for CPU storages, whatever the process-wide
strategy is (it swaps the reducer in a private pickler, never the global setting). The payload
stays SGLang-compatible: it rebuilds through torch's own ``rebuild_storage_filename``, so any
receiver that unpickles it with torch imported gets the tensors, SGLang included.

Rules for callers, from the same experiments: keep the tensors alive and unmodified until the
server has replied (the server reads the live memory when the request arrives; CUDA IPC needs the
tensor alive, and for CPU the pickled reference alone would keep the file, but the data must not
change underneath). The sending PROCESS must outlive the load: if it exits before the server
attached, its torch_shm_manager exits too and unlinks the files, and the server's load fails with
"No such file or directory". A payload is
meant to be loaded once. Sender and server must share /dev/shm (same host, same container or a
shared /dev/shm mount). Sending a view shares its whole underlying storage.
"""

from __future__ import annotations

import base64
import io
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reducers with ForkingPickler)
from torch.multiprocessing import reductions as _torch_reductions

from megarl.wire.safe_unpickle import safe_loads

NamedTensors = list[tuple[str, torch.Tensor]]


def _reduce_cpu_storage_by_filename(storage: torch.UntypedStorage):
    """torch's file_system branch of reduce_storage, chosen per pickler instead of process-wide."""
    if storage.device.type != "cpu":
        return _torch_reductions.reduce_storage(storage)
    if storage.size() == 0:  # an empty storage cannot be mmapped
        return (_torch_reductions.rebuild_storage_empty, (type(storage),))
    manager_handle, shm_name, size = storage._share_filename_cpu_()
    # The receiver's rebuild_storage_filename drops this reference once it has the file open.
    storage._shared_incref()
    _torch_reductions.shared_cache[shm_name] = _torch_reductions.StorageWeakRef(storage)
    return (_torch_reductions.rebuild_storage_filename, (type(storage), manager_handle, shm_name, size))


class _SharedFilePickler(ForkingPickler):
    def __init__(self, *args):
        super().__init__(*args)
        self.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage_by_filename


def serialize(obj) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True), CPU tensors by shm name."""
    buf = io.BytesIO()
    _SharedFilePickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize(payload: str | bytes):
    """Inverse of `serialize`; maps the sender's shared memory (or CUDA IPC handles) in place.
    Only torch's tensor rebuild functions may run while loading (safe_unpickle.py): a payload
    naming anything else raises RefusedGlobal (a ValueError) and nothing of it runs."""
    try:
        raw = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
    except ValueError as exc:
        raise ValueError(f"serialized tensors are not valid base64: {exc}") from exc
    try:
        return safe_loads(raw)
    except (RuntimeError, OSError) as exc:  # typically: the shared-memory file cannot be opened
        raise ValueError(
            f"could not map the sender's tensors ({exc}). CPU tensors travel as /dev/shm files: sender "
            "and server must share the host and /dev/shm, and the sending process must stay alive, "
            "holding the tensors, until the server has replied"
        ) from exc


def serialize_named_tensors(named_tensors: NamedTensors) -> str:
    """One `serialized_named_tensors` entry (one per TP rank of the receiving server)."""
    _check_named_tensors(named_tensors)
    return serialize([(name, tensor.detach()) for name, tensor in named_tensors])


def deserialize_named_tensors(payload: str | bytes) -> NamedTensors:
    obj = deserialize(payload)
    if isinstance(obj, dict) and "flattened_tensor" in obj:
        raise ValueError("payload is a flattened bucket; load it with load_format='flattened_bucket'")
    _check_named_tensors(obj)
    return [(name, tensor) for name, tensor in obj]


FLAT_ALIGN = 16  # bytes; every tensor starts aligned so the receiver can view it in its dtype


def flattened_bucket_nbytes(named_tensors: NamedTensors) -> int:
    """Bytes a flattened bucket of these tensors needs (with alignment padding)."""
    total = 0
    for _, tensor in named_tensors:
        total = _aligned(total) + tensor.numel() * tensor.element_size()
    return total


def pack_flattened_bucket(named_tensors: NamedTensors, out: torch.Tensor | None = None):
    """Copy tensors into one uint8 buffer (`out`, reused by callers that send often, or a new
    one) at FLAT_ALIGN-aligned offsets. Returns (buffer view, SGLang metadata list)."""
    _check_named_tensors(named_tensors)
    if not named_tensors:
        raise ValueError("cannot build a flattened bucket from zero tensors")
    need = flattened_bucket_nbytes(named_tensors)
    device = named_tensors[0][1].device
    if out is None:
        out = torch.empty(need, dtype=torch.uint8, device=device)
    elif out.numel() < need or out.dtype != torch.uint8:
        raise ValueError(f"flattened bucket needs a uint8 buffer of >= {need} bytes, got {out.numel()} {out.dtype}")
    metadata, offset = [], 0
    for name, tensor in named_tensors:
        offset = _aligned(offset)
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        out[offset : offset + flat.numel()].copy_(flat)
        metadata.append(
            SimpleNamespace(
                name=name,
                shape=tuple(tensor.shape),
                dtype=tensor.dtype,
                start_idx=offset,
                end_idx=offset + flat.numel(),
                numel=flat.numel(),
            )
        )
        offset += flat.numel()
    return out[:offset], metadata


def serialize_flattened_bucket(named_tensors: NamedTensors, out: torch.Tensor | None = None) -> str:
    """SGLang's load_format="flattened_bucket": one uint8 buffer plus per-tensor byte ranges.

    One shared-memory file per bucket instead of one per tensor; with `out` (a buffer already in
    shared memory) none at all, and no copy beyond packing. The metadata are SimpleNamespace
    objects with SGLang's FlattenedTensorMetadata attributes, so a real SGLang server (which reads
    them by attribute) accepts the payload without megarl installed.
    """
    flat, metadata = pack_flattened_bucket(named_tensors, out)
    return serialize({"flattened_tensor": flat, "metadata": metadata})


def _aligned(offset: int) -> int:
    return (offset + FLAT_ALIGN - 1) // FLAT_ALIGN * FLAT_ALIGN


def deserialize_flattened_bucket(payload: str | bytes) -> NamedTensors:
    obj = deserialize(payload)
    if not (isinstance(obj, dict) and "flattened_tensor" in obj and "metadata" in obj):
        raise ValueError("flattened_bucket payload must be a dict with 'flattened_tensor' and 'metadata'")
    if not isinstance(obj["flattened_tensor"], torch.Tensor):
        raise ValueError(
            f"flattened_bucket 'flattened_tensor' is a {type(obj['flattened_tensor']).__name__}, not a tensor"
        )
    flat = obj["flattened_tensor"].reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    out = []
    for meta in obj["metadata"]:
        field = meta.get if isinstance(meta, dict) else lambda key, m=meta: getattr(m, key)
        start, end = int(field("start_idx")), int(field("end_idx"))
        if not 0 <= start <= end <= flat.numel():
            raise ValueError(
                f"flattened_bucket entry {field('name')!r}: byte range [{start}, {end}) "
                f"outside the {flat.numel()}-byte buffer"
            )
        tensor = flat[start:end].view(field("dtype")).reshape(tuple(field("shape")))
        out.append((field("name"), tensor))
    return out


def decode_payload(payload: str | bytes, load_format: str | None) -> NamedTensors:
    """Decode one `serialized_named_tensors` entry according to SGLang's `load_format`."""
    if load_format in (None, "direct"):
        return deserialize_named_tensors(payload)
    if load_format == "flattened_bucket":
        return deserialize_flattened_bucket(payload)
    raise ValueError(f"load_format={load_format!r} is not supported; use null or 'flattened_bucket'")


def _check_named_tensors(obj) -> None:
    if not isinstance(obj, (list, tuple)):
        raise ValueError(f"named tensors must be a list of (name, tensor) pairs, got {type(obj).__name__}")
    for i, item in enumerate(obj):
        ok = isinstance(item, (list, tuple)) and len(item) == 2
        if not (ok and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"named tensors entry {i} is not a (str, torch.Tensor) pair: {item!r:.80}")
