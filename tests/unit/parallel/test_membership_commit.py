"""``Membership.commit``: the two-phase commit through a real ``TCPStore`` (in this process, members as threads and
no process group). Every member reaches the same decision in the windows an all-reduce vote leaves open: a member
dying right after it voted ready, and a member thought dead (stale heartbeat) that votes ready afterwards."""

from __future__ import annotations

import datetime
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from plait.parallel.membership import Membership, NoQuorumError
from tests.distributed.spawning import free_port

DEAD_AFTER_S = 2.0


def _group(timeout_s: float):
    """A store and 3 connected members of it; ``timeout_s``: how long a member waits for a missing vote. A member is dead after 2 s without a heartbeat: a loaded machine starves a live member's
    heartbeat thread for longer than a few heartbeats."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    group = [Membership("127.0.0.1", port, w, 3, heartbeat_s=0.05, dead_after_s=DEAD_AFTER_S, timeout_s=timeout_s)
             for w in range(3)]
    for m in group:
        m.connect()
        m.members = (0, 1, 2)
    return server, group


@pytest.fixture()
def members():
    server, group = _group(3.0)
    yield server, group
    for m in group:
        m.close()


@pytest.fixture()
def patient_members():
    """As ``members``, waiting 60 s for a missing vote: a wait for one outlasts the 5-s result deadlines."""
    server, group = _group(60.0)
    yield server, group
    for m in group:
        m.close()


def test_every_member_ready_commits_everywhere(members):
    _, group = members
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda m: m.commit("step0"), group)) == [True, True, True]


def test_a_member_dying_after_its_ready_vote_still_commits_everywhere(members):
    server, (m0, m1, m2) = members
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(m0.commit, "step3")  # waits for m1
        dying = pool.submit(m2.commit, "step3")
        time.sleep(0.2)
        server.set("dead/2", "-9")  # m2 dies after writing its ready key (the launcher marks it)
        m2.close()
        assert m1.commit("step3") is True
        assert first.result(timeout=5) is True and dying.result(timeout=5) is True


def test_a_member_thought_dead_that_votes_ready_late_is_overruled(members):
    _, (m0, m1, m2) = members
    m2.close()  # m2 stops beating (hung, not dead) before it votes
    time.sleep(DEAD_AFTER_S + 0.5)  # its heartbeat is stale: m1 proposes abort, and the store records it once
    assert m1.commit("step5") is False
    assert m2.commit("step5") is False and m0.commit("step5") is False  # all ready now, but the decision stands


def test_a_member_that_saw_the_failure_aborts_without_the_others_waiting(patient_members):
    _, (m0, m1, m2) = patient_members
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(m.commit, "step2") for m in (m1, m2)]
        time.sleep(0.1)
        assert m0.commit("step2", ready=False) is False
        assert [f.result(timeout=5) for f in waiting] == [False, False]  # not the 60-s wait for a missing vote


def test_an_announcement_reaches_members_that_wait_longer_than_the_collective_timeout():
    """Rank 0 deciding for longer than the groups' timeout (waiting for a restarted worker to start): the others
    wait on the store, not in a collective that would time out first."""
    server, group = _group(0.5)  # collectives would time out after 0.5 s
    try:
        m0, m1, _ = group
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(m1.announce, "joiners/step5", None, 5.0)
            time.sleep(1.5)
            assert not waiting.done()
            assert m0.announce("joiners/step5", "[4]", 5.0) == "[4]"
            assert waiting.result(timeout=5) == "[4]"
        with pytest.raises(RuntimeError):  # nothing announced: the wait ends after wait_s
            m1.announce("joiners/step6", None, 0.3)
    finally:
        for m in group:
            m.close()


def test_a_member_is_gone_when_a_new_process_of_it_asks_to_join_or_its_heartbeat_was_removed(members):
    server, (m0, m1, m2) = members
    assert not m0._gone(1) and not m0._gone(2)  # both beat
    server.set("join/1", "1")  # a new process of worker 1 asks to join: the old one is dead
    server.delete_key("hb/2")  # worker 2's launcher starts a new process of it (acknowledged: the set is stored)
    assert m0._gone(1) and m0._gone(2)
    server.delete_key("join/1")
    assert not m0._gone(1)
    server.set("dead/1", "-9")  # the launcher saw it exit
    assert server.check(["dead/1"])  # a set is not acknowledged: a check on its connection waits for it
    assert m0._gone(1)


def test_post_and_posted_read_without_waiting(members):
    _, (m0, m1, _) = members
    assert m1.posted("asked/step3") is None
    m0.post("asked/step3", "[4, 5]")
    assert m1.posted("asked/step3") == "[4, 5]"


def test_generation_0_waits_for_every_worker_to_connect_however_late_its_node_starts():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    early, late = (Membership("127.0.0.1", port, w, 2, heartbeat_s=0.05, dead_after_s=DEAD_AFTER_S, timeout_s=0.5,
                              start_timeout_s=30.0) for w in range(2))
    with ThreadPoolExecutor(1) as pool:
        early.connect()
        waiting = pool.submit(early._await_start)
        time.sleep(1.5)  # three collective timeouts later, the other node's worker connects
        assert not waiting.done()
        late.connect()
        late._await_start()
        waiting.result(timeout=5)
    alone = Membership("127.0.0.1", free_port(), 0, 2, heartbeat_s=0.05, dead_after_s=DEAD_AFTER_S, start_timeout_s=0.5)
    store = dist.TCPStore("127.0.0.1", alone.port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    alone.connect()
    with pytest.raises(NoQuorumError, match=r"worker 0: 1 of 2 workers started within 0.5 s; start every node's"):
        alone._await_start()
    for m in (early, late, alone):
        m.close()
    del server, store
