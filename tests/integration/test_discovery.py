"""Discovery plane: the same tests against the file backend and a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlfleet.runtime.discovery import (
    Discovery,
    DiscoveryError,
    EtcdDiscovery,
    FileDiscovery,
    Registration,
    new_instance_id,
    open_discovery,
)
from rlfleet.runtime.discovery.base import entry_key

try:
    from rlfleet.testing.etcd import discovery_entry, free_port, run_etcd
except ImportError:  # run as plain `pytest` (repo root not on sys.path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from rlfleet.testing.etcd import discovery_entry, free_port, run_etcd

Entries = list[dict[str, Any]]


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def etcd_url() -> Iterator[str]:
    with run_etcd() as url:
        yield url


@pytest.fixture(params=["file", "etcd"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return (tmp_path / "discovery").as_uri()
    return request.getfixturevalue("etcd_url")


@pytest.fixture
async def disco(store_url: str) -> AsyncIterator[Discovery]:
    d = open_discovery(store_url)
    try:
        yield d
    finally:
        await d.close()


def key_of(e: dict[str, Any]) -> str:
    return f"{e['namespace']}/{e['component']}/{e['endpoint']}/{e['instance_id']}"


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float,
                     what: str) -> float:
    """Poll ``check`` until true; returns the seconds it took."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def next_matching(watch: AsyncIterator[Entries], pred: Callable[[Entries], bool],
                        timeout: float) -> Entries:
    """The next yielded list satisfying ``pred``."""
    async def loop() -> Entries:
        async for entries in watch:
            if pred(entries):
                return entries
        raise AssertionError("watch ended")
    return await asyncio.wait_for(loop(), timeout)


_REGISTER_AND_HANG = """
import asyncio, json, sys
from rlfleet.runtime.discovery import open_discovery
async def main():
    d = open_discovery(sys.argv[1])
    await d.register(json.loads(sys.argv[2]), ttl=float(sys.argv[3]))
    print("ready", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@contextlib.contextmanager
def registering_process(url: str, entry: dict[str, Any], ttl: float) -> Iterator[
        subprocess.Popen[str]]:
    """A child process that registers ``entry`` and then hangs; always killed."""
    import json

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _REGISTER_AND_HANG, url, json.dumps(entry),
                             str(ttl)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def stop_keepalive(reg: Registration) -> None:
    """Stop what keeps `reg`'s lease alive: its own task (file), or the lease it shares
    with its client's other registrations of its TTL (etcd)."""
    task = getattr(reg, "_lease", reg)._task
    assert task is not None
    task.cancel()


# ---------------------------------------------------------------- both backends


async def test_register_list_filter(disco: Discovery, ns: str) -> None:
    a = discovery_entry(ns, "worker", "generate", 3, addr="http://127.0.0.1:1")
    b = discovery_entry(ns, "worker", "generate", 1, addr="http://127.0.0.1:2")
    c = discovery_entry(ns, "worker", "load_weights", 2)
    d = discovery_entry(ns, "router", "generate", 4)
    regs = [await disco.register(e, ttl=5) for e in (a, b, c, d)]
    assert regs[0].key == key_of(a)

    everything = await disco.list(ns)
    assert everything == sorted([a, b, c, d], key=key_of)
    assert await disco.list(ns, "worker") == sorted([a, b, c], key=key_of)
    assert await disco.list(ns, "worker", "generate") == [b, a]  # key order: ".../1" < ".../3"
    assert await disco.list(namespace=None, component="router") == [d]
    assert await disco.list(ns, endpoint="load_weights") == [c]
    assert await disco.list(ns + "-other") == []
    assert [e for e in await disco.list() if e["namespace"] == ns] == everything
    for reg in regs:
        await reg.close()
    assert await disco.list(ns) == []


async def test_invalid_entries(disco: Discovery, ns: str) -> None:
    with pytest.raises(ValueError, match="instance_id"):
        await disco.register({"namespace": ns, "component": "w", "endpoint": "e"})
    with pytest.raises(ValueError, match="instance_id"):
        await disco.register(discovery_entry(ns, instance_id=1 << 64))
    with pytest.raises(ValueError, match="component"):
        await disco.register(discovery_entry(ns, component="a/b"))
    with pytest.raises(ValueError, match="JSON"):
        await disco.register(discovery_entry(ns, blob=object()))
    assert await disco.list(ns) == []


