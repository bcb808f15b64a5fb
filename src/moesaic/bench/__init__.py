"""Benchmarks behind ``moesaic bench``: results are JSON with machine, versions and config."""
