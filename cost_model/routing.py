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

**A measured router** (``shares``: the fraction ``p_e`` of all routed rows that expert e received, summing to 1,
as :func:`autotp.measure_expert_load` counts them) replaces the uniform ``1/E`` in both quantities:

- one token picks expert e with probability ``pi_e = min(1, k p_e)``. This is exact for any router whose k
  picks are distinct: the rows expert e gets from T tokens are ``T pi_e`` in expectation, and they are
  ``T k p_e`` by the measurement's definition. With tokens independent, e is missed by all T with
  ``(1 - pi_e)^T``, so ``sum_e 1 - (1 - pi_e)^T`` experts are hit (:func:`experts_hit_of_shares`; ``E (1 - (1 -
  k/E)^T)`` when every ``p_e = 1/E``). Tokens of one batch that share a topic are not independent: the
  measured count of experts hit is then lower, and the formula errs towards reading more weights.
- a rank holding the experts S gets, from one token, a number of rows with mean ``k P`` (``P = sum_{e in S}
  p_e``, exact) and variance ``k P (1 - P) (E - k)/(E - 1)``: the hypergeometric variance of the uniform case
  with ``n/E`` replaced by ``P``. The joint picks of a skewed top-k draw are not known from the shares; this
  keeps the finite-population factor of k distinct picks (0 when ``k = E``), and it is exact for a uniform
  router. Over T tokens: T times both. The ranks' rows are taken as independent normal values (they are
  slightly negatively correlated, as they sum to ``T k``), and the busiest rank's expected rows are the
  expected maximum of those normals, integrated numerically (:func:`expected_max_of_independent_normals`; for
  equal ranks it is Royston's ``mean + sd c(p)``), never more than the most rows a rank can take (``T min(k,
  n_r)``) and never less than the largest mean (:func:`busiest_rank_rows_of_shares`). Rank r holds the
  contiguous experts ``first .. first + n_r - 1`` (:func:`even_expert_counts`, the larger parts first), so a
  skewed router loads the rank that holds its favourite experts.

A Monte-Carlo check (tests/test_expert_load.py: tokens drawn by a top-k over Gumbel-perturbed logits, a fixed
seed) puts both within a few percent of the drawn values.

Pure functions of counts; they import nothing of autotp.
"""

from __future__ import annotations

import math

__all__ = ["busiest_rank_rows", "busiest_rank_rows_of_shares", "even_expert_counts", "expected_experts_hit",
           "expected_max_of_independent_normals", "expected_max_of_normals", "experts_hit_of_shares", "experts_hit_per_rank",
           "rank_rows_of_shares"]

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


def even_expert_counts(experts: int, ranks: int) -> list[int]:
    """Experts each of ``ranks`` ranks holds when ``experts`` are split evenly by whole experts, the larger parts
    first (rank r holds the contiguous experts after those of ranks 0 .. r-1), as the plan's split of dim 0 cuts."""
    base, extra = divmod(experts, ranks)
    return [base + (1 if rank < extra else 0) for rank in range(ranks)]


def _check_shares(shares: tuple[float, ...]) -> None:
    if len(shares) < 1 or any(p < 0 for p in shares) or abs(sum(shares) - 1.0) > 1e-6:
        raise ValueError(f"shares must be non-negative fractions of the routed rows summing to 1, got {shares}")


def experts_hit_of_shares(tokens: float, top_k: int, shares: tuple[float, ...]) -> float:
    """Experts that receive at least one row when ``tokens`` independent tokens each pick ``top_k`` distinct experts,
    expert e with probability ``min(1, top_k * shares[e])`` (module docstring)."""
    _check_shares(shares)
    if tokens <= 0:
        return 0.0
    return sum(experts_hit_per_rank(tokens, top_k, shares, [len(shares)]))


def experts_hit_per_rank(tokens: float, top_k: int, shares: tuple[float, ...], counts: list[int]) -> list[float]:
    """Per rank, the experts hit among the ``counts[r]`` contiguous experts it holds (from expert 0), as
    :func:`experts_hit_of_shares` counts them."""
    _check_shares(shares)
    if sum(counts) != len(shares):
        raise ValueError(f"counts {counts} must add up to the {len(shares)} experts of shares")
    if tokens <= 0:
        return [0.0] * len(counts)
    k = min(top_k, len(shares))
    missed = [(1.0 - min(1.0, k * p)) ** tokens for p in shares]
    found, first = [], 0
    for count in counts:
        found.append(sum(1.0 - m for m in missed[first:first + count]))
        first += count
    return found


def rank_rows_of_shares(tokens: float, top_k: int, shares: tuple[float, ...], counts: list[int]
                        ) -> list[tuple[float, float]]:
    """Per rank, the ``(mean, variance)`` of the rows it computes when rank r holds the next ``counts[r]`` experts
    (contiguous, from expert 0) and ``tokens`` tokens each pick ``top_k`` distinct experts by ``shares``."""
    _check_shares(shares)
    experts = len(shares)
    if sum(counts) != experts:
        raise ValueError(f"counts {counts} must add up to the {experts} experts of shares")
    k = min(top_k, experts)
    spread = (experts - k) / (experts - 1) if experts > 1 else 0.0  # k distinct picks: finite-population factor
    found, first = [], 0
    for count in counts:
        share = min(1.0, sum(shares[first:first + count]))
        found.append((tokens * k * share, tokens * k * share * (1.0 - share) * spread))
        first += count
    return found


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def expected_max_of_independent_normals(moments: list[tuple[float, float]], points: int = 801) -> float:
    """E[max] of independent normal values with the given ``(mean, variance)`` each, by the trapezoid rule over
    ``E[M] = lo + integral_lo^hi (1 - prod_r Phi((x - mean_r) / sd_r)) dx`` on ``[lo, hi]`` = the means -/+ 9
    standard deviations (the tails beyond add less than 1e-18 of a standard deviation); a value of variance 0
    is a step at its mean."""
    if not moments:
        raise ValueError("expected_max_of_independent_normals needs at least one (mean, variance)")
    sds = [math.sqrt(max(0.0, var)) for _, var in moments]
    lo = min(mean - 9.0 * sd for (mean, _), sd in zip(moments, sds))
    hi = max(mean + 9.0 * sd for (mean, _), sd in zip(moments, sds))
    if hi <= lo:
        return lo

    def below(x: float) -> float:  # P(max <= x)
        prob = 1.0
        for (mean, _), sd in zip(moments, sds):
            prob *= _normal_cdf((x - mean) / sd) if sd > 0 else (1.0 if x >= mean else 0.0)
        return prob

    step = (hi - lo) / (points - 1)
    above = [1.0 - below(lo + i * step) for i in range(points)]
    return lo + step * (sum(above) - 0.5 * (above[0] + above[-1]))


def busiest_rank_rows_of_shares(tokens: float, top_k: int, shares: tuple[float, ...], counts: list[int]) -> float:
    """Expected rows of the busiest rank when rank r holds the next ``counts[r]`` experts (contiguous, from expert 0)
    and ``tokens`` tokens each pick ``top_k`` distinct experts by ``shares`` (module docstring)."""
    if tokens <= 0:
        return 0.0
    moments = rank_rows_of_shares(tokens, top_k, shares, counts)
    k = min(top_k, len(shares))
    ceiling = max(tokens * min(k, count) for count in counts)
    largest_mean = max(mean for mean, _ in moments)
    return min(max(expected_max_of_independent_normals(moments), largest_mean), ceiling)
