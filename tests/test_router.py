"""The routing rule on constructed replica views (no Ray cluster)."""
from __future__ import annotations

import random

from serve_app.router import ReplicaView, estimate_blocks, prefix_fingerprint, rank_replicas


def view(key, free=100, held=0, demand=0, waiting=0, max_waiting=8, prefixes=()):
    return ReplicaView(key, free, held, demand, waiting, max_waiting, frozenset(prefixes))


def test_two_choices_pick_the_larger_headroom():
    views = [view("a", free=10), view("b", free=90)]
    for seed in range(5):
        assert rank_replicas(views, 5, None, random.Random(seed))[0] == ["b"]


def test_of_two_that_fit_the_one_with_fewer_requests_waiting_for_a_first_token_wins():
    busy = view("a", free=90, waiting=3)  # more room, but three prompts queued before this one's
    idle = view("b", free=40, waiting=0)
    for seed in range(5):
        assert rank_replicas([busy, idle], 5, None, random.Random(seed))[0] == ["b"]
    tight = view("c", free=4, waiting=0)  # no headroom for it: room first
    for seed in range(5):
        assert rank_replicas([busy, tight], 5, None, random.Random(seed))[0] == ["a"]


def test_headroom_counts_what_admitted_requests_will_still_claim():
    # a has more free blocks now, but its running requests will grow by 80 more
    a = view("a", free=100, held=20, demand=100)
    b = view("b", free=60, held=10, demand=10)
    assert a.headroom(10) == 10 and b.headroom(10) == 50
    assert rank_replicas([a, b], 10, None, random.Random(0))[0] == ["b"]


def test_replica_at_waiting_limit_gets_nothing():
    views = [view("a", free=100, waiting=8), view("b", free=1)]
    assert rank_replicas(views, 5, None, random.Random(0)) == [["b"]]
    assert rank_replicas([view("a", waiting=8)], 5, None, random.Random(0)) == []


def test_prefers_replica_caching_the_prefix_when_it_fits():
    views = [view("a", free=100), view("b", free=30, prefixes={"fp"})]
    assert rank_replicas(views, 10, "fp", random.Random(0))[0] == ["b"]
    # but not when the prefix holder has no room for it
    assert rank_replicas(views, 40, "fp", random.Random(0))[0] == ["a"]


def test_request_estimates():
    from dataclasses import replace

    from serve_app.messages import GenerateRequest

    long_prompt = "word " * 200
    p = GenerateRequest("r", "completion", {"max_tokens": 100}, prompt=long_prompt)
    assert estimate_blocks(p, 16) == -(-(len(long_prompt) // 4 + 1 + 100) // 16)
    assert estimate_blocks(GenerateRequest("r", "completion", {"max_tokens": 2, "n": 3}, prompt=[1] * 30), 16) == 3
    assert prefix_fingerprint(p) == prefix_fingerprint(replace(p, prompt=long_prompt + "different tail"))
    assert prefix_fingerprint(replace(p, prompt="hi")) is None
    assert prefix_fingerprint(p) != prefix_fingerprint(replace(p, prompt="other " * 200))
    chat = GenerateRequest("c", "chat", {}, messages=[{"role": "system", "content": "be brief " * 40},
                                                      {"role": "user", "content": "hi"}])
    later_turn = replace(chat, messages=[*chat.messages, {"role": "assistant", "content": "hello"}])
    assert prefix_fingerprint(chat) == prefix_fingerprint(later_turn)  # same conversation head, same key


def test_no_queueing_behind_a_full_replica():
    full = view("a", free=5, held=40, demand=40, waiting=2)  # requests already wait there
    assert not full.takes(10) and rank_replicas([full], 10, None, random.Random(0)) == []  # wait in the caller
    idle_but_small = view("b", free=5, waiting=0)  # nothing waits there: it may take one and start soon
    assert rank_replicas([full, idle_but_small], 10, None, random.Random(0)) == [["b"]]


def test_pending_book_counts_what_was_sent_since_the_last_report():
    from serve_app.router import PendingBook

    book = PendingBook()
    stats = {"free_blocks": 50, "used_blocks": 0, "demand_blocks": 0, "waiting": 0, "max_waiting": 8,
             "reported_at": 1.0}
    book.note("a", stats, 20)
    book.note("a", stats, 20)
    v = book.view("a", stats)
    assert v.demand_blocks == 40 and v.waiting == 2 and v.headroom(20) == -10
    fresh = {**stats, "reported_at": 2.0, "demand_blocks": 40, "waiting": 0}  # the replica's own report now
    assert book.view("a", fresh).demand_blocks == 40  # not counted twice
    assert book.view("b", None) is None


def test_a_replica_that_has_not_reported_yet_counts_as_empty():
    from serve_app.router import PendingBook

    book = PendingBook()
    peer = {"free_blocks": 10, "used_blocks": 90, "demand_blocks": 95, "waiting": 3, "max_waiting": 8,
            "reported_at": 5.0}
    new = book.view("new", None, like=peer)
    assert new.free_blocks == 100 and new.waiting == 0
    for _ in range(3):
        book.note("new", None, 30)
    assert book.view("new", None, like=peer).headroom(30) == -20  # fills up as requests are sent to it
