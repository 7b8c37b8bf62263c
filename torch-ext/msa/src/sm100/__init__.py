"""Upstream import paths (`msa.src.sm100.*`), kept for clients; the code is hardware-neutral."""
