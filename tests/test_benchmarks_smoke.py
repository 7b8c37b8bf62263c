"""Smoke test of the benchmark scripts: each runs its ``--device cpu --tiny`` configuration in a
subprocess (the PyTorch reference backends, time.perf_counter timing) and must write a TSV with
the shared header (gpu, commit, date, ...) and well-formed rows. Catches API drift between the
package and the benchmarks before a GPU session does.

bench_sparse_prefill.py is not run: it needs CUDA (a CUDA generator, torch.cuda.get_device_name)
and FlexAttention/cuDNN, and has no CPU mode.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def run_tiny(script: str, out: Path, *extra: str) -> str:
    env = dict(os.environ, MSA_COMMIT="smoketest", PYTHONPATH=str(ROOT / "torch-ext"))
    env.pop("MSA_PACKAGE_DIR", None)
    proc = subprocess.run([sys.executable, str(BENCH / script), "--device", "cpu", "--tiny",
                           "--out", str(out), *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def read_tsv(path: Path):
    lines = path.read_text().splitlines()
    header = lines[0].split("\t")
    rows = [line.split("\t") for line in lines[1:]]
    assert header[:3] == ["gpu", "commit", "date"]
    for row in rows:
        assert len(row) == len(header), f"ragged row {row} for header {header}"
        assert row[0] == "cpu" and row[1] == "smoketest"
    return header, [dict(zip(header, row)) for row in rows]


def latencies(rows, column):
    return [float(r[column]) for r in rows if r[column]]


def test_indexer_topk_tiny(tmp_path):
    out = tmp_path / "indexer_topk.tsv"
    run_tiny("bench_indexer_topk.py", out)
    header, rows = read_tsv(out)
    impls = {(r["op"], r["impl"]) for r in rows}
    assert {("indexer", "msa.block_max_scores"), ("indexer", "torch_naive_indexer"),
            ("topk", "msa.sparse_topk_select"), ("topk", "torch.topk")} <= impls
    assert {r["case"] for r in rows if r["op"] == "indexer"} == {"single", "varlen"}
    assert all(t > 0 for t in latencies(rows, "latency_ms"))
    # The msa scores agree with the naive indexer (the script's own sanity check).
    checks = [r["note"] for r in rows if r["impl"] == "msa.block_max_scores" and r["note"]]
    assert checks and all(c.startswith("max_rel_err=") for c in checks), checks

    # Appending: a second run adds rows under the same single header.
    run_tiny("bench_indexer_topk.py", out, "--ops", "topk")
    text = out.read_text()
    assert text.count("gpu\tcommit\tdate") == 1
    assert len(read_tsv(out)[1]) == len(rows) + 2


def test_msa_prefill_e2e_tiny(tmp_path):
    out = tmp_path / "prefill.tsv"
    run_tiny("bench_msa_prefill_e2e.py", out)
    _header, rows = read_tsv(out)
    for case in ("single", "varlen"):
        impls = {r["impl"]: r for r in rows if r["case"] == case}
        assert {"block_max_scores", "sparse_topk_select", "build_k2q_csr", "sparse_atten_func",
                "stage_sum", "msa_prefill", "cudnn_sdpa_causal"} <= set(impls)
        assert impls["msa_prefill"]["speedup_vs_cudnn"]
        assert impls["block_max_scores"]["backend"] == "reference"


def test_msa_prefill_e2e_stand_ins(tmp_path):
    """With every reference 'too slow', stages run on torch stand-ins and the run still ends
    cleanly (only the dense peer is written)."""
    out = tmp_path / "prefill.tsv"
    stdout = run_tiny("bench_msa_prefill_e2e.py", out, "--ref-max-tokens", "100",
                      "--varlen", "")
    _header, rows = read_tsv(out)
    assert [r["impl"] for r in rows] == ["cudnn_sdpa_causal"]
    assert "the backend is the PyTorch reference" in stdout


def test_prefill_production_tiny(tmp_path):
    """The production-prefill protocol's CPU parts: paged plan/run per case, the stage marks,
    the dense lower-right peer, the weighted aggregate; then the plot script's reading."""
    out = tmp_path / "prefill_production.tsv"
    run_tiny("bench_prefill_production.py", out)
    header, rows = read_tsv(out)
    cases = [r for r in rows if r["case"] != "weighted"]
    assert {r["case"] for r in cases} == {"tiny_short", "tiny_batch", "tiny_self"}
    for r in cases:
        assert float(r["latency_ms"]) > 0 and float(r["dense_ms"]) > 0 and r["speedup"]
        assert all(r[f"{s}_ms"] for s in ("indexer", "topk", "csr", "attention"))
        assert r["note"] == "", r["note"]            # the selection matched the FLOP count
    (weighted,) = [r for r in rows if r["case"] == "weighted"]
    assert weighted["weight"] == str(sum(int(r["weight"]) for r in cases))
    assert "min_speedup=" in weighted["note"]

    sys.path.insert(0, str(BENCH))
    from plot_prefill_production import load_run, series
    _label, plotted, weighted = load_run(out)
    assert len(plotted) == 3 and set(weighted) == {"paged bf16"}
    assert sorted(series(plotted)["paged bf16"]["total_q"]) == [40, 170, 300]


