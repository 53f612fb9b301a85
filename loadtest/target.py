"""Where a load test may point: loopback addresses only, unless the caller passes --allow-remote."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


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


def check_url(url: str, allow_remote: bool = False) -> str:
    """An http(s) base URL if a load test may target it, by the rule check_address applies to its host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected http://HOST:PORT or https://HOST:PORT, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError:
        raise ValueError(f"bad port in {url!r}") from None
    if not allow_remote and not is_loopback(parts.hostname):
        raise RemoteAddress(f"{parts.hostname} is not a loopback address; load tests target this machine only "
                            f"(pass --allow-remote to override)")
    return url
