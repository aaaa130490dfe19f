"""Hosts for cluster tests: one network namespace per host, all on one bridge (in a switch
namespace of its own), like machines on one cluster network. Their addresses (10.78.x.y)
exist only inside those namespaces: never address them from outside."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    ns: str
    ip: str
    dev: str  # its end of the link to the switch

    def run(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host."""
        return ["ip", "netns", "exec", self.ns, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def fabric(count: int) -> Iterator[list[Host]]:
    """`count` hosts on one switch; every namespace is deleted afterwards."""
    tag = uuid.uuid4().hex[:6]
    octet = int(tag[:2], 16)
    switch = f"pdf-{tag}-sw"
    created: list[str] = []
    try:
        _ip("netns", "add", switch)
        created.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        hosts = []
        for i in range(count):
            ns, dev, port = f"pdf-{tag}-{i}", f"v{tag}{i}", f"s{tag}{i}"
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            ip = f"10.78.{octet}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            hosts.append(Host(ns, ip, dev))
        yield hosts
    finally:
        for ns in reversed(created):  # a namespace takes its veth ends with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
