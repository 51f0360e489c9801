"""Reads the records of a wandb run file (RUN_DIR/wandb/*run-*/run-<id>.wandb), what offline mode
writes and `wandb sync` uploads: a 7-byte header, then a leveldb-style log of 32 KiB blocks whose
records are protobuf `Record`s split into chunks (full, first, middle, last), each behind a 7-byte
header (crc32, length, chunk type)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:  # a block's tail too short for a header is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero-filled rest of the file
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[tuple[int, dict]]:
    """(step, {metric: value}) of every logged step, wandb's own keys (_step, _runtime, ...) left out."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            rows.append((record.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return rows


def config(path: Path) -> dict:
    """The run's config: every config update (and the run record's) applied in order."""
    out = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        update = record.config if kind == "config" else record.run.config if kind == "run" else None
        for item in update.update if update is not None else ():
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def run_id(path: Path) -> str:
    return next(r.run.run_id for r in records(path) if r.WhichOneof("record_type") == "run")
