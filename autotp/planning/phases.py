"""Weigh the two phases of generation: one weight placement for prefill and decode together.

A model compiled for generation runs two graphs over one set of weight shards and one KV
cache: *prefill* (the prompt, ``seq`` tokens per row per call) once per request and *decode*
(one token per row) once per new token. The placement of every weight and cache is shared,
so it should minimise the work of a whole request::

    request_s = prefill_s + expected_new_tokens * decode_s

How it is chosen (exact for the two candidates it compares, not a joint optimum): each phase
is planned alone (its MILP optimum under the memory budget), then the *other* phase is planned
with that phase's weight and cache placements pinned (only its activations are free). That
gives two candidate pairs, "placed by decode" and "placed by prefill"; :func:`weigh_phases`
keeps the pair with the smaller ``request_s`` (ties go to decode). A joint MILP sharing the
parameter placement variables of both graphs could find a third placement better than both;
with the two-phase decomposition every candidate is a plan the planner proves optimal for one
phase, and the comparison uses the planner's own predicted times (:attr:`Plan.predicted_time_s`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotp.planning.plan import Plan

__all__ = ["DEFAULT_EXPECTED_NEW_TOKENS", "PhaseCandidate", "PhaseWeighting", "check_expected_new_tokens",
           "weigh_phases"]

DEFAULT_EXPECTED_NEW_TOKENS = 128
"""Decode steps per prefill assumed by default: a typical chat/completion answer length (HF's
``generate`` default is 20 new tokens; serving benchmarks commonly use 128)."""


def check_expected_new_tokens(value: object) -> int:
    """``value`` if it is an int >= 0; otherwise a ValueError that says what to pass."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"expected_new_tokens must be an int >= 0 (decode steps per prompt, to weigh decode against prefill "
            f"when placing the weights), got {value!r}; e.g. expected_new_tokens=128"
        )
    return value


@dataclasses.dataclass(frozen=True)
class PhaseCandidate:
    """One weight placement for both phases and the predicted seconds of each phase under it.

    ``placed_by``: the phase whose own optimal plan chose the weight and cache placements
    (``"decode"`` or ``"prefill"``); ``prefill``/``decode``: the two phases' plans with those
    placements.
    """

    placed_by: str
    prefill: Plan
    decode: Plan

    def request_s(self, expected_new_tokens: int) -> float:
        """Predicted seconds of one prefill call plus ``expected_new_tokens`` decode steps."""
        return self.prefill.predicted_time_s + expected_new_tokens * self.decode.predicted_time_s


@dataclasses.dataclass(frozen=True)
class PhaseWeighting:
    """The candidates compared, the weight given to decode, and which candidate was kept."""

    expected_new_tokens: int
    candidates: tuple[PhaseCandidate, ...]
    chosen: PhaseCandidate

    def __str__(self) -> str:
        tokens = self.expected_new_tokens
        lines = [f"phase weights: prefill x1 + decode x{tokens} (expected_new_tokens={tokens})"]
        for candidate in self.candidates:
            mark = "chosen" if candidate is self.chosen else "      "
            lines.append(
                f"  {mark} placed by {candidate.placed_by:<7}: prefill {candidate.prefill.predicted_time_s * 1e6:9.1f} us"
                f" + {tokens} x decode {candidate.decode.predicted_time_s * 1e6:8.1f} us"
                f" = {candidate.request_s(tokens) * 1e3:9.3f} ms per request"
            )
        if len({tuple(sorted(c.decode.parameters.items())) for c in self.candidates}) == 1:
            lines.append("  (each phase alone chose the same weight and cache placements)")
        return "\n".join(lines)


def weigh_phases(candidates: list[PhaseCandidate], expected_new_tokens: int) -> PhaseWeighting:
    """The candidate with the least predicted ``prefill + expected_new_tokens x decode`` (first on ties)."""
    if not candidates:
        raise ValueError("weigh_phases needs at least one candidate placement")
    chosen = min(candidates, key=lambda c: c.request_s(expected_new_tokens))  # min keeps the first of equals
    return PhaseWeighting(expected_new_tokens=expected_new_tokens, candidates=tuple(candidates), chosen=chosen)
