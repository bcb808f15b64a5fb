"""Where experts live: which rank holds which expert (HybridEP's domains will build on this)."""

from moesaic.placement.base import ExpertPlacement

__all__ = ["ExpertPlacement"]
