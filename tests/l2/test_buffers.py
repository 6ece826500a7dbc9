"""The scratch buffer pool: reuse, and the bound on what it keeps idle."""

from __future__ import annotations

from kvpool.agent.l2.buffers import BufferPool


def test_a_returned_buffer_is_lent_again_and_the_idle_bound_holds() -> None:
    pool = BufferPool(max_idle_bytes=1000)
    with pool.borrow(600) as first:
        first[:3] = b"abc"
        with pool.borrow(600) as second:  # the first is out: a buffer of its own
            second[:3] = b"xyz"
    with pool.borrow(500) as again:  # the smallest idle buffer that fits: one of the two
        assert len(again) == 500 and bytes(again[:3]) in (b"abc", b"xyz")
    with pool.borrow(2000) as large:  # larger than any idle one: new, and too large to keep
        assert len(large) == 2000
    assert sorted(len(b) for b in pool._idle) == [600]  # the second 600 did not fit the bound
