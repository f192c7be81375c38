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
phase, and the comparison uses the planner's own predicted times (:attr:`Plan.predicted_time_s`) and what each
call pays once beyond them (:attr:`PhaseCandidate.decode_call_s`).

Phases run by one rank alone (:func:`first_rank_alone`): on ranks that share one host's cores (a
gloo group of CPU processes), a phase whose plan issues no collective is run by the group's first
rank while the others wait, so it gets a whole core, where the planner's profile prices every rank
computing at once (``Hardware.core_share``: about 1/2 for four single-thread ranks on two cores).
The MILP cannot see that (it prices per op, on one profile), so where it can happen a third
candidate is compared: every tensor whole in both phases (:func:`keep_whole`), priced on
``Hardware.alone()`` (which also drops the share's loss per call, ``Hardware.core_share_call_s``); and a candidate
whose decode plan has no collective is priced with that whole decode plan (its prompt too when it has none either),
as the runtime will run it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from autotp.base.placements import Replicate

if TYPE_CHECKING:
    from autotp.base.strategy import Strategy
    from autotp.passes.strategies import StrategyGraph
    from autotp.planning.plan import Plan

__all__ = ["DEFAULT_EXPECTED_NEW_TOKENS", "AlonePhases", "PhaseCandidate", "PhaseWeighting",
           "check_expected_new_tokens", "first_rank_alone", "keep_whole", "weigh_phases"]

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
class AlonePhases:
    """Which phases of generation the group's first rank runs alone while the other ranks wait."""

    decode: bool
    prefill: bool


def first_rank_alone(*, world_size: int, ranks_share_host: bool, decode_collectives: bool,
                     prefill_collectives: bool) -> AlonePhases:
    """The one rule, read by the planner and by :func:`autotp.runtime.generation.generate.generate`, for which phases
    one rank runs alone.

    With several ranks on one host's cores (``ranks_share_host``: a gloo group at run time, a profile
    with ``host_is_device`` at planning time), a decode plan without collectives would have every rank
    compute the same steps on the cores they share, so the first rank decodes alone and sends the tokens.
    The prompt runs alone too when the prefill plan has no collective either (``prefill_collectives``:
    False also where prompts go through the decode graph); with collectives every rank must run it.
    """
    decode = world_size > 1 and ranks_share_host and not decode_collectives
    return AlonePhases(decode=decode, prefill=decode and not prefill_collectives)


def keep_whole(graph: StrategyGraph) -> StrategyGraph:
    """A copy of ``graph`` (a ``strategy_filter``) where every node keeps only its strategies that split
    nothing: every input and the output replicated, as one rank runs the graph alone."""

    def whole(strategy: Strategy) -> bool:
        return all(isinstance(p, Replicate) for p in (*strategy.inputs, strategy.output))

    return dataclasses.replace(graph, strategies={name: [s for s in strategies if whole(s)]
                                                  for name, strategies in graph.strategies.items()})


@dataclasses.dataclass(frozen=True)
class PhaseCandidate:
    """One weight placement for both phases and the predicted seconds of each phase under it.

    ``placed_by``: the phase whose own optimal plan chose the weight and cache placements
    (``"decode"`` or ``"prefill"``), or ``"whole"`` (nothing split, both phases run by the first rank
    alone, priced on ``Hardware.alone()``); ``prefill``/``decode``: the two phases' plans with those
    placements.
    """

    placed_by: str
    prefill: Plan
    decode: Plan
    prefill_call_s: float = 0.0
    decode_call_s: float = 0.0

    def request_s(self, expected_new_tokens: int) -> float:
        """Predicted seconds of one prefill call plus ``expected_new_tokens`` decode steps, each call with what it pays
        once beyond its plan (``prefill_call_s``, ``decode_call_s``: the graph's and the model's call, and what ranks
        taking turns on shared cores lose at its start; ``cost_model.runtime.graph_host_s`` of the profile it runs
        on)."""
        return (self.prefill.predicted_time_s + self.prefill_call_s
                + expected_new_tokens * (self.decode.predicted_time_s + self.decode_call_s))


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
                f"  {mark} placed by {candidate.placed_by:<7}: prefill "
                f"{(candidate.prefill.predicted_time_s + candidate.prefill_call_s) * 1e6:9.1f} us"
                f" + {tokens} x decode {(candidate.decode.predicted_time_s + candidate.decode_call_s) * 1e6:8.1f} us"
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
