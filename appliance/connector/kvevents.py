"""KV-cache events under the cluster's key: vLLM's ZMQ publisher, its sockets CURVE servers.

Each P and D publishes its KV events (every block it caches, by hash, with the prompt's
token ids) for the proxy's prefix index. vLLM's publisher binds its PUB and replay ROUTER
without any key: on a LAN (compose's host networking, a node's pod IP) anyone could read
every cached prompt. With `side_channel_key_file` set, the connector's scheduler side (in
the EngineCore process, built before vLLM's scheduler builds its publisher) installs this
publisher for vLLM's "zmq" kind: the same sockets as vLLM's, each a CURVE server with the
cluster's key, and a ZAP handler on a context of its own that admits only clients holding
that key (appliance.sidechannel.curve: the side channel's scheme). The proxy subscribes
with the same key (appliance.proxy.prefix.events); a subscriber without it completes no
handshake and reads nothing.
"""

from __future__ import annotations

import hmac
import logging

import zmq
from vllm.distributed.kv_events import EventPublisherFactory, ZmqEventPublisher
from zmq.auth.thread import ThreadAuthenticator

from appliance.sidechannel.curve import CurveKey

log = logging.getLogger("vllm.appliance.kvevents")


class _OneKey:
    """ZAP: admit exactly the cluster's public key."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.public):
            return True
        log.warning("KV events: refused a subscriber whose key %s is not this cluster's",
                    key.decode("ascii", "replace"))
        return False


def publisher_class(key: CurveKey) -> type[ZmqEventPublisher]:
    """vLLM's ZMQ publisher whose sockets are CURVE servers with `key`."""

    class CurveEventPublisher(ZmqEventPublisher):
        def _socket_setup(self) -> None:
            # A context of its own: its ZAP handler must not meet another one in this
            # process (libzmq allows one per context).
            self._ctx = zmq.Context()
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _OneKey(key.public))
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(self._hwm)
            _serve(self._pub, key)
            assert self._endpoint is not None
            if self._is_bind_endpoint(self._endpoint):
                self._endpoint = self._bind(self._pub, self._endpoint)
            else:  # vLLM connects a PUB to a given host: a CURVE server all the same
                self._pub.connect(self._endpoint)
            if self._replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                _serve(self._replay, key)
                self._replay_endpoint = self._bind(self._replay, self._replay_endpoint)
            log.info("KV events on %s (replay %s) under the cluster's CURVE key",
                     self._endpoint, self._replay_endpoint)

        def shutdown(self) -> None:
            super().shutdown()
            self._auth.stop()

    return CurveEventPublisher


def _serve(sock: zmq.Socket, key: CurveKey) -> None:
    sock.curve_secretkey = key.secret
    sock.curve_publickey = key.public
    sock.curve_server = True


def install(key: CurveKey) -> None:
    """vLLM's "zmq" publisher kind becomes the keyed one, in this process (the config's
    `publisher` admits only vLLM's names, so the kind keeps its name)."""
    EventPublisherFactory._registry["zmq"] = publisher_class(key)
