"""A coordinator's transaction runs without full garbage collections
(rlfleet.refresh.coordinator.no_full_collection), and the collector's thresholds come back
as they were when the last transaction of the process ends, however it ends."""

from __future__ import annotations

import gc

import pytest

from rlfleet.refresh.coordinator import no_full_collection


def test_no_full_collection_while_transactions_run_and_the_threshold_comes_back() -> None:
    before = gc.get_threshold()
    with no_full_collection():
        young, middle, oldest = gc.get_threshold()
        assert (young, middle) == before[:2] and oldest > 10**6
        with no_full_collection():  # a second transaction of the process, at the same time
            pass
        assert gc.get_threshold()[2] == oldest  # the first one still runs
    assert gc.get_threshold() == before


def test_a_failed_transaction_puts_the_threshold_back() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), no_full_collection():
        raise RuntimeError("the refresh failed")
    assert gc.get_threshold() == before


def test_a_threshold_someone_set_meanwhile_is_left_as_it_is() -> None:
    before = gc.get_threshold()
    try:
        with no_full_collection():
            gc.set_threshold(500, 5, 5)
        assert gc.get_threshold() == (500, 5, 5)
    finally:
        gc.set_threshold(*before)