async def test_update(disco: Discovery, ns: str) -> None:
    entry = discovery_entry(ns, load=0)
    reg = await disco.register(entry, ttl=5)
    await reg.update({**entry, "load": 7})
    assert await disco.list(ns) == [{**entry, "load": 7}]
    with pytest.raises(ValueError, match="key"):
        await reg.update({**entry, "endpoint": "other"})
    await reg.close()


async def test_clean_deregistration(disco: Discovery, ns: str) -> None:
    keep = await disco.register(discovery_entry(ns, instance_id=1), ttl=5)
    gone = await disco.register(discovery_entry(ns, instance_id=2), ttl=5)
    await gone.close()
    assert [e["instance_id"] for e in await disco.list(ns)] == [1]  # immediately, no expiry
    await gone.close()  # idempotent
    with pytest.raises(DiscoveryError):
        await gone.update(discovery_entry(ns, instance_id=2))
    await disco.close()  # closing the Discovery deregisters what it registered
    assert keep._closed
    async with open_discovery(disco.url) as fresh:
        assert await fresh.list(ns) == []


async def test_keepalive_outlives_ttl(disco: Discovery, ns: str) -> None:
    entry = discovery_entry(ns)
    reg = await disco.register(entry, ttl=1)
    await asyncio.sleep(2.5)  # > etcd's minimum lease (2 s) and the file ttl
    assert await disco.list(ns) == [entry]
    await reg.close()


async def test_expiry_after_owner_sigkill(store_url: str, disco: Discovery, ns: str) -> None:
    entry = discovery_entry(ns, component="crashy")
    with registering_process(store_url, entry, ttl=1) as proc:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 15)
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else ""
        assert await disco.list(ns) == [entry]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)

        async def gone() -> bool:
            return await disco.list(ns) == []
        took = await eventually(gone, 6, "the killed owner's entry to expire")
        assert took < 4.5


async def test_lost_lease_is_reregistered(disco: Discovery, ns: str) -> None:
    entry = discovery_entry(ns)
    reg = await disco.register(entry, ttl=1.5)
    # lose the lease behind the owner's back
    if isinstance(disco, FileDiscovery):
        disco._path(reg.key).unlink()
    else:
        assert isinstance(disco, EtcdDiscovery)
        lease_id = reg._lease_id  # type: ignore[attr-defined]
        await disco._call("revoke", lambda c: c.revoke_lease(lease_id))
    assert await disco.list(ns) == []

    async def back() -> bool:
        return await disco.list(ns) == [entry]
    await eventually(back, 5, "re-registration after the lease was lost")
    await reg.close()


async def test_watch_add_change_remove_expiry(disco: Discovery, ns: str) -> None:
    def ids(entries: Entries) -> list[int]:
        return [e["instance_id"] for e in entries]

    other = await disco.register(discovery_entry(ns + "-x"), ttl=5)  # outside the watched namespace
    async with contextlib.aclosing(disco.watch(ns, interval=0.1)) as watch:
        assert await next_matching(watch, lambda _: True, 5) == []  # first yield: immediately

        a = discovery_entry(ns, instance_id=10, load=0)
        reg_a = await disco.register(a, ttl=5)
        assert await next_matching(watch, lambda es: es != [], 5) == [a]

        await reg_a.update({**a, "load": 1})
        assert await next_matching(watch, lambda es: es[0]["load"] == 1, 5) == [{**a, "load": 1}]

        b = discovery_entry(ns, instance_id=20)
        reg_b = await disco.register(b, ttl=1)
        assert ids(await next_matching(watch, lambda es: len(es) == 2, 5)) == [10, 20]

        stop_keepalive(reg_b)  # the owner stops refreshing, as if hung
        start = time.monotonic()
        assert ids(await next_matching(watch, lambda es: len(es) == 1, 6)) == [10]
        assert time.monotonic() - start < 4.5

        await reg_a.close()
        assert await next_matching(watch, lambda _: True, 5) == []
        await reg_b.close()
    await other.close()


