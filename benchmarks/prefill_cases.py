"""MiniMax-M3's production chunked-prefill cases (upstream's 66 representative cases) for the
benchmarks: per-request query and prefix lengths, production weights, and the work counts.

The table is benchmarks/prefill_cases_v1.json (numbers derived from MiniMax-AI/MSA, MIT; see its
"provenance"). A case is one prefill call: request r has prefix_lens[r] cached keys (a multiple
of 128) and query_lens[r] new tokens, so kv_len = prefix + q_len and query i sits at position
prefix + i (bottom-right causal). Every case carries upstream's exact lengths: a batch-1 row's
follow from (total_q, max_final_kv); a multi-request row's are listed under "request_lengths",
transcribed from upstream's manifest. Upstream names a case by the SHA-256 of its lengths
(``upstream_case_id``), so loading checks each case's lengths against its id.

    python benchmarks/prefill_cases.py          # prints the table with the work counts
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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
    source: str                 # "upstream" (the table) or "synthetic" (tiny_cases)

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


def upstream_case_id(query_lens: Sequence[int], prefix_lens: Sequence[int]) -> str:
    """Upstream's case id: 'prefill_' + the first 20 hex digits of the SHA-256 of the case's
    canonical shape (sorted-key, separator-free JSON of batch_size, prefix_lens, query_lens)."""
    shape = {"batch_size": len(query_lens), "prefix_lens": list(prefix_lens),
             "query_lens": list(query_lens)}
    text = json.dumps(shape, separators=(",", ":"), sort_keys=True)
    return "prefill_" + hashlib.sha256(text.encode()).hexdigest()[:20]


def load_cases(path: Optional[Path] = None) -> List[PrefillCase]:
    """The 66 representative cases in table order, each checked against its row and its
    upstream case id."""
    data = json.loads(Path(path or TABLE).read_text())
    columns = data["columns"]
    exact = data.get("request_lengths", {})
    cases = []
    for values in data["cases"]:
        row = dict(zip(columns, values))
        cid, batch = row["case_id"], row["batch_size"]
        total_q, max_kv = row["total_q"], row["max_final_kv"]
        if batch == 1:
            query_lens, prefix_lens = (total_q,), (max_kv - total_q,)
        elif cid in exact:
            query_lens = tuple(exact[cid]["query_lens"])
            prefix_lens = tuple(exact[cid]["prefix_lens"])
        else:
            raise ValueError(f"{cid}: a {batch}-request case without request_lengths")
        case = PrefillCase(cid, int(row["weight"]), query_lens, prefix_lens, "upstream")
        if (case.batch, case.total_q, case.max_kv) != (batch, total_q, max_kv) \
                or len(prefix_lens) != batch or any(p % BLOCK for p in prefix_lens):
            raise ValueError(f"{cid}: lengths {query_lens} / {prefix_lens} do not match the "
                             f"table row {values}")
        if upstream_case_id(query_lens, prefix_lens) != cid:
            raise ValueError(f"{cid}: lengths {query_lens} / {prefix_lens} hash to "
                             f"{upstream_case_id(query_lens, prefix_lens)}")
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
