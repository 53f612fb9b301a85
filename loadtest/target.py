"""Where a load test may point: loopback addresses only, unless the caller passes --allow-remote."""

from __future__ import annotations

import ipaddress
import socket


class RemoteAddress(ValueError):
    """The address is not on this machine's loopback interface."""


def split_address(address: str) -> tuple[str, int]:
    """'127.0.0.1:50051' / '[::1]:50051' / 'localhost:50051' -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"write an IPv6 host in brackets ([::1]:PORT), got {address!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True when host is a loopback IP, or a name that resolves only to loopback IPs."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_address(address: str, allow_remote: bool = False) -> str:
    """The address if a load test may target it; raises ValueError (RemoteAddress for non-loopback ones)."""
    if address.startswith("unix:"):  # a Unix domain socket is local by construction
        return address
    host, _ = split_address(address)
    if not allow_remote and not is_loopback(host):
        raise RemoteAddress(f"{host} is not a loopback address; load tests target this machine only "
                            f"(pass --allow-remote to override)")
    return address
