"""Upstream's module paths (``msa.src.sm100.*``), kept for clients as re-exports."""
