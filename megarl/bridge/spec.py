"""The bridge's one typed spec: which transport, to which engines, in what bucket size."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

TRANSPORTS = ("tensor", "disk", "distributed", "reshard", "adapter")


@dataclass(frozen=True)
class BridgeSpec:
    """Everything a transport needs; built by the loop from the run config, sent to every trainer rank.

    `server_urls` are the engines' own URLs (never the router's). `backend` is the update group's
    (distributed / reshard): None picks gloo on CPU and NCCL on CUDA. `timeout_s` bounds every
    HTTP call and every collective of a sync, so a dead peer fails the sync instead of hanging it.
    """

    transport: str
    server_urls: tuple[str, ...]
    bucket_bytes: int
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 600.0
    disk_dir: str | None = None
    backend: str | None = None
    # hold generation (/pause_generation .. /continue_generation) around a sync; a loop whose
    # engines are idle while it syncs (the synchronous one) turns it off: two round trips per
    # engine per step for nothing
    pause_generation: bool = True
    # its /pause_generation mode: in_place (running requests keep their KV cache) or retract (they
    # go back to the queue and are re-prefilled with the new weights); either way they continue
    pause_mode: str = "in_place"

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"bridge.transport={self.transport!r} is not one of {', '.join(TRANSPORTS)}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bridge.bucket_size_mb must be positive (got {self.bucket_bytes} bytes)")
        if self.transport == "disk" and not self.disk_dir:
            raise ValueError("bridge.transport=disk needs a directory for the checkpoints (disk_dir)")
        if not self.server_urls:
            raise ValueError("bridge: no rollout server URLs to send weights to")
        object.__setattr__(self, "server_urls", tuple(self.server_urls))

    def same_transport(self, other: BridgeSpec | None) -> bool:
        """True when `other` differs at most in its engine URLs (the transport can be kept)."""
        return other is not None and replace(other, server_urls=self.server_urls) == self
