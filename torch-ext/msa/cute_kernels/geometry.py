"""Geometry and constants shared by the CuTe-DSL kernels of msa (plain Python values)."""

HEAD_DIM = 128           # channels per head, every kernel
BLOCK_N = 128            # keys per KV block = tokens per page = an index-key tile
WG_ROWS = 64             # rows of one warpgroup MMA (wgmma m64)
ROWS_PER_WARP = 16       # accumulator rows one warp owns (m16n8k16; a wgmma's warp row slice)
WARPGROUP_THREADS = 128
# The sparse kernels' packed query entries (qsplit): local query id | slot << SLOT_SHIFT.
SLOT_SHIFT = 24
LOCAL_QUERY_MASK = (1 << SLOT_SHIFT) - 1
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453
