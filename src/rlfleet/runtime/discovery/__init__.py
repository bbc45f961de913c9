"""Discovery plane: workers register leased entries, the frontend lists and watches them.

Stores, chosen by URL (see :func:`open_discovery`), one module each:

* ``file:///path/to/dir`` (:mod:`.file`) - one JSON file per entry, single host (the default);
* ``etcd://host:port[,host:port...]`` (:mod:`.etcd`) - etcd v3, multi-host.

What they share (entries, keys, registrations, the watch loop, skipped-entry reports) is in
:mod:`.base`.
"""

from __future__ import annotations

import os
import urllib.parse

from rlfleet.runtime.discovery.base import (
    Discovery,
    DiscoveryError,
    Entries,
    Entry,
    Listing,
    Registration,
    Skipped,
    entry_key,
    new_instance_id,
)
from rlfleet.runtime.discovery.etcd import ETCD_DEFAULT_PORT, EtcdDiscovery
from rlfleet.runtime.discovery.file import FileDiscovery, default_file_dir

__all__ = [
    "Discovery",
    "DiscoveryError",
    "Entries",
    "Entry",
    "EtcdDiscovery",
    "FileDiscovery",
    "Listing",
    "Registration",
    "Skipped",
    "default_discovery_url",
    "default_file_dir",
    "entry_key",
    "new_instance_id",
    "open_discovery",
]

ENV_VAR = "RLFLEET_DISCOVERY"


def default_discovery_url() -> str | None:
    """``$RLFLEET_DISCOVERY``, else ``$ETCD_ENDPOINTS`` (Dynamo's: ``http://h:2379,...`` or
    ``h:2379,...``) as an ``etcd://`` URL, else None (the per-user directory)."""
    url = os.environ.get(ENV_VAR, "").strip()
    if url:
        return url
    endpoints = [e.strip() for e in os.environ.get("ETCD_ENDPOINTS", "").split(",") if e.strip()]
    if not endpoints:
        return None
    hosts = []
    for e in endpoints:
        parts = urllib.parse.urlsplit(e if "://" in e else f"http://{e}")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"bad ETCD_ENDPOINTS entry {e!r}: expected http://host:port")
        hosts.append(parts.netloc)
    return "etcd://" + ",".join(hosts)


def _parse_etcd_hosts(netloc: str, url: str) -> list[tuple[str, int]]:
    endpoints = []
    for part in netloc.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):  # [ipv6]:port
            host, _, rest = part[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port_text = part.rpartition(":") if ":" in part else (part, "", "")
        try:
            port = int(port_text) if port_text else ETCD_DEFAULT_PORT
        except ValueError:
            raise ValueError(f"bad port in discovery URL {url!r}: {part!r}") from None
        if not host or not 0 < port < 65536:
            raise ValueError(f"bad host:port in discovery URL {url!r}: {part!r}")
        endpoints.append((host, port))
    if not endpoints:
        raise ValueError(f"discovery URL {url!r} names no etcd host")
    return endpoints


def open_discovery(url: str | None = None) -> Discovery:
    """Open the store for ``url``, else :func:`default_discovery_url`, else the per-user
    directory.

    Accepted: ``file:///abs/dir`` and ``etcd://host:port[,host:port...]``. Nothing is
    contacted until the first operation.
    """
    url = url or default_discovery_url()
    if url is None:
        return FileDiscovery(default_file_dir())
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        path = urllib.parse.unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise ValueError(f"bad discovery URL {url!r}: expected file:///absolute/dir")
        return FileDiscovery(path)
    if scheme == "etcd":
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"bad discovery URL {url!r}: expected etcd://host:port[,host:port]")
        return EtcdDiscovery(url, _parse_etcd_hosts(parts.netloc, url))
    raise ValueError(f"unsupported discovery URL {url!r}: accepted schemes are "
                     "file:// (file:///path/to/dir) and etcd:// (etcd://host:port[,host:port])")
