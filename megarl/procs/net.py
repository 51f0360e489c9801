"""Network helpers every process-launching layer needs: a free port, this node's IP, loopback.

Kept free of torch and Ray imports (Ray is imported only when it is already running), so a
launcher actor or the config validator can use them without paying for either.
"""

from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "127.0.0.1", avoid=()) -> int:
    """A port the OS reports free on `host`, never one of `avoid` (the OS may hand a port it gave
    out before straight back)."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise RuntimeError(f"the OS kept offering ports in {sorted(avoid)[:8]} on {host}")


def get_node_ip() -> str:
    """The IP other nodes reach this process at (Ray's view when running inside Ray). Here, not in
    megarl.controller, so a launcher actor does not import torch (1.7 s of CPU at start-up) for it."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    try:
        # The address this host's name resolves to; no packet is sent to find it.
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; every other address (0.0.0.0, ::, a NIC) is reachable."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False