def test_prefill_production_forced_sparse_forms(tmp_path):
    """--sparse-forms: one run per form, tagged in impl, each with its weighted row."""
    out = tmp_path / "prefill_production.tsv"
    run_tiny("bench_prefill_production.py", out, "--no-breakdown", "--no-dense",
             "--sparse-forms", "served,ws3w")
    _header, rows = read_tsv(out)
    impls = [r["impl"] for r in rows if r["case"] == "weighted"]
    assert impls == ["msa_prefill_paged", "msa_prefill_paged[ws3w]"]
    assert len(rows) == 8


def test_prefill_production_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "prefill_production.tsv"
    run_tiny("bench_prefill_production.py", out, "--no-breakdown", "--impls", "paged,dense")
    sys.path.insert(0, str(BENCH))
    from plot_prefill_production import main as plot
    plot([str(out), "--out", str(tmp_path / "p.png")])
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_decode_tiny(tmp_path):
    out = tmp_path / "decode.tsv"
    run_tiny("bench_decode.py", out)
    _header, rows = read_tsv(out)
    combos = {(r["kv_dtype"], r["mode"], r["seqlen_q"]) for r in rows}
    for dtype in ("fp8", "bf16"):
        for mode in ("dense", "sparse", "step"):
            for seqlen_q in ("1", "4"):
                assert (dtype, mode, seqlen_q) in combos
    assert all(int(r["bytes_read"]) > 0 for r in rows)
    assert any(r["backend"] == "math" and r["speedup_vs_cudnn"] == "1.00" for r in rows)


def test_decode_production_tiny(tmp_path):
    out = tmp_path / "decode_production.tsv"
    run_tiny("bench_decode_production.py", out)
    _header, rows = read_tsv(out)
    impls = {"cudnn", "dense-bf16", "dense-fp8", "step-bf16", "step-fp8", "step-fp8-nvfp4"}
    timed = [r for r in rows if r["suite"] == "tiny"]
    assert {r["impl"] for r in timed} == impls
    assert all(float(r["latency_us"]) > 0 and int(r["bytes_read"]) > 0 for r in timed)
    assert {r["index_dtype"] for r in timed if r["impl"].startswith("step")} == {
        "bf16", "e4m3", "nvfp4"}
    assert {r["impl"] for r in rows if r["suite"] == "aggregate"} == impls
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(BENCH))
    from plot_decode_production import main as plot_main
    plot_main([str(out), "--out", str(tmp_path / "plot.png")])
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_decode_production_cases_are_upstreams_grid():
    sys.path.insert(0, str(BENCH))
    from bench_decode_production import production_cases, ragged_lengths
    cases = production_cases()
    production = [c for c in cases if c[0] == "production"]
    assert len(production) == 28 and sum(c[3] for c in production) == 10000
    assert {(c[1], c[2]) for c in cases if c[0] == "low-latency"} == {
        (b, kv) for b in (1, 2, 4) for kv in (1000, 4000, 8000, 32000)}
    for _suite, batch, nominal, _w in cases:
        lens = ragged_lengths(batch, nominal, 8)
        assert len(lens) == batch and sum(lens) == batch * nominal
        assert all(nominal - nominal // 4 <= n <= nominal + nominal // 4 for n in lens)
        assert lens == ragged_lengths(batch, nominal, 8)      # deterministic


def test_prefill_cases_are_upstreams_lengths():
    """Each of upstream's 66 representative prefill cases carries upstream's own per-request
    lengths: they match the table row (batch, total_q, max_final_kv), prefixes are whole 128-key
    blocks, requests come in ascending query length (upstream's order), and the lengths hash to
    the case's upstream id."""
    sys.path.insert(0, str(BENCH))
    from prefill_cases import TABLE, load_cases, upstream_case_id
    table = json.loads(TABLE.read_text())
    rows = [dict(zip(table["columns"], values)) for values in table["cases"]]
    cases = load_cases()
    assert len(cases) == len(rows) == 66
    assert sum(c.weight for c in cases) == 14805          # upstream's represented calls
    multi = {c.case_id for c in cases if c.batch > 1}
    assert len(multi) == 50 and set(table["request_lengths"]) == multi
    for case, row in zip(cases, rows):
        assert case.case_id == row["case_id"] and case.source == "upstream"
        assert (case.batch, case.total_q, case.max_kv) == (
            row["batch_size"], row["total_q"], row["max_final_kv"])
        assert len(case.prefix_lens) == case.batch and min(case.query_lens) >= 1
        assert all(p % 128 == 0 for p in case.prefix_lens)
        assert list(case.query_lens) == sorted(case.query_lens)
        assert upstream_case_id(case.query_lens, case.prefix_lens) == case.case_id


@pytest.mark.parametrize("change,message", [
    (lambda t, cid: t["request_lengths"].pop(cid), "without request_lengths"),
    (lambda t, cid: t["request_lengths"][cid]["query_lens"].__setitem__(0, 63),
     "do not match the table row"),
    (lambda t, cid: t["request_lengths"][cid]["prefix_lens"].__setitem__(0, 45312), "hash to"),
])
def test_prefill_cases_reject_wrong_lengths(tmp_path, change, message):
    """A table whose lengths disagree with a row, or with the row's upstream id, or that lacks
    a multi-request case's lengths, fails to load, naming the case."""
    sys.path.insert(0, str(BENCH))
    from prefill_cases import TABLE, load_cases
    table = json.loads(TABLE.read_text())
    cid = "prefill_d6866ca6a9a8e6365f9e"           # 3 requests: q 62, 160, 176
    change(table, cid)
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=f"{cid}.*{message}"):
        load_cases(path)