async def test_watch_ends_when_discovery_closed(disco: Discovery, ns: str) -> None:
    watch = disco.watch(ns, interval=0.1)
    assert await anext(watch) == []
    await disco.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(watch), 5)


# ---------------------------------------------------------------- selection


def test_open_discovery_selection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLFLEET_DISCOVERY", raising=False)

    d = open_discovery(f"file://{tmp_path}/a")
    assert isinstance(d, FileDiscovery) and d.directory == tmp_path / "a"
    assert d.url == (tmp_path / "a").as_uri()

    e = open_discovery("etcd://127.0.0.1:2381")
    assert isinstance(e, EtcdDiscovery) and e.endpoints == [("127.0.0.1", 2381)]
    assert e.url == "etcd://127.0.0.1:2381"
    multi = open_discovery("etcd://h1:1,h2,[::1]:3")
    assert isinstance(multi, EtcdDiscovery)
    assert multi.endpoints == [("h1", 1), ("h2", 2379), ("::1", 3)]

    monkeypatch.setenv("RLFLEET_DISCOVERY", f"file://{tmp_path}/from-env")
    env = open_discovery()
    assert isinstance(env, FileDiscovery) and env.directory == tmp_path / "from-env"
    explicit = open_discovery(f"file://{tmp_path}/b")  # an explicit URL beats the env var
    assert isinstance(explicit, FileDiscovery) and explicit.directory == tmp_path / "b"

    monkeypatch.delenv("RLFLEET_DISCOVERY")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    default = open_discovery()
    assert isinstance(default, FileDiscovery)
    assert default.directory == tmp_path / "rlfleet" / "discovery"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    fallback = open_discovery()
    assert isinstance(fallback, FileDiscovery)
    assert fallback.directory == Path(f"/tmp/rlfleet-{os.getuid()}/discovery")

    for unknown in ("redis://x:1", "consul://h", "/just/a/path"):
        with pytest.raises(ValueError, match="accepted schemes") as err:
            open_discovery(unknown)
        assert "file://" in str(err.value) and "etcd://" in str(err.value)
    for malformed in ("file://otherhost/x", "file:relative", "etcd://h:notaport", "etcd://"):
        with pytest.raises(ValueError):
            open_discovery(malformed)


async def test_file_default_dir_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          ns: str) -> None:
    monkeypatch.delenv("RLFLEET_DISCOVERY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    d = open_discovery()
    entry = discovery_entry(ns)
    reg = await d.register(entry, ttl=5)
    files = list((tmp_path / "rlfleet" / "discovery").iterdir())
    assert len(files) == 1 and "/" not in files[0].name
    assert await d.list(ns) == [entry]
    await reg.close()
    await d.close()


# ---------------------------------------------------------------- etcd failures


async def test_etcd_unreachable_raises_quickly(ns: str) -> None:
    d = open_discovery(f"etcd://127.0.0.1:{free_port()}")  # nothing listens there
    start = time.monotonic()
    with pytest.raises(DiscoveryError, match="127.0.0.1"):
        await d.list(ns)
    with pytest.raises(DiscoveryError):
        await d.register(discovery_entry(ns), ttl=2)
    assert time.monotonic() - start < 8
    # a watch neither raises nor yields while the store is down
    watch = d.watch(ns, interval=0.1)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(watch), 1.0)
    await watch.aclose()
    await d.close()


async def test_etcd_several_endpoints_first_reachable(etcd_url: str, ns: str) -> None:
    live = etcd_url.removeprefix("etcd://")
    d = open_discovery(f"etcd://127.0.0.1:{free_port()},{live}")
    assert isinstance(d, EtcdDiscovery)
    try:
        entry = discovery_entry(ns)
        reg = await d.register(entry, ttl=5)
        assert d.endpoint == live
        assert await d.list(ns) == [entry]
        await reg.close()
    finally:
        await d.close()


