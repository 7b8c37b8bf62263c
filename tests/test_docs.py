"""The repository's text stays consistent with docs/contract.md: every "§x" citation names a
section of the contract and every "contract Dn" names a row of its drift table; run logs stay
out of the repository (git-ignored; the TSV rows under benchmarks/results/ are the record), so
no file may cite them."""

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "docs" / "contract.md"
TEXT_SUFFIXES = {".py", ".md", ".cu", ".cuh", ".h", ".cpp", ".sh", ".toml"}
SKIP_DIRS = {"build", "__pycache__"}


def _text_files():
    """(path relative to the repository, text) of every source and doc file; hidden folders
    (.venv, .artifacts, ...) and build outputs are not walked."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix in TEXT_SUFFIXES:
                yield path.relative_to(ROOT), path.read_text(encoding="utf-8", errors="replace")


def _contract_sections():
    text = CONTRACT.read_text(encoding="utf-8")
    sections = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, flags=re.M))
    rows = set(re.findall(r"^\| D(\d+) \|", text, flags=re.M))
    return sections, rows


def test_contract_has_its_numbered_sections():
    sections, rows = _contract_sections()
    assert {"0", "1", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "2", "2.1", "2.2", "2.3", "2.4",
            "3", "5", "5.1", "5.2", "5.3", "6"} <= sections
    assert {str(n) for n in range(1, 22)} <= rows


def test_every_citation_names_an_existing_contract_section():
    sections, rows = _contract_sections()
    missing = []
    for rel, text in _text_files():
        for number in re.findall(r"§ ?(\d+(?:\.\d+)?)", text):
            if number not in sections:
                missing.append(f"{rel}: §{number}")
        for group in re.findall(r"contract (D\d+(?:/D\d+)*)", text):
            missing += [f"{rel}: {d}" for d in group.split("/") if d[1:] not in rows]
    assert not missing, "citations of contract sections that do not exist: " + ", ".join(missing)


def test_no_file_cites_run_logs():
    cited = [str(rel) for rel, text in _text_files() if rel != Path("tests/test_docs.py") and (
        "results/logs" in text or (rel.suffix == ".md" and re.search(r"\blogs/\w", text)))]
    assert not cited, "files citing benchmarks/results/logs: " + ", ".join(cited)
