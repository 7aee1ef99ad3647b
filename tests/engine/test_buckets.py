"""Batch buckets (bole.engine.buckets): the row counts an engine of ``max_slots`` slots pads its
rounds to, each once, ascending, the last ``max_slots`` itself; a round of n requests pads to the
smallest of them that holds n."""

from bole.engine.buckets import BUCKETS, bucket_for, buckets_upto


def test_buckets_upto_lists_each_row_count_once_ending_at_the_engines_size():
    assert buckets_upto(1) == [1]
    assert buckets_upto(2) == [1, 2]
    assert buckets_upto(8) == [1, 2, 4, 8]
    assert buckets_upto(51) == [1, 2, 4, 8, 16, 32, 51]
    assert buckets_upto(256) == list(BUCKETS)
    assert buckets_upto(300) == list(BUCKETS) + [300]


def test_bucket_for_is_the_smallest_bucket_that_holds_the_requests():
    assert [bucket_for(n, 8) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    assert [bucket_for(n, 51) for n in (32, 33, 51, 52)] == [32, 51, 51, None]
