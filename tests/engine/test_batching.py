"""Host-side batch building: chunked, bucketed extends and rows laid out by shard."""
import numpy as np

from muajax.engine import batching
from muajax.engine.kv_cache import PoolSpec
from muajax.engine.pages import PagedSeq, PagePool, PageTables
from tests.support.tiny_models import ONE_LAYER_CONFIG

CFG = ONE_LAYER_CONFIG.replace(intermediate_size=32, head_dim=8)


def test_long_prompts_are_extended_in_bounded_chunks_never_at_max_len():
    spec = PoolSpec(CFG, None, pages_per_shard=1024, page_size=16, max_pages=512)  # max_len 8192
    tables = PageTables(PagePool(1, 1024), 16, 512)
    seqs = [PagedSeq(i, queued=list(range(n))) for i, n in enumerate((5000, 700, 40, 3))]
    for seq in seqs:
        seq.shard = 0
        assert tables.grow(seq, len(seq.queued))
    batches = list(batching.extend_batches(seqs, False, spec, (32, 128, 512, 2048), (1, 2, 4, 8), 4096, tables))
    widths = [b.tokens.shape[1] for b in batches]
    assert max(widths) == 2048 and all(b.tokens.size <= 4096 for b in batches)  # rows x width bounded
    assert [seq.queued for seq in seqs] == [[], [], [], []]
    assert [seq.cached for seq in seqs] == [list(range(n)) for n in (5000, 700, 40, 3)]
    written = sum(int(b.num_new.sum()) for b in batches)
    assert written == 5000 + 700 + 40 + 3
    first = batches[0]
    assert first.tokens.shape == (2, 2048) and first.num_new.tolist() == [2048, 700]
    assert first.dense_pages == 128  # 2048 positions of 16: the gather follows the rows, not max_len
    np.testing.assert_array_equal(first.page_table[0, :3], seqs[0].pages[:3])


class TwoShards(PoolSpec):
    """A pool spec of two shards without the 2+ devices a mesh would need (host code only)."""

    num_shards = 2


def test_rows_are_laid_out_by_shard():
    tables = PageTables(PagePool(2, 8), 4, 4)
    seqs = [PagedSeq(i, queued=[1] * (3 + i)) for i in range(3)]
    for seq, shard in zip(seqs, (1, 0, 1)):
        seq.shard = shard
        assert tables.grow(seq, 8)
    spec = TwoShards(CFG, None, pages_per_shard=8, page_size=4, max_pages=4)
    (batch,) = batching.extend_batches(seqs, True, spec, (8,), (1, 2, 4), 64, tables)
    # shard 0 holds rows [0, 2), shard 1 rows [2, 4): padding rows have no tokens
    assert batch.num_new.tolist() == [3, 0, 2, 4]
    assert batch.page_table[1].tolist() == [0, 0, 0, 0]
    assert batch.page_table[2].tolist() == seqs[0].pages + [0, 0]
    assert [seq.queued for seq in seqs] == [[1], [1], [1]]  # the last token stays for the decode loop
