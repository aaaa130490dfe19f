"""Start vLLM with the KV transfer advertised on one network interface's address.

On Kubernetes with a secondary network (Multus) the RDMA NIC's address is known only once
the pod runs, on an interface the chart names (`network.kvInterface`, net1 by default):

    python3 -m appliance.kvhost --interface net1 -- python3 -m appliance.launcher serve ...

This reads the interface's address (its IPv4 one, else a global IPv6 one), sets it as the
connector's `host` in `--kv-transfer-config` (where the side channel and Mooncake listen,
and what P and D tell each other), and replaces itself with the command. vLLM's HTTP port,
VLLM_HOST_IP (KV events for the proxy) and P's bootstrap sidecar stay on the pod IP, the
`host` the chart rendered: P's workers get the sidecar's URL from it.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
import time
from pathlib import Path

from appliance.netaddr import host_port

KV_FLAG = "--kv-transfer-config"
IF_INET6 = Path("/proc/net/if_inet6")
_SIOCGIFADDR = 0x8915
_IFA_F_DADFAILED, _IFA_F_TENTATIVE = 0x08, 0x40


def ipv4_address(name: str) -> str | None:
    """The interface's (primary) IPv4 address, or None: no such interface or no address."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                              struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(got[20:24])


def ipv6_addresses(name: str, table: Path = IF_INET6) -> list[str]:
    """The interface's usable global IPv6 addresses (not link-local, not in DAD)."""
    try:
        lines = table.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        f = line.split()
        if len(f) != 6 or f[5] != name or f[3] != "00":
            continue
        if int(f[4], 16) & (_IFA_F_TENTATIVE | _IFA_F_DADFAILED):
            continue
        out.append(str(ipaddress.IPv6Address(bytes.fromhex(f[0]))))
    return out


def interface_address(name: str, wait_s: float = 30.0, table: Path = IF_INET6) -> str:
    """The address to advertise on `name`, waiting up to `wait_s` for one to appear;
    LookupError saying what there is otherwise."""
    end = time.monotonic() + wait_s
    while True:
        found = ipv4_address(name) or next(iter(ipv6_addresses(name, table)), None)
        if found:
            return found
        if time.monotonic() >= end:
            break
        time.sleep(1.0)
    names = sorted(n for _, n in socket.if_nameindex())
    what = "has no address" if name in names else "does not exist"
    raise LookupError(f"interface {name} {what} after {wait_s:g} s (this pod has: "
                      f"{', '.join(names)}): check network.multus and network.kvInterface")


def with_kv_host(argv: list[str], host: str) -> list[str]:
    """`argv` with `host` as the connector's `host`. P's bootstrap sidecar stays at the
    address the chart rendered (the pod IP): its URL is given, not built from `host`."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == KV_FLAG and i + 1 < len(out):
            at, prefix = i + 1, ""
        elif arg.startswith(KV_FLAG + "="):
            at, prefix = i, KV_FLAG + "="
        else:
            continue
        cfg = json.loads(out[at][len(prefix):])
        extra = cfg.setdefault("kv_connector_extra_config", {})
        port = extra.pop("bootstrap_port", None)
        if port is not None and "bootstrap_addr" not in extra:
            if not extra.get("host"):
                raise ValueError("bootstrap_port without the pod's host to reach it at")
            extra["bootstrap_addr"] = f"http://{host_port(extra['host'], int(port))}"
        extra["host"] = host
        out[at] = prefix + json.dumps(cfg, separators=(",", ":"))
        return out
    raise ValueError(f"no {KV_FLAG} in the command")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m appliance.kvhost --interface NAME -- COMMAND...",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m appliance.kvhost")
    parser.add_argument("--interface", required=True)
    parser.add_argument("--wait-s", type=float, default=30.0)
    opts = parser.parse_args(argv[:cut])
    command = argv[cut + 1:]
    try:
        host = interface_address(opts.interface, opts.wait_s)
        command = with_kv_host(command, host)
    except (LookupError, ValueError) as exc:
        print(f"appliance.kvhost: error: {exc}", file=sys.stderr)
        return 1
    print(f"appliance.kvhost: KV transfer on {opts.interface} ({host})", file=sys.stderr,
          flush=True)
    os.execvp(command[0], command)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
