"""SampleFeed: the steps' samples in step order from worker processes (received by a thread ahead of the
caller), failures per sample, errors outside a sample re-raised, and a prompt close mid-run."""

from __future__ import annotations

import multiprocessing

import pytest

from plait.data.loader import SampleFeed
from plait.data.sources import SampleError


class FakeDataset:
    """``load(i)`` is ``i * 10``; index 7 fails like a corrupt file, index 13 like a bug."""

    def __len__(self) -> int:
        return 100

    def load(self, index: int) -> int:
        if index == 7:
            raise SampleError("record 'r7' (x.jsonl:8): cannot decode image")
        if index == 13:
            raise RuntimeError("boom at 13")
        return index * 10


STEPS = [(0, 1), (2, 3), (4, 5, 6), (7, 8), (9,), (10, 11)]


def drain(feed: SampleFeed) -> list:
    out = []
    while True:
        try:
            out.append(feed.next())
        except StopIteration:
            return out


@pytest.mark.parametrize("workers,prefetch", [(0, 2), (1, 2), (2, 4)])
def test_the_steps_arrive_in_order_with_their_failures(workers, prefetch):
    feed = SampleFeed(FakeDataset(), iter(STEPS), workers=workers, prefetch=prefetch)
    got = drain(feed)
    feed.close()
    assert [g.indices for g in got] == STEPS
    assert [g.samples for g in got] == [{i: i * 10 for i in s if i != 7} for s in STEPS]
    assert [sorted(g.failed) for g in got] == [[], [], [], [7], [], []]
    assert "x.jsonl:8" in got[3].failed[7]
    assert all(g.wait_s >= 0 for g in got)
    with pytest.raises(StopIteration):
        feed.next()


def test_an_error_outside_a_sample_is_raised_to_the_caller_from_the_worker():
    feed = SampleFeed(FakeDataset(), iter([(0,), (13,), (14,)]), workers=2, prefetch=2)
    assert feed.next().samples == {0: 0}
    with pytest.raises(RuntimeError, match="boom at 13"):
        feed.next()
    with pytest.raises(RuntimeError, match="boom at 13"):
        feed.next()  # and again: the feed does not skip past it
    feed.close()


def test_close_after_an_error_ends_the_workers_while_the_caller_keeps_the_error():
    """The workers ignore SIGTERM: one left running blocks the interpreter's exit (it joins its children)."""
    before = set(multiprocessing.active_children())
    feed = SampleFeed(FakeDataset(), iter([(0,), (13,), (14,)]), workers=2, prefetch=2)
    assert feed.next().samples == {0: 0}
    with pytest.raises(RuntimeError, match="boom at 13") as caught:
        feed.next()
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert len(workers) == 2
    feed.close()
    for proc in workers:
        proc.join(timeout=10)
    assert [proc.is_alive() for proc in workers] == [False, False]
    assert "boom at 13" in str(caught.value)  # still held here, with its traceback


def test_close_mid_run_stops_the_receiving_thread_promptly():
    feed = SampleFeed(FakeDataset(), iter([(i,) for i in range(60) if i not in (7, 13)]), workers=2, prefetch=2,
                      ahead=1)
    assert feed.next().samples == {0: 0}
    thread = feed._thread
    feed.close()  # joins the thread for at most 30 s: alive after it means the stop went unseen
    assert thread is not None and not thread.is_alive()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="ahead"):
        SampleFeed(FakeDataset(), iter(STEPS), workers=1, ahead=0)
    with pytest.raises(ValueError, match="prefetch"):
        SampleFeed(FakeDataset(), iter(STEPS), workers=-1)


def test_a_feed_dropped_without_close_stops_its_thread():
    import gc

    feed = SampleFeed(FakeDataset(), iter([(i,) for i in range(60) if i not in (7, 13)]), workers=1, prefetch=2)
    assert feed.next().samples == {0: 0}
    thread = feed._thread
    del feed
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
