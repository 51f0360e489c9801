"""Rank 0 -> followers: each command is one pickled dict, broadcast over the TP process group.

A command travels in a fixed-size frame (one broadcast: every rank must post the same size, and
gloo aborts the process on a size mismatch); the rare command that does not fit (a prefill of
long prompts, many weight payload handles) sends its tail in a second broadcast whose size the
frame announced. The group's timeout is very long (see mesh.py), so followers may wait here
between requests for as long as the engine idles.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

FRAME_BYTES = 4096  # fits a decode step of 32 rows with a 400-token mask (bit-packed)
_HEADER = 8  # payload length, little-endian


class CommandChannel:
    def __init__(self, device: torch.device):
        self.device = device
        self._frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8, device=device)

    def send(self, command: dict) -> None:
        """Rank 0: broadcast one command (all followers must be waiting in `receive`)."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        head = len(data).to_bytes(_HEADER, "little") + data[: FRAME_BYTES - _HEADER]
        self._frame[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        dist.broadcast(self._frame, src=0)
        if len(data) > FRAME_BYTES - _HEADER:
            tail = torch.frombuffer(bytearray(data[FRAME_BYTES - _HEADER :]), dtype=torch.uint8)
            dist.broadcast(tail.to(self.device), src=0)

    def receive(self) -> dict:
        """Followers: block until rank 0 sends the next command."""
        dist.broadcast(self._frame, src=0)
        frame = self._frame.cpu().numpy().tobytes()
        length = int.from_bytes(frame[:_HEADER], "little")
        data = frame[_HEADER : _HEADER + length]
        if length > FRAME_BYTES - _HEADER:
            tail = torch.empty(length - (FRAME_BYTES - _HEADER), dtype=torch.uint8, device=self.device)
            dist.broadcast(tail, src=0)
            data += tail.cpu().numpy().tobytes()
        return pickle.loads(data)
