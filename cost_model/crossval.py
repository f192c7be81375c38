"""Cross-validation by model family of the terms a calibrated CPU profile adds to its roofline.

Every number in a calibrated profile is fitted on micro-benchmarks and synthetic calibration graphs, never on
a model of the zoo. What *was* tuned on the zoo is which terms a profile has: each in-graph term
(:data:`TERMS`) was added to close a gap on the accuracy benchmark's own models. Whether such a choice holds
on models it was not made on is a question of cross-validation: choose the terms on some families, predict
the others, rotate. :func:`cross_validate` does that from observations that carry, per (family, world size,
round), the measured forward and the prediction with every subset of :data:`TERMS` removed
(``benchmarks/cost_model_heldout.py`` collects them).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

from .hardware import Hardware

__all__ = [
    "FoldResult", "HeldOutReport", "Observation", "TERMS", "Term", "cross_validate", "family_folds",
    "fitted_numbers", "subsets", "without",
]


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of a calibrated profile that can be left out: its ``name``, what it ``prices``, and
    ``remove``, the profile without it (the term priced at zero, everything else as fitted)."""

    name: str
    prices: str
    remove: Callable[[Hardware], Hardware]


TERMS: tuple[Term, ...] = (
    Term("core_share", "work terms divided by the share of a core a rank gets while every rank computes",
         lambda hardware: hardware.alone()),
    Term("op_fixed", "fixed cost per call of convolution, pooling, batch norm, attention (op_fixed_s)",
         lambda hardware: dataclasses.replace(hardware, op_fixed_s=())),
    Term("first_call", "the first call of each kernel in a call of a graph (first_call_s)",
         lambda hardware: dataclasses.replace(hardware, first_call_s=())),
    Term("model_call", "what a compiled model's call adds to its graph's call (model_call_s)",
         lambda hardware: dataclasses.replace(hardware, model_call_s=0.0)),
    Term("working_set_bandwidth", "memory-bound work at the bandwidth of the graph's working set",
         lambda hardware: dataclasses.replace(hardware, memory_bandwidth_curve=())),
    Term("cold_shared_memory", "a shared-memory collective whose slots the working set evicted",
         lambda hardware: dataclasses.replace(hardware, shared_memory_cold_call_s=0.0, shared_memory_cold_curve=())),
    Term("collective_wait", "wait per collective beyond its alpha-beta time (collective_wait_s)",
         lambda hardware: dataclasses.replace(hardware, collective_wait_s=0.0)),
    Term("call_sync_wait", "wait once per call with collectives, and per second of its compute",
         lambda hardware: dataclasses.replace(hardware, call_sync_wait_s=0.0, call_sync_wait_per_compute=0.0,
                                              call_sync_wait_compute_range_s=0.0)),
)
"""The in-graph terms a calibrated profile adds to the roofline, dispatch and link (which every profile has)."""

_TERM_NAMES = tuple(term.name for term in TERMS)


def without(hardware: Hardware, removed: Iterable[str]) -> Hardware:
    """``hardware`` with the :data:`TERMS` named in ``removed`` left out."""
    names = set(removed)
    unknown = names - set(_TERM_NAMES)
    if unknown:
        raise ValueError(f"unknown term(s) {sorted(unknown)}; the terms are {', '.join(_TERM_NAMES)}")
    for term in TERMS:  # core_share first: alone() rescales the terms the others then zero
        if term.name in names:
            hardware = term.remove(hardware)
    return hardware


_TERM_FIELDS = {
    "core_share": ("core_share", "core_share_range_s", "core_share_call_s"),
    "op_fixed": ("op_fixed_s",),
    "first_call": ("first_call_s",),
    "model_call": ("model_call_s",),
    "working_set_bandwidth": ("memory_bandwidth_curve",),
    "cold_shared_memory": ("shared_memory_cold_curve",),
    "collective_wait": ("collective_wait_s",),
    "call_sync_wait": ("call_sync_wait_s", "call_sync_wait_per_compute", "call_sync_wait_compute_range_s"),
}
_BASE_FIELDS = ("peak_tflops", "gemm_half_efficiency_dim", "memory_bandwidth_gbps", "transcendental_element_s",
                "op_element_s", "view_op_s", "kernel_floor_s", "host_dispatch_s", "graph_launch_s",
                "intra_node", "shared_memory_link")


def fitted_numbers(hardware: Hardware, removed: Iterable[str] = ()) -> dict[str, int]:
    """How many measured numbers ``hardware`` prices with, with the :data:`TERMS` in ``removed`` left out: per
    field (a curve counts its points, ``op_fixed_s`` its families, ``peak_tflops`` its dtypes, a link its
    latency per call, per step and bandwidth); fields at zero or empty count 0."""
    gone = {field for name in removed for field in _TERM_FIELDS[name]}
    counts = {}
    for field in (*_BASE_FIELDS, *(f for fields in _TERM_FIELDS.values() for f in fields)):
        value = getattr(hardware, field)
        if field in gone or value is None:
            counts[field] = 0
        elif field in ("intra_node", "shared_memory_link"):
            counts[field] = 3
        elif isinstance(value, (tuple, Mapping)):
            counts[field] = len(value)
        else:
            counts[field] = int(value != 0.0 and not (field == "core_share" and value == 1.0))
    return counts


