"""Load of a mixture-of-experts layer under its router: rows per rank and experts hit, in expectation.

A router sends each of ``tokens`` tokens to ``top_k`` distinct experts of ``experts``; by default every expert is
equally likely (a uniform router, the expectation over a trained router's balanced load). Two quantities price an
expert layer:

- **experts hit**: a grouped GEMM reads the weights of the experts that received rows, not the others (the loop of
  ``grouped_mm_fallback`` skips empty groups). An expert is missed by one token with probability ``1 - k/E``, by
  all ``T`` with ``(1 - k/E)^T``, so ``E (1 - (1 - k/E)^T)`` are hit in expectation.
- **rows on the busiest rank** when whole experts are placed on ranks (rank r holds ``n_r`` of them): one token
  puts a hypergeometric number of its k rows on rank r (mean ``k n/E``, variance
  ``k (n/E)(1 - n/E)(E - k)/(E - 1)``); over T independent tokens the count has T times that mean and variance.
  The busiest of ``ranks`` ranks carries about ``mean + sd * c(ranks)`` rows, c(p) the expected maximum of p
  standard normal values (normal approximation of the sum; Royston 1982 tabulates c), and never more than
  ``T min(k, n)``. Two tokens of top-2 of 8 experts over 2 ranks: exactly ``1 + 3/7 = 1.43`` on the busier rank
  for one token; the formula gives 1.37.

Pure functions of counts; they import nothing of autotp.
"""

from __future__ import annotations

import math

__all__ = ["busiest_rank_rows", "expected_experts_hit", "expected_max_of_normals"]

_EXPECTED_MAX_OF_NORMALS = {1: 0.0, 2: 0.5642, 3: 0.8463, 4: 1.0294, 5: 1.1630, 6: 1.2672, 7: 1.3522, 8: 1.4236}
"""E[max of p standard normal values] (Royston 1982, Algorithm AS 177 tables); above 8, sqrt(2 ln p) bounds it."""


def expected_max_of_normals(count: int) -> float:
    """The expected largest of ``count`` independent standard normal values (module docstring)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    return _EXPECTED_MAX_OF_NORMALS.get(count, math.sqrt(2 * math.log(count)))


def expected_experts_hit(tokens: float, top_k: int, experts: int) -> float:
    """Experts that receive at least one row when ``tokens`` tokens each pick ``top_k`` of ``experts`` uniformly."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    k = min(top_k, experts)
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


def busiest_rank_rows(tokens: float, top_k: int, experts: int, held: int, ranks: int) -> float:
    """Rows (token-expert pairs) of the rank holding ``held`` of ``experts`` experts, the busiest of ``ranks``
    ranks, when ``tokens`` tokens each pick ``top_k`` distinct experts uniformly (module docstring)."""
    if tokens <= 0 or held <= 0 or experts <= 0:
        return 0.0
    k = min(top_k, experts)
    share = held / experts
    mean = tokens * k * share
    spread = (experts - k) / (experts - 1) if experts > 1 else 0.0
    sd = math.sqrt(tokens * k * share * (1 - share) * spread)
    return min(mean + sd * expected_max_of_normals(ranks), tokens * min(k, held))