@pytest.mark.parametrize("text,expected", [("32k,64k", [32768, 65536]), ("1m", [1 << 20]),
                                           ("300, 8269", [300, 8269]), ("", [])])
def test_parse_sizes(text, expected):
    sys.path.insert(0, str(BENCH))
    from _common import parse_sizes
    assert parse_sizes(text) == expected


def test_fmha_tiny(tmp_path):
    out = tmp_path / "fmha.tsv"
    run_tiny("bench_fmha.py", out)
    header, rows = read_tsv(out)
    assert {(r["mode"], r["layout"]) for r in rows} == {("o", "dense"), ("o", "paged"),
                                                        ("max_score", "dense")}
    assert {r["causal"] for r in rows if r["mode"] == "o"} == {"0", "1"}
    assert all(t > 0 for t in latencies(rows, "latency_ms"))


def test_transformers_m3_tiny(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "m3.tsv"
    run_tiny("bench_transformers_m3.py", out)
    _header, rows = read_tsv(out)
    assert [r["impl"] for r in rows] == ["stock", "kernelized"]
    assert all(float(r["latency_ms"]) > 0 for r in rows)
    assert float(rows[1]["speedup_vs_stock"]) > 0 and rows[1]["note"] == "msa.layers"


def test_compare_runs_flags_a_slower_case(tmp_path):
    """compare_runs.py matches cases by their settings (not their figures or notes) and flags
    the ones slower than their last earlier row beyond the tolerance."""
    header = "gpu\tcommit\tdate\tcase\tdtype\tlatency_ms\ttflops\tnote\n"
    rows = ["H200\taaa\td1\t32k\tbf16\t10.0\t100\t\n",
            "H200\tbbb\td2\t32k\tbf16\t8.0\t125\t\n",        # the last row before the new run
            "H200\tbbb\td2\t32k\tfp8\t5.0\t200\t\n",
            "H200\tccc\td3\t32k\tbf16\t8.2\t122\tpower capped\n",
            "H200\tccc\td3\t32k\tfp8\t6.0\t167\t\n",
            "H200\tccc\td3\t64k\tfp8\t9.0\t300\t\n"]
    tsv = tmp_path / "x_h200.tsv"
    tsv.write_text(header + "".join(rows))
    proc = subprocess.run([sys.executable, str(BENCH / "compare_runs.py"), str(tsv)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = {tuple(line.split("\t")[:2]): line.split("\t") for line in proc.stdout.splitlines()}
    assert lines[("32k", "bf16")][-1] == "within (vs bbb)" and lines[("32k", "bf16")][2] == "8"
    assert lines[("32k", "fp8")][-1] == "slower (vs bbb)"
    assert lines[("64k", "fp8")][-1] == "new"
    assert "2 cases compared, 1 slower" in proc.stderr
    new = tmp_path / "new.tsv"
    new.write_text(header + rows[3])
    proc = subprocess.run([sys.executable, str(BENCH / "compare_runs.py"), str(new),
                           "--baseline", str(tsv)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "within (vs ccc)" in proc.stdout, proc.stdout + proc.stderr
