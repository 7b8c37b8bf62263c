"""Upstream's import paths (``msa.src.sm100.prepare_scheduler``, ``msa.src.sm100.fp4_indexer``),
kept for clients as thin re-exports; the code is hardware-neutral and lives in
:mod:`msa.schedules` and :mod:`msa._fp4_format`."""
