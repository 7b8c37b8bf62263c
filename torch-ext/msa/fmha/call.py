"""The validated dense / block-selected fmha call: what every backend of ``"fmha_dense"`` and
``"fmha_max_score"`` (the native glue, the reference, the torch.compile custom op) receives."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from .validation import TILE


@dataclasses.dataclass
class FmhaDenseCall:
    """One validated dense / block-selected fmha call, as every backend receives it."""
    q: torch.Tensor                        # [total_q, Hq, 128] bf16 | e4m3
    k: torch.Tensor                        # dense [total_k, Hkv, 128] | paged [P, Hkv, ps, 128]
    v: torch.Tensor
    plan: dict
    qo_offset: torch.Tensor                # [B] int32 on q's device
    host_qo_offset: Optional[List[int]]    # the same on the host when known without a sync
    page_table: Optional[torch.Tensor]     # [B, max_pages] int32 (paged)
    kv_block_indexes: Optional[torch.Tensor]   # [total_q, Hkv, kv_block_num] int32 (sparse)
    logit_scale: float                     # sm_scale * q_scale * k_scale
    output_scale: float                    # v_scale * o_scale
    want_o: bool
    max_k_tiles: int                       # > 0: emit max-score [Hq, max_k_tiles, total_q]
    out_dtype: torch.dtype

    @property
    def paged(self) -> bool:
        return self.k.dim() == 4

    @property
    def mode(self) -> int:
        """Upstream mode code: 0 sparse, 1 O + max-score, 2 max-score only, 3 O only."""
        if self.kv_block_indexes is not None:
            return 0
        if self.max_k_tiles > 0:
            return 1 if self.want_o else 2
        return 3

    def features(self) -> dict:
        return dict(q_dtype=self.q.dtype, k_dtype=self.k.dtype, paged=self.paged,
                    page_size=self.k.shape[2] if self.paged else -1,
                    causal=self.plan["causal"], mode=self.mode,
                    qhead_per_kv=self.q.shape[1] // self.k.shape[1],
                    num_qo_heads=self.q.shape[1], num_kv_heads=self.k.shape[1],
                    work_items=self.work_items,
                    kv_splits=int(self.plan.get("num_kv_splits", 1) or 1))

    @property
    def q_tiles(self) -> int:
        """128-query tiles of the longest request, at least 1 (a query-outer grid's x extent)."""
        return max(-(-int(self.plan.get("max_seqlen_q", 0)) // TILE), 1)

    @property
    def work_items(self) -> int:
        """(128-query tile, q head, request) items of a query-outer kernel grid."""
        return self.q_tiles * self.q.shape[1] * int(self.plan.get("batch", 1))
