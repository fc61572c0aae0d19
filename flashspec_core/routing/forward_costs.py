"""What one target forward costs on this machine, by width and by context: the router's yardstick.

The router prices steps it did not run (a copy draft scored after the fact, a smaller γ of a model
draft) at what a verify pass of their width costs. A pass costs more the longer the cached
context: its attention reads every cached key and value once per pass, and more so for a wider
pass. Priced at a short context only, a pass after a long retrieved document costs about twice
its price, so a copy draft never run there is scored far above what it would run at. The
calibration therefore times every decode width at two contexts (backends/calibration.py); this
is the line through them.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# A pass never costs less than this share of its calibrated cost, however short its context: a
# line through two noisy points must not price a short context at nothing.
FLOOR = 0.25


class ForwardCosts:
    """Seconds of one forward: `seconds[w]` after `context` cached tokens, plus `slopes[w]` per
    cached token more. Empty (falsy, every price None) until `set` is called; one instance is
    shared by every domain of a router, so a new calibration reaches all of them."""

    def __init__(self) -> None:
        self._widths: list[int] = []
        self._seconds: list[float] = []
        self._slopes: list[float] = []
        self._line: dict[int, tuple[float, float]] = {}  # width -> (seconds, slope), interpolated once
        self.context = 0

    def set(self, seconds: Mapping[int, float], slopes: Mapping[int, float] | None = None, context: int = 0) -> None:
        """seconds: width -> seconds at `context` cached tokens; slopes: width -> extra seconds per
        cached token (missing: 0, a cost that does not depend on the context)."""
        slopes = dict(slopes or {})
        if any(not isinstance(w, int) or w < 1 or not t > 0 for w, t in seconds.items()):
            raise ValueError(f"seconds must map widths >= 1 to positive seconds; got {dict(seconds)!r}")
        if any(w not in seconds or not s >= 0 for w, s in slopes.items()):
            raise ValueError(f"slopes must map calibrated widths to seconds per token >= 0; got {slopes!r}")
        if not isinstance(context, int) or context < 0:
            raise ValueError(f"context must be an int >= 0 (cached tokens when timed); got {context!r}")
        self._widths = sorted(seconds)
        self._seconds = [float(seconds[w]) for w in self._widths]
        self._slopes = [float(slopes.get(w, 0.0)) for w in self._widths]
        self._line = {}
        self.context = context

    def __bool__(self) -> bool:
        return bool(self._widths)

    def _at(self, width: int) -> tuple[float, float]:
        """(seconds, slope) at `width`: piecewise-linear between calibrated widths, flat past either
        end. Memoised: the router prices a few hundred passes a step, and numpy's interp on a
        scalar costs microseconds."""
        line = self._line.get(width)
        if line is None:
            line = self._line[width] = (float(np.interp(width, self._widths, self._seconds)),
                                        float(np.interp(width, self._widths, self._slopes)))
        return line

    def at_width(self, width: int) -> float | None:
        """Seconds at the calibration's own context (None before `set`)."""
        return self._at(width)[0] if self._widths else None

    def __call__(self, width: int, context: int | None = None) -> float | None:
        """Seconds of a `width`-token pass after `context` cached tokens (None: the calibration's)."""
        if not self._widths:
            return None
        base, slope = self._at(width)
        if context is None or context <= 0:
            return base
        return max(FLOOR * base, base + slope * (context - self.context))
