"""Host bookkeeping of the page pool: taking, sharing, giving back, preempting."""
import pytest

from muajax.engine.pages import PagedSeq, PagePool, PageTables, SharedPrefix


def test_pages_come_back_and_are_reused():
    pool = PagePool(num_shards=2, pages_per_shard=4)
    first = pool.take(1, 3)
    assert pool.free(1) == 1 and pool.free(0) == 4 and pool.in_use == 3
    pool.give_back(1, first)
    assert pool.free(1) == 4 and pool.in_use == 0
    again = pool.take(1, 3)
    assert sorted(again) == sorted(first)  # the same pages, handed out again
    with pytest.raises(RuntimeError, match="free pages"):
        pool.take(1, 2)
    with pytest.raises(RuntimeError, match="already free"):
        pool.give_back(0, [0])


def test_shared_pages_return_with_their_last_holder():
    pool = PagePool(1, 4)
    tables = PageTables(pool, page_size=2, max_pages=4)
    owner = PagedSeq(0, queued=[1, 2, 3, 4, 5])
    tables.place(owner)
    assert tables.grow(owner, 4)
    owner.cached, owner.queued = owner.queued[:4], owner.queued[4:]
    sharer = PagedSeq(1, queued=[1, 2, 3, 4, 9, 9])
    tables.adopt(sharer, 0, owner.pages, [1, 2, 3, 4])
    assert sharer.length == 4 and sharer.queued == [9, 9]
    assert [pool.refcount(0, p) for p in owner.pages] == [2, 2]
    tables.drop(owner)
    assert pool.free(0) == 2  # still held by the sharer
    assert tables.grow(sharer, 6) and pool.free(0) == 1
    tables.drop(sharer)
    assert pool.free(0) == 4 and sharer.queued == [1, 2, 3, 4, 9, 9]  # its tokens wait to be extended again
    with pytest.raises(RuntimeError, match="first tokens"):
        tables.adopt(PagedSeq(2, queued=[7, 7, 7]), 0, [0], [1, 2])


def test_preemption_takes_victims_in_order_until_enough_is_free():
    pool = PagePool(2, 5)
    tables = PageTables(pool, page_size=1, max_pages=4)
    a, b, c = (PagedSeq(i, queued=[0] * 4) for i in range(3))
    for seq, shard in ((a, 0), (b, 0), (c, 1)):
        seq.shard = shard
        assert tables.grow(seq, 2)
    needy = PagedSeq(3, queued=[0] * 3, shard=0)
    assert not tables.grow(needy, 3)
    dropped = tables.preempt_for(needy, 3, [c, b, a])  # c lives in another shard: not a victim
    assert dropped == [b] and b.pages == [] and a.pages and c.pages
    assert tables.grow(needy, 3) and tables.preemptions == 1
    with pytest.raises(ValueError, match="exceed"):
        tables.grow(needy, 5)
    with pytest.raises(ValueError, match="give the pool more tokens"):
        PageTables(pool, page_size=1, max_pages=6)


def test_prefix_matches_only_on_its_full_pages_with_a_token_left():
    prefix = SharedPrefix(tokens=(1, 2, 3, 4, 5), full_tokens=4)
    assert prefix.matches([1, 2, 3, 4, 9])
    assert not prefix.matches([1, 2, 3, 4])  # nothing left to feed the decode loop
    assert not prefix.matches([1, 2, 3, 5, 9])
    assert not SharedPrefix(tokens=(1, 2), full_tokens=0).matches([1, 2, 3])
