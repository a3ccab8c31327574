"""Speculative decoding testbed: backend-neutral core (config, algorithms, results, reports)."""

__version__ = "0.1.0"
