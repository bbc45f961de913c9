"""A SQLite catalog opened by several processes at once (two workers' first staging): each
open succeeds. (The suite's LoRA staging test once failed with "database is locked" on its
first refresh; 8 threads opening a fresh file at once reproduced it in ~5 % of tries.)"""

from __future__ import annotations

import threading

from rlfleet.weights.catalog import SqliteStore


def test_many_opening_a_new_catalog_at_once_all_succeed(tmp_path) -> None:
    errors: list[Exception] = []
    for trial in range(40):
        path = tmp_path / f"c{trial}.sqlite"
        go = threading.Barrier(8)

        def open_store(path=path, go=go) -> None:
            go.wait()
            try:
                SqliteStore(path)
            except Exception as e:  # noqa: BLE001 (collected, asserted below)
                errors.append(e)
        threads = [threading.Thread(target=open_store) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
