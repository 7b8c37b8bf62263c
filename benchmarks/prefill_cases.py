"""MiniMax-M3's production chunked-prefill cases (upstream's 66 representative cases) for the
benchmarks: per-request query and prefix lengths, production weights, and the work counts.

The table is benchmarks/prefill_cases_v1.json (numbers derived from MiniMax-AI/MSA, MIT; see its
"provenance"). A case is one prefill call: request r has prefix_lens[r] cached keys (a multiple
of 128) and query_lens[r] new tokens, so kv_len = prefix + q_len and query i sits at position
prefix + i (bottom-right causal). Batch-1 cases are exact. Multi-request cases whose lengths are
not in the table get a deterministic split of (total_q, max_final_kv) seeded by the case id
(source "synthetic"), shaped like upstream's rows (query lengths ascending, one request holding
max_final_kv, prefixes 128-aligned).

    python benchmarks/prefill_cases.py          # prints the table with the work counts
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path
from typing import List, Optional, Sequence

TABLE = Path(__file__).resolve().with_name("prefill_cases_v1.json")
BLOCK = 128
TOPK = 16


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    case_id: str
    weight: int
    query_lens: tuple
    prefix_lens: tuple
    source: str                 # "upstream" (exact lengths) or "synthetic"

    @property
    def batch(self) -> int:
        return len(self.query_lens)

    @property
    def kv_lens(self) -> tuple:
        return tuple(p + q for p, q in zip(self.prefix_lens, self.query_lens))

    @property
    def total_q(self) -> int:
        return sum(self.query_lens)

    @property
    def max_kv(self) -> int:
        return max(self.kv_lens)

    def selected_keys(self, topk: int = TOPK) -> int:
        """Visible keys of the selections the pipeline makes on random inputs, summed over
        queries (per KV head): the own block up to the query plus min(topk, own + 1) - 1 full
        earlier blocks (every earlier block scores finite, so top-k fills its slots)."""
        total = 0
        for q_len, prefix in zip(self.query_lens, self.prefix_lens):
            total += sum(_selected_keys_at(prefix + i, topk) for i in range(q_len))
        return total

    def dense_keys(self) -> int:
        """Keys a dense bottom-right causal attention visits, summed over queries."""
        return sum(q * p + q * (q + 1) // 2 for q, p in zip(self.query_lens, self.prefix_lens))


def _selected_keys_at(position: int, topk: int) -> int:
    own = position // BLOCK
    return (min(topk, own + 1) - 1) * BLOCK + position % BLOCK + 1


def attention_flops(keys: int, num_qo_heads: int, head_dim: int = 128) -> int:
    """4 * D * (query heads) * keys: QK^T and PV, 2 FLOPs per multiply-add (upstream's count)."""
    return 4 * head_dim * num_qo_heads * keys


def synthetic_split(case_id: str, batch: int, total_q: int, max_kv: int):
    """(query_lens, prefix_lens) of `batch` requests with the case's total_q and max_final_kv,
    deterministic in the case id: skewed query shares (ascending, each >= 1), one request at
    max_final_kv, the others' final lengths drawn in [q, max_kv], every prefix a multiple of 128."""
    rng = random.Random(int.from_bytes(hashlib.sha256(case_id.encode()).digest()[:8], "little"))
    shares = [rng.expovariate(1.0) ** 2 + 1e-3 for _ in range(batch)]
    q = [max(1, int(total_q * s / sum(shares))) for s in shares]
    q[q.index(max(q))] += total_q - sum(q)
    q.sort()
    top = rng.randrange(batch)
    # Request `top` ends exactly at max_kv: its prefix max_kv - q must be a multiple of 128;
    # move the remainder to or from another request.
    if batch > 1:
        other = max((i for i in range(batch) if i != top), key=lambda i: q[i])
        r = (max_kv - q[top]) % BLOCK              # q[top] + r or q[top] - (128 - r) fits
        if q[other] > r:
            q[top] += r
            q[other] -= r
        elif r and q[top] > BLOCK - r:
            q[top] -= BLOCK - r
            q[other] += BLOCK - r
    prefix = []
    for i, n in enumerate(q):
        room = max(max_kv - n, 0) // BLOCK
        blocks = room if i == top else int(room * rng.uniform(0.25, 1.0))
        prefix.append(blocks * BLOCK)
    return tuple(q), tuple(prefix)


def load_cases(path: Optional[Path] = None) -> List[PrefillCase]:
    """The 66 representative cases in table order."""
    data = json.loads(Path(path or TABLE).read_text())
    columns = data["columns"]
    exact = data.get("request_lengths", {})
    cases = []
    for values in data["cases"]:
        row = dict(zip(columns, values))
        cid, batch = row["case_id"], row["batch_size"]
        total_q, max_kv = row["total_q"], row["max_final_kv"]
        if batch == 1:
            lens, source = ((total_q,), (max_kv - total_q,)), "upstream"
        elif cid in exact:
            lens, source = (tuple(exact[cid]["query_lens"]),
                            tuple(exact[cid]["prefix_lens"])), "upstream"
        else:
            lens, source = synthetic_split(cid, batch, total_q, max_kv), "synthetic"
        case = PrefillCase(cid, int(row["weight"]), lens[0], lens[1], source)
        if case.total_q != total_q or case.batch != batch or any(p % BLOCK for p in lens[1]):
            raise ValueError(f"{cid}: lengths {lens} do not match the table row {values}")
        if source == "upstream" and case.max_kv != max_kv:
            raise ValueError(f"{cid}: max_final_kv {case.max_kv} != {max_kv}")
        cases.append(case)
    return cases


def tiny_cases() -> List[PrefillCase]:
    """Small cases for CPU smoke runs: one short chunk, a multi-request batch, a self prefill."""
    return [PrefillCase("tiny_short", 3, (40,), (512,), "synthetic"),
            PrefillCase("tiny_batch", 2, (20, 150), (256, 384), "synthetic"),
            PrefillCase("tiny_self", 1, (300,), (0,), "synthetic")]


def select_cases(cases: Sequence[PrefillCase], spec: str) -> List[PrefillCase]:
    """`spec`: '' (all), or comma-separated case ids, id prefixes or table indices."""
    if not spec:
        return list(cases)
    chosen = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item.isdigit():
            chosen.append(cases[int(item)])
            continue
        match = [c for c in cases if c.case_id == item or c.case_id.startswith(item)]
        if not match:
            raise SystemExit(f"--cases: no case matches {item!r}")
        chosen.extend(match)
    return chosen


# A spread of shapes for --quick: short chunks (171 / 55k, 182 / 17.7k, 347 / 131k), a 1.6k
# chunk, a 10k batch of 10, a 16k chunk against 47.7k and 174k keys.
QUICK_CASES = "prefill_4469427d,prefill_092e2734,prefill_86678b01,prefill_247ae467,"\
              "prefill_d1bcfda6,prefill_c17ccf7f,prefill_d29bd020"


if __name__ == "__main__":
    for c in load_cases():
        sel, dense = c.selected_keys(), c.dense_keys()
        print(f"{c.case_id} w={c.weight:5d} B={c.batch:2d} q={c.total_q:6d} kv={c.max_kv:7d} "
              f"{c.source:9s} sparse/dense keys {sel / dense:.4f}")