def subsets() -> tuple[frozenset[str], ...]:
    """Every subset of :data:`TERMS` names, as sets of terms *removed*; the empty set (every term kept) first."""
    return tuple(frozenset(combination) for size in range(len(_TERM_NAMES) + 1)
                 for combination in itertools.combinations(_TERM_NAMES, size))


@dataclasses.dataclass(frozen=True)
class Observation:
    """One (family, world size, round): the measured forward and its prediction by the terms removed."""

    family: str
    world_size: int
    round_index: int
    measured_s: float
    predicted_s: Mapping[frozenset[str], float]


@dataclasses.dataclass(frozen=True)
class FoldResult:
    """One rotation: the families held out, the terms chosen on the others, and the signed errors."""

    held_out: tuple[str, ...]
    kept: tuple[str, ...]
    fitted_error: Mapping[int, float]
    """Median absolute error per world size over the training families, with the chosen terms."""
    held_out_errors: Mapping[tuple[str, int], float]
    """Signed error per (held-out family, world size), with the chosen terms."""


@dataclasses.dataclass(frozen=True)
class HeldOutReport:
    """Every rotation, and per world size the fitted and held-out medians."""

    folds: tuple[FoldResult, ...]
    world_sizes: tuple[int, ...]

    def held_out_errors(self) -> dict[tuple[str, int], float]:
        """Signed error of every (family, world size), from the rotation that held the family out."""
        return {key: error for fold in self.folds for key, error in fold.held_out_errors.items()}

    def held_out_median(self, world_size: int) -> float:
        return statistics.median(abs(e) for (_, ws), e in self.held_out_errors().items() if ws == world_size)

    def fitted_median(self, world_size: int) -> float:
        """The median over rotations of the training families' median absolute error."""
        return statistics.median(fold.fitted_error[world_size] for fold in self.folds)


def family_folds(families: Sequence[str], k: int) -> tuple[tuple[str, ...], ...]:
    """``k`` folds of ``families`` (every ``k``-th in the given order), each held out once."""
    if not 2 <= k <= len(families):
        raise ValueError(f"k must be between 2 and the number of families ({len(families)}), got {k}")
    return tuple(tuple(families[start::k]) for start in range(k))


def _errors(observations: Sequence[Observation], removed: frozenset[str]) -> dict[tuple[str, int], float]:
    """Signed error per (family, world size): the median prediction over rounds against the median measurement."""
    grouped: dict[tuple[str, int], list[Observation]] = {}
    for observation in observations:
        grouped.setdefault((observation.family, observation.world_size), []).append(observation)
    return {key: statistics.median(o.predicted_s[removed] for o in rows) / statistics.median(o.measured_s for o in rows) - 1
            for key, rows in grouped.items()}


def _score(errors: Mapping[tuple[str, int], float], world_sizes: Sequence[int]) -> float:
    """What the choice of terms minimises: per world size, the mean of the median and the largest absolute
    error, averaged over world sizes (the median alone would drop a term that only a few families need)."""
    def at(world_size: int) -> list[float]:
        return [abs(e) for (_, ws), e in errors.items() if ws == world_size]

    return statistics.fmean((statistics.median(at(ws)) + max(at(ws))) / 2 for ws in world_sizes)


def cross_validate(observations: Sequence[Observation], families: Sequence[str], k: int) -> HeldOutReport:
    """Choose the terms on ``k - 1`` folds of ``families``, predict the held-out fold, for each fold in turn.

    The choice is the subset of :data:`TERMS` with the least training error (:func:`_score`); among equal
    scores, the one with the fewest terms. Every observation must carry a prediction for every subset."""
    world_sizes = tuple(sorted({o.world_size for o in observations}))
    choices = subsets()
    missing = [o for o in observations if any(removed not in o.predicted_s for removed in choices)]
    if missing:
        raise ValueError(f"{len(missing)} observation(s) lack a prediction for some subset of terms, e.g. "
                         f"{missing[0].family} at world size {missing[0].world_size}; price every subsets() entry")
    errors_by_choice = {removed: _errors(observations, removed) for removed in choices}
    folds = []
    for held_out in family_folds(families, k):
        def training(errors: Mapping[tuple[str, int], float], held_out: tuple[str, ...] = held_out) -> dict:
            return {key: e for key, e in errors.items() if key[0] not in held_out}

        best = min(choices, key=lambda removed: (round(_score(training(errors_by_choice[removed]), world_sizes), 6),
                                                 len(_TERM_NAMES) - len(removed)))
        chosen = errors_by_choice[best]
        fitted = training(chosen)
        folds.append(FoldResult(
            held_out=held_out,
            kept=tuple(name for name in _TERM_NAMES if name not in best),
            fitted_error={ws: statistics.median(abs(e) for (_, w), e in fitted.items() if w == ws) for ws in world_sizes},
            held_out_errors={key: e for key, e in chosen.items() if key[0] in held_out},
        ))
    return HeldOutReport(tuple(folds), world_sizes)
