"""Host names in URLs and `host:port` names: an IPv6 address goes in brackets (once)."""

from __future__ import annotations


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def host_port(host: str, port: int) -> str:
    return f"{url_host(host)}:{port}"
