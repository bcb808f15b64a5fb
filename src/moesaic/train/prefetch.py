"""Where :class:`~moesaic.strategies.prefetch.ExpertPrefetcher` used to live (kept for
``benchmarks/hybridep_cluster.py`` and other callers of the old path): it is now ``hybrid``'s
training hooks, beside the strategy (``moesaic.strategies.prefetch``)."""

from __future__ import annotations

from moesaic.strategies.prefetch import ExpertPrefetcher

__all__ = ["ExpertPrefetcher"]
