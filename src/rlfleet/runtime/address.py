"""Which address a server tells others to use, apart from the one it binds.

A server binds ``--host`` (127.0.0.1 by default: nothing is exposed unless asked) and
advertises, in discovery and in its ready line:

1. ``--advertise-host`` when given (NAT, a load balancer, a DNS name);
2. else the bind address itself, when it is a specific address;
3. else (bound to all interfaces) ``$VLLM_HOST_IP``, else ``$POD_IP``;
4. else the address of the interface that routes to the discovery store (or, for a store
   without a network peer, to the default route); 127.0.0.1 when there is no route at all.

Step 4 asks the kernel for a route with a connected UDP socket: no packet is sent.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import urllib.parse

from rlfleet.runtime.discovery import default_discovery_url, open_discovery

log = logging.getLogger("rlfleet.address")

HOST_ENV_VARS = ("VLLM_HOST_IP", "POD_IP")
_ANY = ("", "0.0.0.0", "::", "[::]")
_NO_PEER = ("192.0.2.1", 9)  # TEST-NET-1: used only to ask for the default route


def is_wildcard(host: str) -> bool:
    return host in _ANY


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def route_source(host: str, port: int) -> str | None:
    """The local address the kernel would use to reach host:port (None without a route)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(addr)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def discovery_peer(url: str | None) -> tuple[str, int] | None:
    """The first network endpoint of a discovery URL (``etcd://h:p,...``); None for files."""
    url = url or default_discovery_url()
    if not url or not url.lower().startswith("etcd://"):
        return None
    d = open_discovery(url)  # contacts nothing
    return d.endpoints[0]  # type: ignore[attr-defined]


def advertised_host(bind: str, explicit: str | None = None,
                    toward: tuple[str, int] | None = None) -> str:
    """The host other machines should use to reach a server bound to ``bind``."""
    if explicit:
        return explicit
    if not is_wildcard(bind):
        return bind
    for var in HOST_ENV_VARS:
        if os.environ.get(var, "").strip():
            return os.environ[var].strip()
    for peer in ([toward] if toward else []) + [_NO_PEER]:
        found = route_source(*peer)
        if found:
            return found
    return "127.0.0.1"


def http_url(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def warn_if_unreachable(what: str, host: str, discovery_url: str | None) -> None:
    """A loopback address advertised through a store on another host reaches no one."""
    peer = discovery_peer(discovery_url)
    if peer and is_loopback(host) and not is_loopback(peer[0]):
        log.warning("%s advertises %s through discovery at %s: other hosts cannot reach it; "
                    "bind with --host 0.0.0.0 (or a routable address) or set --advertise-host",
                    what, host, peer[0])


def local_address_toward(url: str) -> str | None:
    """This machine's address on the route to `url`'s host: what a trainer advertises as
    the master address of a weight-update group its workers join."""
    u = urllib.parse.urlsplit(url)
    return route_source(u.hostname, u.port or 80) if u.hostname else None
