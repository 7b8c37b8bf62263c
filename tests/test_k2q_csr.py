"""build_k2q_csr and its schedule (contract §1.1): row layout, ordering, bounds, slots."""

import pytest
import torch

import msa
from msa.sparse_index_utils import (build_k2q_csr_torch_reference, k2q_to_q2k, q2k_to_k2q,
                                    safe_total_rows)
from msa.src.sm100.prepare_scheduler import SLOT_SHIFT, SparseAttentionSchedule
from msa_testing import cu_seqlens, random_q2k


def _expected_row(k_lens, b, beta):
    """Contract formula: sum_b' min(rows_b', beta) + rank of b among requests with rows > beta."""
    rows = [-(-n // 128) for n in k_lens]
    return sum(min(r, beta) for r in rows) + sum(1 for bb in range(b) if rows[bb] > beta)


def _csr_dict(row_ptr, q_idx, h, row):
    lo, hi = int(row_ptr[h, row]), int(row_ptr[h, row + 1])
    return q_idx[h, lo:hi].tolist()


@pytest.mark.parametrize("topk", [4, 8, 16, 32])
def test_round_robin_rows_and_ascending_queries(topk, seed):
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = [70, 300, 129], [520, 129, 700]
    q2k = random_q2k(q_lens, k_lens, 2, topk, generator=gen)
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    row_ptr, q_idx = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=sum(k_lens))
    exact_rows = sum(-(-n // 128) for n in k_lens)
    assert row_ptr.shape == (2, safe_total_rows(sum(k_lens), 3) + 1)
    assert q_idx.shape == (2, sum(q_lens) * topk)
    # Expected content straight from the definition.
    for h in range(2):
        expected = {}
        q0 = 0
        for b, ql in enumerate(q_lens):
            for i in range(ql):
                for blk in q2k[h, q0 + i].tolist():
                    if blk >= 0:
                        expected.setdefault(_expected_row(k_lens, b, blk), []).append(i)
            q0 += ql
        for row in range(row_ptr.shape[1] - 1):
            got = _csr_dict(row_ptr, q_idx, h, row)
            assert got == sorted(expected.get(row, [])), (h, row)
            assert row < exact_rows or not got
        nnz = int(row_ptr[h, -1])
        assert (q_idx[h, nnz:] == -1).all()


def test_default_total_rows_never_undercounts():
    """B=2 with k_len 192 each: total_k % 128 == 0 but 4 rows exist (upstream emits 3)."""
    q_lens, k_lens = [192, 192], [192, 192]
    q2k = torch.full((1, 384, 4), -1, dtype=torch.int32)
    q2k[0, :, 0] = 0
    q2k[0, :, 1] = torch.tensor([1] * 192 + [1] * 192, dtype=torch.int32)
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    row_ptr, q_idx = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=384)
    assert row_ptr.shape[1] - 1 >= 4
    assert int(row_ptr[0, 4]) == 768          # every entry kept
    ref_ptr, ref_idx = build_k2q_csr_torch_reference(q2k, cu_q, cu_k, 128)
    assert torch.equal(row_ptr[:, :5], ref_ptr)
    assert torch.equal(q_idx[:, :768], ref_idx[:, :768])
    # An explicit short total_rows would drop the rows past it: the reference raises (the
    # native builder only under check_input_valid; it cannot see the lengths without a sync).
    with pytest.raises(ValueError, match="^total_rows"):
        msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=384, total_rows=3)
    # The torch reference helper still drops them (it is the runtime builders' exact model).
    short_ptr, _ = build_k2q_csr_torch_reference(q2k, cu_q, cu_k, 128, total_rows=3)
    assert short_ptr.shape == (1, 4) and int(short_ptr[0, -1]) == 192 * 3


def test_out_of_range_ids_dropped_at_runtime_and_rejected_by_reference():
    q2k = torch.tensor([[[0, 5, -1, 1], [2, -1, 0, 9]]], dtype=torch.int32)
    cu_q, cu_k = cu_seqlens([2]), cu_seqlens([300])           # 3 blocks
    row_ptr, q_idx = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=300)
    assert row_ptr[0, :4].tolist() == [0, 2, 3, 4]
    assert q_idx[0, :4].tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="q2k_indices"):
        build_k2q_csr_torch_reference(q2k, cu_q, cu_k, 128)


