"""Kernel-side modules, grouped by the upstream architecture names clients import."""
