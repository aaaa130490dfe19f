"""CURVE on the side channel: only holders of the cluster's key may talk to P's workers.

The whole cluster (P and D workers, the proxy) shares one Z85 CURVE secret key, read from
`side_channel_key_file`. P's ROUTER is the CURVE server with that key; every client (D's
DEALERs, the proxy's releaser) connects with the same keypair, and P's ZAP handler admits a
client only if its public key is that keypair's: completing the handshake proves the client
holds the secret. Without a ZAP handler libzmq would admit any CURVE client that merely knows
the server's public key, so the handler is started before the socket binds.

Every refused handshake is counted (`on_reject(reason)`) and logged once: a ZAP denial by the
handler, which knows the peer's address and key; a client that does not speak CURVE, or not
with our server key, by the socket monitor (libzmq reports only our own endpoint then).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("vllm.appliance.sidechannel.curve")

_KEY_CHARS = 40  # a 32-byte key in Z85
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_PROTOCOL_ERRORS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "the client does not speak CURVE",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "the client's server key is not this cluster's",
}


def generate_secret() -> str:
    """A new Z85 CURVE secret key (40 characters), for `side_channel_key_file`."""
    return zmq.curve_keypair()[1].decode("ascii")


@dataclass(frozen=True)
class CurveKey:
    secret: bytes  # Z85, 40 bytes
    public: bytes  # Z85, derived from secret

    def __repr__(self) -> str:  # never print the secret
        return f"CurveKey(public={self.public.decode('ascii')})"


def read_key(path: str | Path) -> CurveKey:
    """The key in `path` (the Z85 secret on one line); ValueError with one line if bad."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"side-channel key file {path}: {exc.strerror or exc}") from None
    lines = [line.strip() for line in data.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"side-channel key file {path} is empty")
    secret = lines[0]
    try:
        if len(lines) > 1 or len(secret) != _KEY_CHARS or len(z85.decode(secret)) != 32:
            raise ValueError
        public = zmq.curve_public(secret)
    except (ValueError, KeyError, struct.error, zmq.ZMQError):  # bad length, char, value
        raise ValueError(f"side-channel key file {path} does not hold one Z85 CURVE secret "
                         f"key ({_KEY_CHARS} characters on one line)") from None
    return CurveKey(secret, public)


def load(path: str | None) -> CurveKey | None:
    """The key named by a `side_channel_key_file` setting; None when it is unset."""
    return read_key(path) if path else None


def set_client(sock: zmq.Socket, key: CurveKey) -> None:
    """Make `sock` a CURVE client of a server holding the same key (before connect)."""
    sock.curve_serverkey = key.public
    sock.curve_publickey = key.public
    sock.curve_secretkey = key.secret


# What a client socket's monitor reports besides refusals: the link to its server is up
# (the handshake done, with or without CURVE) or gone (the server's process died, or the
# network dropped the connection; ZMQ reconnects on its own).
PEER_EVENTS = HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


def _refusal(kind: int, value: int) -> str | None:
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the producer refused our key (ZAP status {value})"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "one side speaks CURVE and the other does not"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "the producer's CURVE key is not ours"
        return f"protocol error {value:#x}"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return f"the handshake failed (errno {value})"
    return None


async def peer_event(monitor: zmq.asyncio.Socket) -> tuple[str, str]:
    """A client socket's next event of PEER_EVENTS: ("refused", why), ("up", "") or
    ("down", "")."""
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())
        kind, value = event["event"], event["value"]
        why = _refusal(kind, value)
        if why is not None:
            return "refused", why
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return "up", ""
        if kind == zmq.EVENT_DISCONNECTED:
            return "down", ""


async def handshake_failure(monitor: zmq.asyncio.Socket) -> str:
    """A client socket's monitor: waits for its first failed handshake, says why.

    Seen from a decode node (or the proxy): the producer's side channel refused us, so
    nothing we queued for it was delivered and nothing of ours can be written."""
    while True:
        kind, why = await peer_event(monitor)
        if kind == "refused":
            return why


class _Throttled:
    """At most `burst` warnings per kind every `every_s`, then one saying how many were held
    back: a client with a wrong key retries about every 100 ms, and each attempt must not
    become a log line."""

    def __init__(self, every_s: float = 10.0, burst: int = 1) -> None:
        self.every_s = every_s
        self.burst = burst
        self._window: dict[str, tuple[float, int]] = {}  # kind -> (start, lines in it)
        self._held: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        start, lines = self._window.get(kind, (-self.every_s, 0))
        if now - start >= self.every_s:
            start, lines = now, 0
        if lines >= self.burst:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._window[kind] = (start, lines + 1)
        held = self._held.pop(kind, 0)
        log.warning(msg + (f" ({held} more like it in the last {self.every_s:g} s)"
                           if held else ""), *args)


class _Authenticator(AsyncioAuthenticator):
    """ZAP handler admitting exactly one client public key: the cluster's."""

    def __init__(self, ctx: zmq.Context, public: bytes, warn: _Throttled) -> None:
        super().__init__(ctx)
        self._public = public
        self._warn = warn
        self._address = ""
        self.configure_curve_callback("*", self)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # The callback is not told the peer; requests are handled one at a time.
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self._public):
            return True
        self._warn.warning("auth", "side channel: refused CURVE client at %s: its key %s is not "
                      "this cluster's", self._address, key.decode("ascii", "replace"))
        return False  # counted from the monitor's HANDSHAKE_FAILED_AUTH event


class CurveServer:
    """A CURVE server socket's ZAP handler and handshake monitor; set up before bind."""

    def __init__(self, sock: zmq.asyncio.Socket, key: CurveKey,
                 on_reject: Callable[[str], None]) -> None:
        self._sock = sock
        self._on_reject = on_reject
        # One socket's refusals: a few lines in full, then throttled.
        self._warn = _Throttled(burst=10)
        self._auth = _Authenticator(sock.context, key.public, self._warn)
        self._auth.start()
        sock.curve_secretkey = key.secret
        sock.curve_publickey = key.public
        sock.curve_server = True
        self._monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            kind, value = event["event"], event["value"]
            endpoint = event["endpoint"].decode("utf-8", "replace")
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._on_reject("auth")
                if value != 400:  # 400: our handler's denial, logged there with the peer
                    self._warn.warning("zap", "side channel %s: refused a client: ZAP status %d",
                                  endpoint, value)
                continue
            self._on_reject("handshake")
            why = (_PROTOCOL_ERRORS.get(value, f"protocol error {value:#x}")
                   if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   else f"the connection ended mid-handshake (errno {value})")
            self._warn.warning("handshake", "side channel %s: refused a handshake: %s", endpoint,
                          why)

    def close(self) -> None:
        self._task.cancel()
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is closed already
        self._monitor.close(0)
        self._auth.stop()