async def test_etcd_outage_recovery(tmp_path: Path, ns: str) -> None:
    """etcd dies and comes back empty: the owner re-registers, the watch yields again."""
    port = free_port()
    with run_etcd(client_port=port, data_dir=tmp_path / "one") as url:
        d = open_discovery(url)
        entry = discovery_entry(ns, load=0)
        reg = await d.register(entry, ttl=2)
        watch = d.watch(ns, interval=0.1)
        assert await next_matching(watch, lambda _: True, 5) == [entry]
    # down now
    with pytest.raises(DiscoveryError):
        await d.list(ns)
    with pytest.raises(DiscoveryError):
        await reg.update({**entry, "load": 5})  # published once the store is back
    with run_etcd(client_port=port, data_dir=tmp_path / "two"):
        try:
            got = await next_matching(watch, lambda es: es != [] and es[0]["load"] == 5, 10)
            assert got == [{**entry, "load": 5}]
            assert await d.list(ns) == got
        finally:
            await watch.aclose()
            await d.close()


async def test_registration_type(disco: Discovery, ns: str) -> None:
    reg = await disco.register(discovery_entry(ns), ttl=5)
    assert isinstance(reg, Registration)
    await reg.close()
    assert 0 < new_instance_id() < 1 << 64


# ---------------------------------------------------------------- bad entries (issue 10, finding 1)


def _garbage(store: Path, ns: str) -> dict[str, str]:
    """Drop unreadable files into a file store; returns {file name: expected error}."""
    store.mkdir(parents=True, exist_ok=True)
    bad_utf8 = f"{ns}%2Fbackend%2Fgenerate%2F77.json"
    (store / bad_utf8).write_bytes(b'{"entry": "\xff\xfe\xfa"}')
    os.mkfifo(store / "fifo.json")  # opening it for reading would block until a writer comes
    (store / "notarecord.json").write_text('{"hello": 1}')
    return {bad_utf8: "UTF-8", "fifo.json": "regular file", "notarecord.json": "not a discovery"}


async def test_file_store_skips_and_reports_unreadable_files(tmp_path: Path, ns: str) -> None:
    store = tmp_path / "d"
    d = open_discovery(store.as_uri())
    try:
        good = discovery_entry(ns)
        reg = await d.register(good, ttl=5)
        expected = _garbage(store, ns)
        # a FIFO would have blocked here (and the event loop with it) before the fix
        listing = await asyncio.wait_for(d.listing(), 5)
        assert [e for e in listing.entries if e["namespace"] == ns] == [good]
        got = {Path(s.where).name: s.error for s in listing.skipped}
        assert got.keys() == expected.keys()
        for name, words in expected.items():
            assert words in got[name], (name, got[name])
        # the key of a readable name is reported; a namespace filter leaves out other namespaces
        assert {s.key for s in listing.skipped} >= {f"{ns}/backend/generate/77"}
        filtered = await d.listing(ns + "-other")
        assert {Path(s.where).name for s in filtered.skipped} == {"fifo.json", "notarecord.json"}
        assert await d.list(ns) == [good]
        await reg.close()
    finally:
        await d.close()


async def test_etcd_store_skips_and_reports_bad_values(etcd_url: str, ns: str) -> None:
    d = open_discovery(etcd_url)
    assert isinstance(d, EtcdDiscovery)
    try:
        good = discovery_entry(ns)
        reg = await d.register(good, ttl=5)
        bad_utf8 = d._etcd_key(f"{ns}/backend/generate/5")
        not_entry = d._etcd_key(f"{ns}/backend/generate/6")
        await d._call("put", lambda c: c.put(bad_utf8, b"\xff\xfe"))
        await d._call("put", lambda c: c.put(not_entry, b'{"namespace": 3}'))
        listing = await d.listing(ns)
        assert listing.entries == [good]
        errors = {s.key: s.error for s in listing.skipped}
        assert "UTF-8" in errors[f"{ns}/backend/generate/5"]
        assert "namespace" in errors[f"{ns}/backend/generate/6"]
        await d._call("delete", lambda c: c.delete_prefix(d._etcd_key(f"{ns}/")))
        await reg.close()
    finally:
        await d.close()


async def test_watch_keeps_following_after_a_bad_file(tmp_path: Path, ns: str) -> None:
    """Before the fix one non-UTF-8 file ended the watch for good (membership froze)."""
    store = tmp_path / "d"
    d = open_discovery(store.as_uri())
    try:
        async with contextlib.aclosing(d.watch(ns, interval=0.05)) as watch:
            assert await next_matching(watch, lambda _: True, 5) == []
            _garbage(store, ns)
            late = discovery_entry(ns)
            reg = await d.register(late, ttl=5)
            assert await next_matching(watch, lambda es: es != [], 5) == [late]
            await reg.close()
            assert await next_matching(watch, lambda es: es == [], 5) == []
    finally:
        await d.close()