def test_empty_workload():
    q2k = torch.empty(2, 0, 8, dtype=torch.int32)
    row_ptr, q_idx = msa.build_k2q_csr(q2k, cu_seqlens([0]), cu_seqlens([500]), 128,
                                       total_k=500)
    assert (row_ptr == 0).all() and q_idx.numel() == 0


def _causal_csr(q_lens, k_lens, hkv, topk, gen):
    """(q2k, cu_q, row_ptr, q_idx, schedule): build_k2q_csr with its schedule on a random causal
    selection of these requests."""
    q2k = random_q2k(q_lens, k_lens, hkv, topk, generator=gen, causal_visible_only=True)
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    row_ptr, q_idx, sched = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=sum(k_lens),
                                              max_seqlen_q=max(q_lens),
                                              max_seqlen_k=max(k_lens), return_schedule=True)
    return q2k, cu_q, row_ptr, q_idx, sched


def test_scheduler_builds_packed_qsplit_metadata(seed):
    """Contract §5.1: S_q=256, S_k=512, topK=4, Hkv=1."""
    q2k, _cu_q, row_ptr, q_idx, sched = _causal_csr([256], [512], 1, 4,
                                                    torch.Generator().manual_seed(seed))
    assert isinstance(sched, SparseAttentionSchedule) and sched.enabled and sched.complete
    n_work = int(sched.work_count[0])
    meta = sched.scheduler_metadata[:n_work]
    assert sched.work_capacity >= n_work > 0
    assert int(meta[:, 3].sum()) == int(row_ptr[0, -1])          # chunks cover every entry
    assert (meta[:, 3] <= sched.target_q_per_cta).all() and (meta[:, 4] == 0).all()
    for h, row, q0, qn, _b, blk in meta.tolist():
        assert blk == row                                       # B=1: row r is block r
    nnz = int(row_ptr[0, -1])
    packed = sched.qsplit_indices[0, :nnz]
    assert torch.equal(packed & ((1 << SLOT_SHIFT) - 1), q_idx[0, :nnz])
    slots = packed >> SLOT_SHIFT
    for q in range(256):
        mine = slots[q_idx[0, :nnz] == q].sort().values.tolist()
        assert mine == list(range(int(sched.split_counts[q, 0])))
        assert len(mine) == int((q2k[0, q] >= 0).sum())


