"""Compiled kernels carried with an engine directory (Triton's cache, keyed by GPU and Triton)."""
