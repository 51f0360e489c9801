"""Which trainer rank sends to which engine when handles only open on the host that made them.

Shared-memory and CUDA IPC handles are host-local, and every trainer rank holds each full tensor
as the export yields it, so the lowest trainer rank of each host sends to the engines on that
host. Hosts are compared by IP: a rank reports its node IP, an engine is known by its URL, and
both are resolved the same way (an engine at "localhost" is on the host of a rank at 127.0.0.1).
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from megarl.bridge.engines import WeightSyncError


def resolve(host: str) -> str:
    """The IP `host` names (itself when it is one, or when it does not resolve)."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError):
        return host


def url_ip(url: str) -> str:
    return resolve(urlsplit(url).hostname or "")


def senders_by_host(addresses: list[str], urls: list[str]) -> dict[int, list[str]]:
    """{sending rank: the engine URLs on its host}, the lowest rank of each host sending.

    `addresses`: every trainer rank's IP, by rank. Every rank computes the same answer from the
    same inputs, so all of them refuse a URL together, before any collective of the sync."""
    leaders: dict[str, int] = {}
    for rank, ip in enumerate(addresses):
        leaders.setdefault(ip, rank)
    plan: dict[int, list[str]] = {}
    orphans = []
    for url in urls:
        rank = leaders.get(url_ip(url))
        if rank is None:
            orphans.append(url)
        else:
            plan.setdefault(rank, []).append(url)
    if orphans:
        raise WeightSyncError(
            f"bridge.transport=tensor: no trainer rank runs on the host of {', '.join(orphans)} "
            f"(trainer hosts: {', '.join(sorted(leaders))}); its shared-memory / CUDA IPC handles "
            "can only be opened on the host that made them: colocate every engine with trainer "
            "ranks, or use bridge.transport=distributed"
        )
    return plan