def test_schedule_requires_length_hints():
    q2k = torch.zeros(1, 4, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen"):
        msa.build_k2q_csr(q2k, cu_seqlens([4]), cu_seqlens([4]), 128, total_k=4,
                          return_schedule=True)


def test_q2k_k2q_round_trip(seed):
    gen = torch.Generator().manual_seed(seed)
    b, h, sq, topk, nblk = 2, 3, 50, 8, 12
    q2k = torch.full((b, h, sq, topk), -1, dtype=torch.int32)
    for idx in range(b * h * sq):
        n = int(torch.randint(0, topk + 1, (1,), generator=gen))
        sel = torch.randperm(nblk, generator=gen)[:n].sort().values
        q2k.view(-1, topk)[idx, :n] = sel.int()
    k2q, counts = q2k_to_k2q(q2k, nblk)
    assert int(counts.sum()) == int((q2k >= 0).sum())
    assert torch.equal(k2q_to_q2k(k2q, counts, sq, topk), q2k)


def test_builder_class_is_the_same_callable(seed):
    gen = torch.Generator().manual_seed(seed)
    q2k = random_q2k([77], [400], 2, 8, generator=gen)
    a = msa.SparseK2qCsrBuilderSm100()(q2k, cu_seqlens([77]), cu_seqlens([400]), total_k=400)
    b = msa.build_k2q_csr(q2k, cu_seqlens([77]), cu_seqlens([400]), 128, total_k=400)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _window_pieces(sched, row_ptr, q_idx, cu_q, window):
    """The query-window split written as host loops: {(head, window, row, entries)} of the
    schedule's items cut at every window edge."""
    pieces = []
    for h, row, q0, qn, b, _blk in sched.scheduler_metadata[:int(sched.work_count[0])].tolist():
        first = int(row_ptr[h, row]) + q0
        entries = list(range(first, first + qn))
        windows = [(int(cu_q[b]) + int(q_idx[h, e])) // window for e in entries]
        lo = 0
        for i in range(1, qn + 1):
            if i == qn or windows[i] != windows[lo]:
                pieces.append((h, windows[lo], row, tuple(entries[lo:i])))
                lo = i
    return sorted(pieces)


@pytest.mark.parametrize("window", [1, 64, 100, 1000])
def test_query_window_split_keeps_every_entry_once(window, seed):
    """split_items_by_query_window: the same entries, cut at windows, ordered (KV head, window,
    row); each piece's metadata names its own entries; the capacity holds them."""
    from msa.schedules.sparse import split_items_by_query_window, window_capacity
    q_lens = [300, 45, 210]
    _q2k, cu_q, row_ptr, q_idx, sched = _causal_csr(q_lens, [900, 300, 1400], 2, 8,
                                                    torch.Generator().manual_seed(seed))
    split = split_items_by_query_window(sched, q_idx, cu_q, window)
    n = int(split.work_count[0])
    assert split.work_capacity == window_capacity(sched, sum(q_lens), window) >= n
    owner = {row: (b, blk) for _h, row, _q0, _qn, b, blk
             in sched.scheduler_metadata[:int(sched.work_count[0])].tolist()}
    got = []
    for h, row, q0, qn, b, blk in split.scheduler_metadata[:n].tolist():
        first = int(sched.k2q_row_ptr[h, row]) + q0
        entries = tuple(range(first, first + qn))
        windows = {(int(cu_q[b]) + int(q_idx[h, e])) // window for e in entries}
        assert len(windows) == 1 and qn > 0 and owner[row] == (b, blk)
        got.append((h, windows.pop(), row, entries))
    assert got == sorted(got)                                   # (head, window, row) order
    assert got == _window_pieces(sched, row_ptr, q_idx, cu_q, window)
    # Same slots and counts: only the items changed.
    assert split.qsplit_indices is sched.qsplit_indices
    assert split.split_counts is sched.split_counts


def test_query_window_split_of_unsorted_rows_keeps_every_entry(seed):
    """A CSR whose rows are not ascending (an unchecked caller's) still fits the capacity and
    covers every entry exactly once."""
    from msa.schedules.sparse import split_items_by_query_window
    gen = torch.Generator().manual_seed(seed)
    _q2k, cu_q, row_ptr, q_idx, sched = _causal_csr([260], [1000], 1, 8, gen)
    shuffled = q_idx.clone()
    for r in range(row_ptr.shape[1] - 1):
        lo, hi = int(row_ptr[0, r]), int(row_ptr[0, r + 1])
        shuffled[0, lo:hi] = q_idx[0, lo:hi][torch.randperm(hi - lo, generator=gen)]
    split = split_items_by_query_window(sched, shuffled, cu_q, 16)
    n = int(split.work_count[0])
    assert n <= split.work_capacity
    covered = []
    for h, row, q0, qn, _b, _blk in split.scheduler_metadata[:n].tolist():
        first = int(row_ptr[h, row]) + q0
        covered.extend(range(first, first + qn))
    assert sorted(covered) == list(range(int(row_ptr[0, -1])))
