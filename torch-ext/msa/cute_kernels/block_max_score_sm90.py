"""MSA indexer block max-scores for Hopper (sm_90a), in the CuTe DSL: warpgroup-MMA kernel.

Computes, for every query token t of request b (local position i), index head h and 128-key
tile beta (keys 128*beta .. 128*beta+127 of b):

    out[h, beta, t] = scale * max over visible keys j of the tile of <q[t, h], k[j]>

(-inf where no key of the tile is visible). Key j is visible iff j < k_len_b and, when causal,
j <= i + offset_b. The whole index-key side is ONE shared head (Hk = 1, as in MSA), so every
(query, head) pair is a row of the same GEMM against the same K tile. Since scale > 0,
max(scale * s) == scale * max(s) exactly (rounding is monotonic), so the scale is applied to
the row max only.

Work decomposition (a compute-bound GEMM with a row-max epilogue):

* a CTA owns TILE_M = 256 rows = 256 / H consecutive queries of one request x all H heads. Row
  r is (query r // H, head r % H), which is exactly q's memory order, and it is 4 warpgroups
  (512 threads) of 64 rows each;
* the CTA streams the request's K tiles 0 .. (last tile any of its rows can see) through a
  STAGES-deep cp.async ring in shared memory (one 128x128 tile per stage, loaded by all 512
  threads, 4 x 16 bytes each); the Q tile is loaded once;
* per K tile every warpgroup runs S = Q K^T as one SS wgmma chain m64n128k16 x 8 (Q and K
  straight from 128-byte-swizzled shared memory), then takes each row's max over the 128
  columns (its 32 columns, then two quad shuffles) and writes it. Masking (key end, causal
  diagonal) runs only on tiles that need it;
* tiles past the CTA's causal limit (or the key end) are never computed: the CTA writes -inf
  there with coalesced stores (runs of queries along total_q, the output's fastest dim).

Decode variant (``split_keys``, paged keys): 1-16 query rows per request make a 256-row tile
mostly empty and leave one CTA per request streaming the whole cache. It uses one warpgroup
(64 rows = up to 64 / H queries) and the grid's x splits each request's K tiles into chunks,
one per CTA (the output tiles are disjoint, so no reduction): a memory-bound stream, 16 KB of Q
+ 3 x 32 KB of K in shared memory, two CTAs per SM.

Four warpgroups share the tensor cores: while one does its row-max epilogue the others' wgmma
chains keep the tensor cores busy. 256 rows per CTA keep L2 traffic low: each 32 KB K tile
feeds 2*256*128*128 FLOPs (256 FLOP per byte). Shared memory: Q 64 KB + 3 x 32 KB of K = 160 KB,
one CTA (16 warps, <= 128 registers per thread) per SM.

Key splits (prefill variant, grid z = S > 1): a query tile of a few hundred queries against a
long prefix would otherwise walk every K tile on one SM. CTA z computes the query tile's K
tiles [z c, (z + 1) c) with c = ceil(n_tiles / S) (n_tiles: the tiles some row of the tile can
see), writing them at their own tile index, so the splits' outputs are disjoint and need no
reduction; CTA z = 0 also writes the -inf tiles. The decode variant splits on grid x the same
way.

Grid (x, B + 1, S): x strides over the request's query tiles, heaviest (last, most keys) first
(decode variant: x is the K-tile split, S = 1);
y = b < B is request b, y = B the "orphan" rows [cu_seqlens_q[B], total_q) that no request
owns, which only get -inf. So every element of out is written exactly once, whatever the
lengths say, and nothing is read out of bounds: Q rows past a request's end, K rows past
k_len / the K tensor and pages outside [0, pages) are never loaded (their shared-memory rows
are stale and masked to -inf).

Tensors (dynamic sizes are runtime values):
  q            [total_q, H, 128] bf16 or e4m3 (H = 1, 2, 4 or 8: compile-time)
  k            dense [total_k, 1, 128] or paged [pages, 1, 128, 128], q's dtype
               (e4m3: the same kernel with m64n128k32 e4m3 wgmmas, fp32 accumulation)
  cu_seqlens_q [B+1] int32; cu_seqlens_k [B+1] int32 (dense token offsets; unused when paged)
  k_lens       [B] int32 key lengths;  offsets [B] int32 causal offsets
  page_table   [B, max_pages] int32 (paged only; a 1-column dummy for dense)
  out          [H, max_k_tiles, total_q] fp32
  scale: fp32 (> 0); causal: int32 flag; the launch grid x and the key splits S are
  host-known int32s.
q, k and out may hold 2^31 elements or more: their row addresses are 64-bit (q and k rows through
copies.row_iterator / kv_row_iterator, which matter here because H and Hk = 1 make every stride
of q and k static; out's strides are dynamic 64-bit). Counts (tokens, tiles, pages) are Int32.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass.cute.nvgpu import warpgroup

from .copies import kv_row_iterator, row_copy, row_iterator
from .geometry import BLOCK_N, HEAD_DIM, WG_ROWS
from .mma import warpgroup_gemm, wgmma_rows_cols_view
from .softmax import quad_max

NUM_WARPGROUPS = 4
TILE_M = WG_ROWS * NUM_WARPGROUPS
NUM_THREADS = 128 * NUM_WARPGROUPS
STAGES = 3               # K tiles in flight


class BlockMaxScoreSm90:
    """Compile-time configuration of one block max-score variant (see cute_kernels.variants)."""

    def __init__(self, num_heads: int, paged: bool, dtype=cutlass.BFloat16,
                 split_keys: bool = False):
        assert num_heads in (1, 2, 4, 8)
        self.num_heads = num_heads
        self.paged = paged
        self.dtype = dtype
        # Decode variant: one warpgroup (64 rows: 1-16 queries x H heads) and the grid's x
        # splits each request's K tiles instead of striding over query tiles.
        self.split_keys = split_keys
        self.num_warpgroups = 1 if split_keys else NUM_WARPGROUPS
        self.tile_m = WG_ROWS * self.num_warpgroups
        self.num_threads = 128 * self.num_warpgroups
        self.queries_per_tile = self.tile_m // num_heads

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, cu_seqlens_q: cute.Tensor,
                 cu_seqlens_k: cute.Tensor, k_lens: cute.Tensor, offsets: cute.Tensor,
                 page_table: cute.Tensor, out: cute.Tensor, scale: cutlass.Float32,
                 causal: cutlass.Int32, grid_q_tiles: cutlass.Int32,
                 key_splits: cutlass.Int32, stream):
        # K-major 128-byte-swizzle atom (8 rows x 128 bytes); the swizzle rides on the pointer.
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        q_layout = cute.tile_to_shape(atom, (WG_ROWS, HEAD_DIM, self.num_warpgroups), (0, 1, 2))
        k_layout = cute.tile_to_shape(atom, (BLOCK_N, HEAD_DIM, STAGES), (0, 1, 2))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_layout)], 1024]

        # One warpgroup loads its own 64 Q rows (16 per step); the whole CTA loads a K tile.
        q_copy = row_copy(self.dtype, 16)
        k_copy = row_copy(self.dtype, self.num_threads // 8)
        mma = hopper.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (WG_ROWS, BLOCK_N))
        self.kernel(q, k, cu_seqlens_q, cu_seqlens_k, k_lens, offsets, page_table, out, scale,
                    causal, q_layout, k_layout, q_copy, k_copy, mma, SharedStorage).launch(
            grid=(grid_q_tiles, cute.size(cu_seqlens_q.shape[0]), key_splits),
            block=(self.num_threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mCuQ: cute.Tensor, mCuK: cute.Tensor,
               mKLens: cute.Tensor, mOffsets: cute.Tensor, mPageTable: cute.Tensor,
               mOut: cute.Tensor, scale: cutlass.Float32, causal: cutlass.Int32,
               q_layout: cute.ComposedLayout, k_layout: cute.ComposedLayout,
               q_copy: cute.TiledCopy, k_copy: cute.TiledCopy, mma: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        cta_x, request, cta_z = cute.arch.block_idx()
        grid_x, _, grid_z = cute.arch.grid_dim()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_tidx = tidx % 128
        lane = tidx % 32
        n_heads = self.num_heads
        qpt = self.queries_per_tile

        batch = mCuQ.shape[0] - 1
        total_q = mOut.shape[2]
        max_k_tiles = mOut.shape[1]

        # ---- this CTA's request (or the orphan rows past cu_seqlens_q[B]) --------------------
        q_start = mCuQ[request]
        q_len = cutlass.Int32(0)
        k_len = cutlass.Int32(0)
        offset = cutlass.Int32(0)
        k_row0 = cutlass.Int32(0)
        orphan = request >= batch
        if orphan:
            q_len = total_q - q_start
        else:
            q_len = mCuQ[request + 1] - q_start
            k_len = mKLens[request]
            if causal != 0:
                offset = mOffsets[request]
            if cutlass.const_expr(not self.paged):
                k_row0 = mCuK[request]
        # Never trust the lengths to fit the tensors.
        q_len = cutlass.min(q_len, total_q - q_start)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ_wgs = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK_stages = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)

        # ---- copy partitions ----------------------------------------------------------------
        thr_q_copy = q_copy.get_slice(wg_tidx)
        tQsQ = thr_q_copy.partition_D(sQ_wgs[None, None, wg])
        tQcQ = thr_q_copy.partition_S(cute.make_identity_tensor((WG_ROWS, HEAD_DIM)))
        q_row_stride0 = cute.make_layout((WG_ROWS, HEAD_DIM), stride=(0, 1))
        thr_k_copy = k_copy.get_slice(tidx)
        tKcK = thr_k_copy.partition_S(cute.make_identity_tensor((BLOCK_N, HEAD_DIM)))
        k_row_stride0 = cute.make_layout((BLOCK_N, HEAD_DIM), stride=(0, 1))

        # ---- warpgroup MMA operands (each warpgroup: its 64 Q rows x the shared K tile) -------
        thr_mma = mma.get_slice(wg_tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ_wgs))      # (.., .., K, wg)
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_stages))   # (.., .., K, stage)
        tSrQ_mine = tSrQ[None, None, None, wg]
        acc_shape = thr_mma.partition_shape_C((WG_ROWS, BLOCK_N))
        tScS = wgmma_rows_cols_view(thr_mma.partition_C(
            cute.make_identity_tensor((WG_ROWS, BLOCK_N))))
        n_my_rows = cute.size(tScS, mode=[0])
        n_my_cols = cute.size(tScS, mode=[1])

        n_q_tiles = (q_len + qpt - 1) // qpt
        walk_start = cta_x
        walk_stride = grid_x
        split = cta_z                           # this CTA's K-tile split of each query tile
        n_splits = grid_z
        if cutlass.const_expr(self.split_keys):
            walk_start = 0                      # every CTA: all query tiles, its K-tile split
            walk_stride = 1
            split = cta_x
            n_splits = grid_x
        for walk in range(walk_start, n_q_tiles, walk_stride):
            # Heaviest first: the last query tile sees the most keys under causal masking.
            q_tile = n_q_tiles - 1 - walk
            q_lo = q_tile * qpt                                  # first local query
            n_q = cutlass.min(qpt, q_len - q_lo)                 # queries of this tile
            # Tiles [0, n_tiles) hold a key visible to some row of the tile.
            last_key = k_len - 1
            if causal != 0:
                last_key = cutlass.min(last_key, q_lo + n_q - 1 + offset)
            n_tiles = cutlass.Int32(0)
            if last_key >= 0:
                n_tiles = last_key // BLOCK_N + 1
            n_tiles = cutlass.min(n_tiles, max_k_tiles)
            if cutlass.const_expr(self.paged):
                n_tiles = cutlass.min(n_tiles, mPageTable.shape[1])
            # This CTA computes tiles [t_begin, t_end): its split of them (all of them, S = 1).
            chunk = (n_tiles + n_splits - 1) // n_splits
            t_begin = cutlass.min(split * chunk, n_tiles)
            t_end = cutlass.min(t_begin + chunk, n_tiles)

            if t_end > t_begin:
                # Q rows of this warpgroup (queries past the tile's end are not loaded).
                for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
                    r = wg * WG_ROWS + tQcQ[0, m, 0][0]
                    q_local = q_lo + r // n_heads
                    if q_local < q_len:
                        q_ptr = row_iterator(mQ, q_start + q_local, r % n_heads)
                        gQ = thr_q_copy.partition_S(cute.make_tensor(q_ptr, q_row_stride0))
                        cute.copy(q_copy, gQ[None, m, None], tQsQ[None, m, None])
                # Prologue: the split's first STAGES-1 K tiles (Q rides in the first group).
                for s in cutlass.range_constexpr(STAGES - 1):
                    if t_begin + s < t_end:
                        self._load_k_tile(mK, mPageTable, request, k_row0, k_len, t_begin + s,
                                          s, sK_stages, thr_k_copy, k_copy, tKcK,
                                          k_row_stride0)
                    cute.arch.cp_async_commit_group()

                for t in range(t_begin, t_end):
                    stage = (t - t_begin) % STAGES
                    # Tile t has landed (at most STAGES-2 younger groups pending); after the
                    # barrier every warpgroup is also done reading the stage refilled below.
                    cute.arch.cp_async_wait_group(STAGES - 2)
                    # cp.async writes are generic-proxy; wgmma reads through the async proxy.
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.sync_threads()
                    ahead = t + STAGES - 1
                    ahead_stage = (ahead - t_begin) % STAGES
                    if ahead < t_end:
                        self._load_k_tile(mK, mPageTable, request, k_row0, k_len, ahead,
                                          ahead_stage, sK_stages, thr_k_copy, k_copy, tKcK,
                                          k_row_stride0)
                    cute.arch.cp_async_commit_group()

                    # ---- S = Q K^T (SS wgmma chain) -------------------------------------------
                    acc_s = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
                    tSrK_stage = tSrK[None, None, None, stage]
                    warpgroup_gemm(mma, acc_s, tSrQ_mine, tSrK_stage)

                    # ---- row max over the tile's visible keys ---------------------------------
                    key0 = t * BLOCK_N
                    n_keys = self._tile_key_count(mK, mPageTable, request, k_row0, k_len, t)
                    # Masking only where the tile meets the key end or the causal diagonal.
                    needs_mask = n_keys < BLOCK_N
                    if causal != 0:
                        if key0 + BLOCK_N - 1 > q_lo + offset:
                            needs_mask = True
                    s_rc = wgmma_rows_cols_view(acc_s)
                    for i in cutlass.range_constexpr(n_my_rows):
                        r = wg * WG_ROWS + tScS[i, 0][0]
                        q_local = q_lo + r // n_heads
                        row_max = -cutlass.Float32.inf
                        if needs_mask:
                            visible_end = n_keys                 # tile keys [0, end) visible
                            if causal != 0:
                                visible_end = cutlass.min(visible_end,
                                                          q_local + offset - key0 + 1)
                            for j in cutlass.range_constexpr(n_my_cols):
                                if tScS[0, j][1] < visible_end:
                                    row_max = cute.arch.fmax(row_max, s_rc[i, j])
                        else:
                            row_max = self._row_max(s_rc, i, n_my_cols)
                        row_max = quad_max(row_max)
                        if lane % 4 == 0 and q_local < q_len:
                            mOut[r % n_heads, t, q_start + q_local] = row_max * scale
                # Every group still pending is empty; the next query tile reuses the buffers.
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()

            # ---- tiles nobody in the tile can see: -inf, runs of queries (coalesced) ----------
            n_fill = (max_k_tiles - n_tiles) * n_heads * qpt
            if split != 0:                      # one split of the query tile fills
                n_fill = cutlass.Int32(0)
            for idx in range(tidx, n_fill, self.num_threads):
                q_in_tile = idx % qpt
                head_tile = idx // qpt
                if q_in_tile < n_q:
                    mOut[head_tile % n_heads, n_tiles + head_tile // n_heads,
                         q_start + q_lo + q_in_tile] = -cutlass.Float32.inf

    @cute.jit
    def _row_max(self, s_rc: cute.Tensor, i: cutlass.Constexpr, n_cols: cutlass.Constexpr
                 ) -> cutlass.Float32:
        """Max of this thread's columns of row i, as four independent chains (short latency)."""
        m0 = s_rc[i, 0]
        m1 = s_rc[i, 1]
        m2 = s_rc[i, 2]
        m3 = s_rc[i, 3]
        for j in cutlass.range_constexpr(1, n_cols // 4):
            m0 = cute.arch.fmax(m0, s_rc[i, 4 * j])
            m1 = cute.arch.fmax(m1, s_rc[i, 4 * j + 1])
            m2 = cute.arch.fmax(m2, s_rc[i, 4 * j + 2])
            m3 = cute.arch.fmax(m3, s_rc[i, 4 * j + 3])
        return cute.arch.fmax(cute.arch.fmax(m0, m1), cute.arch.fmax(m2, m3))

    @cute.jit
    def _tile_base(self, mK: cute.Tensor, mPageTable: cute.Tensor, request: cutlass.Int32,
                   k_row0: cutlass.Int32, tile: cutlass.Int32) -> cutlass.Int32:
        """Dense: the K row of the tile's first key. Paged: its page, or -1 if the table has
        no valid page for it."""
        base = k_row0 + tile * BLOCK_N
        if cutlass.const_expr(self.paged):
            base = -1
            if tile < mPageTable.shape[1]:
                base = mPageTable[request, tile]
            if base >= mK.shape[0]:
                base = -1
        return base

    @cute.jit
    def _tile_key_count(self, mK: cute.Tensor, mPageTable: cute.Tensor, request: cutlass.Int32,
                        k_row0: cutlass.Int32, k_len: cutlass.Int32,
                        tile: cutlass.Int32) -> cutlass.Int32:
        """Keys of the tile that exist and may be read: 0 .. 128."""
        n_keys = cutlass.min(k_len - tile * BLOCK_N, BLOCK_N)
        base = self._tile_base(mK, mPageTable, request, k_row0, tile)
        if cutlass.const_expr(self.paged):
            if base < 0:
                n_keys = 0
        else:
            n_keys = cutlass.min(n_keys, mK.shape[0] - base)
        return cutlass.max(n_keys, 0)

    @cute.jit
    def _load_k_tile(self, mK: cute.Tensor, mPageTable: cute.Tensor, request: cutlass.Int32,
                     k_row0: cutlass.Int32, k_len: cutlass.Int32, tile: cutlass.Int32,
                     stage: cutlass.Int32, sK_stages: cute.Tensor, thr_k_copy,
                     k_copy: cute.TiledCopy, tKcK: cute.Tensor, k_row_stride0: cute.Layout):
        """Issue the cp.async loads of K tile `tile` into `stage`; rows past the readable keys
        are skipped (stale shared memory, masked in the epilogue)."""
        n_keys = self._tile_key_count(mK, mPageTable, request, k_row0, k_len, tile)
        base = self._tile_base(mK, mPageTable, request, k_row0, tile)
        tKsK = thr_k_copy.partition_D(sK_stages[None, None, stage])
        for m in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
            key = tKcK[0, m, 0][0]
            if key < n_keys:
                k_ptr = kv_row_iterator(mK, self.paged, base, 0, key)
                gK = thr_k_copy.partition_S(cute.make_tensor(k_ptr, k_row_stride0))
                cute.copy(k_copy, gK[None, m, None], tKsK[None, m, None])
