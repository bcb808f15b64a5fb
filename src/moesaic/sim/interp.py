"""Interpolation of measured ``(x, y)`` points over a size axis (bytes, rows): linear in log x
between the measured sizes, the nearest measured value outside them."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def log_linear(points: Sequence[tuple[float, float]], x: float, empty: float = 1.0) -> float:
    """``y`` at ``x`` from ``points`` sorted by increasing ``x > 0``; ``empty`` when there
    are none."""
    if not points:
        return empty
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0) if x1 > x0 else 1.0
            return y0 + w * (y1 - y0)
    return points[-1][1]