async def test_file_store_never_blocks_the_event_loop(tmp_path: Path, ns: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow filesystem (here: a listdir that takes 0.6 s) must not stall the loop."""
    d = open_discovery((tmp_path / "d").as_uri())
    try:
        reg = await d.register(discovery_entry(ns), ttl=5)
        real_listdir = os.listdir

        def slow_listdir(path):
            time.sleep(0.6)
            return real_listdir(path)

        monkeypatch.setattr(os, "listdir", slow_listdir)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.create_task(ticker())
        try:
            assert len(await d.list(ns)) == 1
        finally:
            t.cancel()
        assert ticks >= 5, f"the event loop was blocked during the scan ({ticks} ticks)"
        monkeypatch.undo()
        await reg.close()
    finally:
        await d.close()


@pytest.mark.parametrize("how", ["renamed", "deleted"])
async def test_vanishing_directory_keeps_its_entries(tmp_path: Path, ns: str, how: str) -> None:
    """The directory gone for 3 s: readers keep every entry whose lease still runs."""
    store = tmp_path / "d"
    owner = open_discovery(store.as_uri())
    reader = open_discovery(store.as_uri())
    try:
        entry = discovery_entry(ns)
        reg = await owner.register(entry, ttl=6)  # keep-alive every 2 s recreates the dir
        assert await reader.list(ns) == [entry]
        aside = tmp_path / "aside"
        if how == "renamed":
            store.rename(aside)
        else:
            remove_while_written(store)
        seen = []
        end = time.monotonic() + 3
        while time.monotonic() < end:
            seen.append(await reader.list(ns))
            if how == "renamed" and store.exists():  # an owner recreated it: the old one goes
                shutil.rmtree(aside, ignore_errors=True)
            await asyncio.sleep(0.1)
        assert all(s == [entry] for s in seen), [len(s) for s in seen]
        if how == "renamed" and aside.exists():
            aside.rename(store)
        await eventually(lambda: _has(reader, ns, entry), 5, "the entry back from its file")
        await reg.close()
        assert await reader.list(ns) == []  # a deregistration still ends it at once
    finally:
        await owner.close()
        await reader.close()


async def test_a_file_removed_without_a_goodbye_keeps_its_entry_until_its_lease_ends(
        tmp_path: Path, ns: str) -> None:
    """A directory emptied one file at a time (rmtree's order) looked, to a watch that read
    between two unlinks, like its owners deregistering: the frontend's pool went empty for
    a tick (a 404 under load on CI). An owner's close is a goodbye and ends its entry at
    once; a file gone without one keeps its entry until the owner rewrites it or its lease
    ends."""
    store = tmp_path / "d"
    owner, reader = open_discovery(store.as_uri()), open_discovery(store.as_uri())
    kept = [discovery_entry(ns, i=i) for i in range(3)]
    seen: list[list[int]] = []
    try:
        regs = [await owner.register(e, ttl=6) for e in kept[:2]]  # keep-alive every 2 s
        lapsing = await owner.register(kept[2], ttl=2)
        lapsing._task.cancel()  # as if its owner had stopped: its lease ends in 2 s

        async def follow() -> None:
            async with contextlib.aclosing(reader.watch(ns, interval=0.05)) as it:
                async for entries in it:
                    seen.append(sorted(e["i"] for e in entries))
        watching = asyncio.create_task(follow())
        await eventually(lambda: _now(seen, [0, 1, 2]), 5, "the watch sees the three")
        removed_at = time.monotonic()
        for e in (kept[2], kept[0]):
            os.unlink(owner._path(entry_key(e)))  # type: ignore[attr-defined]
            await asyncio.sleep(0.3)  # several ticks of the watch in between
        assert seen[-1] == [0, 1, 2] and all(len(s) == 3 for s in seen), seen
        assert sorted(e["i"] for e in await reader.list(ns)) == [0, 1, 2]
        await eventually(lambda: _now(seen, [0, 1]), 4, "the lapsed lease ends its entry")
        assert time.monotonic() - removed_at > 1.0  # at its lease's end, not at the unlink
        assert [0, 1] in seen and all(0 in s for s in seen), seen  # never lost
        await regs[1].close()  # a goodbye: gone at once, from the watch and a listing
        assert [e["i"] for e in await reader.list(ns)] == [0]
        # at once, not at its lease's end: renewed at most 2 s before the close, its 6 s lease
        # could not end within 3 s (a loaded box's watch may take more than a second)
        await eventually(lambda: _now(seen, [0]), 3, "the watch drops the closed entry")
        await eventually(lambda: _has(reader, ns, kept[0]), 5, "its owner wrote it again")
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    finally:
        await owner.close()
        await reader.close()


async def _now(seen: list[list[int]], want: list[int]) -> bool:
    return bool(seen) and seen[-1] == want


def remove_while_written(path: Path) -> None:
    """Remove the directory `path` while workers write into it: a file one adds between
    rmtree's listing and its rmdir fails it with ENOTEMPTY; go again until it is gone once."""
    for _ in range(100):
        try:
            shutil.rmtree(path)
            return
        except OSError as e:
            if e.errno == errno.ENOENT:
                return
            if e.errno != errno.ENOTEMPTY:
                raise
    raise AssertionError(f"{path} kept being written into: it could not be removed")


async def _has(d: Discovery, ns: str, entry: dict[str, Any]) -> bool:
    """Whether `d` lists `entry` and its file is back (the directory may not be yet: the
    owner's next keep-alive recreates it)."""
    if await d.list(ns) != [entry]:
        return False
    try:
        return any(p.suffix == ".json" for p in Path(d.directory).iterdir())  # type: ignore[attr-defined]
    except FileNotFoundError:
        return False


async def test_rl_listener_lists_the_rest_and_reports_the_bad_entry(tmp_path: Path,
                                                                    ns: str) -> None:
    """An entry failing the listing schema made the whole GET /v1/rl/workers a 500."""
    import httpx

    from rlfleet.frontend.rl import rl_app

    store = tmp_path / "d"
    d = open_discovery(store.as_uri())
    good = discovery_entry(ns, "backend", "rl", 1, transport={"http": "http://127.0.0.1:9"},
                      request_plane_url=f"dyn://{ns}.backend.rl", model="m")
    bad = discovery_entry(ns, "backend", "rl", 2, transport={"http": "x", "tcp": "y"},
                     request_plane_url=f"dyn://{ns}.backend.rl", model="m")
    regs = [await d.register(e, ttl=5) for e in (good, bad)]
    _garbage(store, ns)
    try:
        app = rl_app(d, ns)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://listener") as http:
            r = await http.get("/v1/rl/workers")
        assert r.status_code == 200, r.text
        body = r.json()
        assert [w["instance_id"] for w in body["workers"]] == [1]
        assert "system server" in body["workers"][0]["error"]
        by_key = {s.get("key"): s for s in body["skipped"]}
        assert "transport" in by_key[f"{ns}/backend/rl/2"]["error"]
        assert any("regular file" in s["error"] for s in body["skipped"])  # the FIFO
        from rlfleet.protocol.rl import RlWorkers

        RlWorkers.model_validate(body)  # the body keeps to the protocol schema
    finally:
        for reg in regs:
            await reg.close()
        await d.close()


def test_frontend_survives_bad_entries_and_a_vanishing_directory(tmp_path: Path) -> None:
    """A mocker fleet on the file store: garbage in the directory neither freezes the
    frontend's membership nor breaks the RL listing, and the directory gone for 3 s gives
    no model_not_found."""
    import threading

    import httpx

    from rlfleet.testing.fleet import LocalFleet
    from tests.fleets import wait_for_workers

    flags = ("--served-model-name", "mock", "--enable-rl", "--system-port", "0")
    with LocalFleet(tmp_path, lease_ttl=6) as fleet:
        fleet.start_frontend(enable_rl=True)
        fleet.start_worker(*flags, kind="mocker")
        wait_for_workers(fleet.url, "mock", 1)
        store = Path(fleet.discovery.removeprefix("file://"))
        _garbage(store, fleet.namespace)
        fleet.start_worker(*flags, kind="mocker")
        wait_for_workers(fleet.url, "mock", 2, timeout=10)  # membership still followed
        r = httpx.get(f"{fleet.rl_url}/v1/rl/workers", timeout=30)
        assert r.status_code == 200 and len(r.json()["workers"]) == 2, r.text
        assert {Path(s["where"]).name for s in r.json()["skipped"]} >= {"fifo.json"}

        statuses: list[int] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                statuses.append(httpx.post(f"{fleet.url}/v1/completions", timeout=30, json={
                    "model": "mock", "prompt": [1, 2], "max_tokens": 2}).status_code)
                time.sleep(0.05)

        t = threading.Thread(target=load)
        t.start()
        try:
            time.sleep(0.3)
            remove_while_written(store)  # the workers recreate it at their next keep-alive
            time.sleep(3)
        finally:
            stop.set()
            t.join()
        assert statuses and set(statuses) == {200}, statuses
        wait_for_workers(fleet.url, "mock", 2, timeout=10)


# ---------------------------------------------------------------- what a worker publishes

#: the keys of a worker's entry, in the order the worker writes them (discovery v1)
WORKER_ENTRY_KEYS = [
    "namespace", "component", "instance_id", "transport", "stream_plane", "model",
    "model_path", "vocab_size", "max_model_len", "pid", "system_url", "admin_base_url",
    "world_size", "weight_transfer_backend", "gated",
    "weight_version", "weight_digest", "weight_step", "fleet_epoch", "endpoint",
    "request_plane_url", "kv_block_size"]


async def test_a_worker_publishes_its_entries_and_their_changes(tmp_path: Path) -> None:
    """An in-process mocker worker registers one entry per endpoint (the shape frontends
    and the RL listener read), and republishes both when a controller closes it."""
    import httpx

    from rlfleet.mocker.admin import MockAdmin
    from rlfleet.mocker.engine import MockEngine
    from rlfleet.protocol.identity import PolicyIdentity
    from rlfleet.protocol.rl import RlWorker, WorkerEntry
    from rlfleet.worker.serve import serve_worker
    from tests.inprocess import mock_worker_args

    url = (tmp_path / "discovery").as_uri()
    args = mock_worker_args("--served-model-name", "m", "--enable-rl", "--system-port", "0",
                            "--discovery", url, "--lease-ttl", "3")
    engine = MockEngine(args)
    worker = asyncio.create_task(serve_worker(engine, args, MockAdmin(engine, []).routes))
    d = open_discovery(url)

    async def entries(want: Callable[[Entries], bool]) -> Entries:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert not worker.done(), worker
            got = await d.list("dynamo", "backend")
            if want(got):
                return got
            await asyncio.sleep(0.05)
        raise AssertionError(f"entries never settled: {got}")

    try:
        gen, rl = await entries(lambda es: len(es) == 2)
        assert [e["endpoint"] for e in (gen, rl)] == ["generate", "rl"]
        for e in (gen, rl):
            assert list(e) == WORKER_ENTRY_KEYS
            assert e["request_plane_url"] == f"dyn://dynamo.backend.{e['endpoint']}"
            assert e["gated"] is False and e["fleet_epoch"] == 0
            assert e["world_size"] == 1 and e["admin_base_url"] == e["system_url"]
            assert e["weight_transfer_backend"] == "none"  # the mocker has no such engine
            assert PolicyIdentity.from_stamped(e) == engine.serving_policy()
            assert WorkerEntry.from_entry(e).to_entry() == e
        assert {k: v for k, v in gen.items() if k not in ("endpoint", "request_plane_url")} == \
            {k: v for k, v in rl.items() if k not in ("endpoint", "request_plane_url")}
        assert RlWorker.from_entry(rl).model == "m"
        async with httpx.AsyncClient(base_url=gen["system_url"]) as http:
            r = await http.post("/engine/set_admission", json={"open": False, "reason": "why"})
            assert r.status_code == 200, r.text
        closed = await entries(lambda es: all(e["gated"] for e in es))
        for e in closed:
            keys = list(e)
            assert keys[keys.index("gated"):keys.index("weight_version")] == [
                "gated", "gate_reason", "controlled"]
            assert e["gate_reason"] == "why" and e["controlled"] is True
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
        await d.close()
