"""A private network of Linux network namespaces for multi-host tests.

``with Lab() as lab: h = lab.add_host("w1")`` makes a namespace per "host", each with one
interface (``eth0``, its own address) plugged into a bridge in a "switch" namespace of the
lab's own. Nothing is added to the caller's namespace and no traffic leaves the lab: every
host reaches only the other hosts (and its own loopback). ``lab.cut(h)`` / ``lab.mend(h)``
take a host's link down and up (a partition); processes start inside a host with
``h.wrap`` (``ip netns exec NS``) and the calling thread enters one with ``h.entered()``.
Closing the lab deletes every namespace it made, also after a failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    name = f"rlfprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    _ip("netns", "del", name)
    return None


@dataclass
class Host:
    name: str  # the namespace's name
    ip: str
    port_link: str  # its switch port, in the lab's switch namespace

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the calling thread inside this host (threads it starts inherit it)."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        there = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY)
        try:
            _setns(there)
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(there)
            os.close(home)


class Lab:
    def __init__(self, subnet: str = "10.213.7") -> None:
        self.tag = secrets.token_hex(3)
        self.subnet = subnet
        self.switch = f"rlf{self.tag}sw"
        self.hosts: list[Host] = []
        self._made: list[str] = []
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        try:
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except RuntimeError:
            self.close()
            raise

    def add_host(self, role: str) -> Host:
        n = len(self.hosts) + 1
        host = Host(f"rlf{self.tag}{role}", f"{self.subnet}.{n}", f"p{n}")
        _ip("netns", "add", host.name)
        self._made.append(host.name)  # deleted by close() even if the rest fails
        _ip("-n", self.switch, "link", "add", host.port_link, "type", "veth", "peer", "name",
            "eth0", "netns", host.name)
        _ip("-n", self.switch, "link", "set", host.port_link, "master", "br0", "up")
        _ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.name, "link", "set", "eth0", "up")
        _ip("-n", host.name, "link", "set", "lo", "up")
        self.hosts.append(host)
        return host

    def cut(self, host: Host) -> None:
        """Take the host's link down: its packets go nowhere, no reset is sent."""
        _ip("-n", self.switch, "link", "set", host.port_link, "down")

    def mend(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.port_link, "up")

    def close(self) -> None:
        errors = []
        for name in reversed(self._made):
            try:
                _ip("netns", "del", name)
            except RuntimeError as e:
                errors.append(str(e))
        self._made.clear()
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
