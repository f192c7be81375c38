"""The forms a collective takes at run time: one table from each form to when it applies, its cost and its fit.

A form is how a rank-local graph's collective actually runs on a group: the backend's own collective, or
one of autotp's inference forms that beat it for small tensors. Each is a :class:`CollectiveForm`, and
:data:`FORM_TABLE` maps it to one :class:`FormSpec`:

==================  ==========================================  ====================================  ============
form                applies (inference graphs)                  cost per call (before the wait)       fitted by
==================  ==========================================  ====================================  ============
symmetric_memory    ranks on one host, CUDA tensors, a torch    base + 2·alpha + (p-1)·n/B on         nothing more
                    with the kernel; sum all-reduce of at most  ``Hardware.symmetric_memory_link``
                    256 KiB of float32 / bfloat16, p >= 2       ([SYMM])
shared_memory       gloo ranks on one x86-64 host, CPU          base + (p-1)·alpha + (p+1)·n/B        its own link
                    tensors; every sum all-reduce and           (all-gather: (p+1)/p·n/B) on
                    all-gather over the group                   ``Hardware.shared_memory_link``
one_shot            gloo, p >= 3; sum all-reduce of at most     base + (p-1)·alpha + (p-1)/p·(p·n)/B  the group's
                    256 KiB                                     on the group's link ([T05] pairwise)  link
ring                everywhere else, and every training graph   the backend's ring or tree, flat or   the group's
                                                                hierarchical (:mod:`.collectives`)    link
==================  ==========================================  ====================================  ============

The rows are in the order the runtime tries them (the first whose group conditions hold takes the group's
collectives; a call it does not take, by kind, size or dtype, keeps the backend's). A profile names the form
it runs with (``Hardware.small_all_reduce``, the form's value); a group that spans nodes runs the row's
``across_nodes`` form instead (shared memory falls back to one-shot, symmetric memory to the backend's).

A row's cost is written once, over a small :class:`Arithmetic`: :data:`NUMERIC` evaluates it on floats (the
cost pass), :data:`SYMBOLIC` on sympy expressions of batch and sequence (:mod:`.symbolic`), where a size
threshold becomes a ``Piecewise``. :meth:`FormSpec.time` is the one decision both read: the row's own cost
where the form takes the call, the backend's price (given by the caller, :mod:`.collectives`) otherwise.

Who reads the table: the pricing (:func:`.collectives.collective_time_s`,
:func:`.symbolic.symbolic_collective_time_s`), the profile's check (:class:`.hardware.Hardware`), the fit of
a calibrated profile (:mod:`.calibrate`, :mod:`.graph_calibration`), the runtime's per-call checks
(``autotp.passes.small_collectives``, ``autotp.runtime.collectives.symmetric_memory``) and the runtime's choice and graph
substitution (``autotp.runtime.collectives.inference_collectives.RUNTIME_FORMS``, one row per form: how it is set up on
a group and put in a graph; the cost model imports nothing of autotp, so that half sits above it, keyed by
the same enum and checked complete when imported). Adding a form: a member and a row here, a row there.

Sources: [T05] and [SYMM] as in :mod:`.collectives`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import sympy

if TYPE_CHECKING:
    from .hardware import LinkProfile

__all__ = [
    "FORM_TABLE",
    "NUMERIC",
    "ONE_SHOT_MAX_BYTES",
    "ONE_SHOT_MIN_GROUP",
    "SHARED_MEMORY_MACHINES",
    "SYMBOLIC",
    "SYMMETRIC_MEMORY_DTYPES",
    "Arithmetic",
    "CollectiveForm",
    "FormSpec",
    "form_measured_as",
    "link_time",
    "runs_as",
]


class CollectiveForm(enum.StrEnum):
    """How a collective runs on a group; the value is the name a profile saves (``Hardware.small_all_reduce``)
    and what ``str`` and ``format`` give."""

    RING = "ring"
    ONE_SHOT = "one_shot"
    SHARED_MEMORY = "shared_memory"
    SYMMETRIC_MEMORY = "symmetric_memory"

    def __hash__(self) -> int:  # equal to its name, so hash like it: "ring" and the form are one key
        return hash(self.value)

    @classmethod
    def from_name(cls, name: str) -> CollectiveForm:
        """The form saved as ``name`` (ValueError naming the valid names otherwise)."""
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(repr(form.value) for form in cls)
            raise ValueError(f"unknown collective form {name!r}; valid forms: {valid}") from None


class Arithmetic(Protocol):
    """What a row's cost needs besides ``+ - * /``, on numbers or on sympy expressions."""

    def integer(self, value: int) -> Any:
        """A group size or step count as this arithmetic's integer (sympy's keeps ``(p-1)/p`` exact)."""

    def real(self, value: Any) -> Any:
        """A finished time (a float for numbers; the expression itself for sympy)."""

    def at_most(self, value: Any, bound: int) -> Any:
        """The condition ``value <= bound``."""

    def choose(self, condition: Any, then: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        """``then()`` where ``condition`` holds, else ``otherwise()`` (sympy: a ``Piecewise`` of both)."""

    def minimum(self, first: Any, second: Any) -> Any:
        """The smaller of two times."""

    def total(self, terms: Iterable[Any]) -> Any:
        """The sum of times."""


class _Numeric:
    """:class:`Arithmetic` on Python numbers: conditions are decided, only the branch taken is priced."""

    def integer(self, value: int) -> int:
        return value

    def real(self, value: Any) -> float:
        return float(value)

    def at_most(self, value: Any, bound: int) -> bool:
        return bool(value <= bound)

    def choose(self, condition: Any, then: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        return then() if condition else otherwise()

    def minimum(self, first: Any, second: Any) -> Any:
        return min(first, second)

    def total(self, terms: Iterable[Any]) -> Any:
        return sum(terms)


class _Symbolic:
    """:class:`Arithmetic` on sympy expressions: a condition on a size stays in the expression."""

    def integer(self, value: int) -> sympy.Integer:
        return sympy.Integer(value)

    def real(self, value: Any) -> Any:
        return value

    def at_most(self, value: Any, bound: int) -> Any:
        return value <= bound

    def choose(self, condition: Any, then: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        return sympy.Piecewise((then(), condition), (otherwise(), True))

    def minimum(self, first: Any, second: Any) -> Any:
        return sympy.Min(first, second)

    def total(self, terms: Iterable[Any]) -> Any:
        return sum(terms, sympy.Integer(0))


NUMERIC: Arithmetic = _Numeric()
SYMBOLIC: Arithmetic = _Symbolic()

ONE_SHOT_MAX_BYTES = 256 * 1024
"""Largest all-reduce (bytes on one rank) summed by one exchange round where the runtime does so;
larger ones keep the backend's ring. Each rank sends ``p - 1`` copies of the tensor instead of the
ring's ``2 (p - 1) / p``, which costs nothing while latency dominates (measured at tp 4 on gloo:
2 KiB one-shot 2x faster, 256 KiB still ~1.3x faster)."""

ONE_SHOT_MIN_GROUP = 3
"""Smallest group the one-shot all-reduce is used for: on 2 ranks the ring is one exchange already."""

SHARED_MEMORY_MACHINES = ("x86_64", "AMD64")
"""``platform.machine()`` values with total store order (x86-64): there a flag stored after the data
is seen after it by the other cores, which the shared-memory all-reduce relies on."""

SYMMETRIC_MEMORY_DTYPES = ("float32", "bfloat16")
"""The dtypes PyTorch's one-shot kernel sums (its CUDA dispatch: float and bfloat16); others keep the backend."""

Terms = Callable[[str, Any], tuple[Any, Any, Any]]
"""``terms(kind, p)``: ``(latency steps, bandwidth factor, bytes multiplier)`` of one call, so that its time on
a link is ``base + steps·alpha + factor·(multiplier·n)/B``; numbers or sympy expressions alike."""


def link_time(link: LinkProfile, steps: Any, factor: Any, nbytes: Any) -> Any:
    """``base + steps·alpha + factor·n/B`` on ``link`` (the alpha-beta model of :mod:`.collectives`)."""
    return link.base_latency_s + steps * link.latency_s + factor * nbytes / link.bandwidth_bytes_per_s


@dataclasses.dataclass(frozen=True)
class FormSpec:
    """One collective form (module table).

    When it applies, on a group (the runtime decides once per group and graph, alike on every rank):
    ``backends`` (None: any), ``one_host`` (every rank on one host), ``machines`` (``platform.machine()``,
    None: any), ``device_types`` (the ranks' tensors' device types, None: any), ``needs_kernel`` (a kernel
    that this torch must have), ``in_training`` (False: inference graphs only; a training graph keeps the
    functional collectives, whose backward autograd knows); per call: ``kinds`` (the collectives it runs,
    sum all-reduces and all-gathers over the whole group; in the order the graph substitution replaces
    them), ``min_group``, ``max_bytes`` (None: any size) and ``dtypes`` (None: any).

    Its cost: ``terms`` on ``link_field``'s link (a :class:`~.hardware.Hardware` attribute; None: the group's
    own link, ``intra_node`` or ``inter_node``), written once for numbers and sympy (:meth:`time`); None for
    the backend's own collective, priced by :mod:`.collectives` (flat, or hierarchical where the group
    spans whole nodes; the other forms are priced flat: the runtime does not split them). ``pays_cold_call``: each call also pays
    ``Hardware.shared_memory_cold_call_s`` at the graph's working set. ``across_nodes``: the form the runtime
    runs instead on a group that spans nodes (None: this one).

    Its fit: ``measured_as``, the sample kind ``autotp calibrate`` times it as, fitted to ``terms`` to give
    ``link_field`` (None: nothing of its own; the group's link is fitted from the backend's collectives).
    ``label``: how :func:`autotp.runtime.collectives.inference_collectives.collective_forms` names it in a graph (None:
    its value).
    """

    form: CollectiveForm
    kinds: tuple[str, ...]
    terms: Terms | None
    label: str | None = None
    link_field: str | None = None
    backends: tuple[str, ...] | None = None
    one_host: bool = False
    machines: tuple[str, ...] | None = None
    device_types: frozenset[str] | None = None
    needs_kernel: bool = False
    in_training: bool = False
    min_group: int = 1
    max_bytes: int | None = None
    dtypes: tuple[str, ...] | None = None
    pays_cold_call: bool = False
    across_nodes: CollectiveForm | None = None
    measured_as: str | None = None

    @property
    def name_in_graph(self) -> str:
        """How a report of the forms a graph took names it (``label``, else the form's value)."""
        return self.label if self.label is not None else str(self.form)

    def takes_group(self, *, group_size: int | None = None, backend: str | None = None, one_host: bool | None = None,
                    machine: str | None = None, device_types: Iterable[str] | None = None,
                    has_kernel: bool | None = None) -> bool:
        """Whether the runtime runs this form on a group with these facts (each needed only where the row
        constrains it: an unknown fact the row constrains says no; ``group_size`` None: not checked)."""
        return ((group_size is None or group_size >= self.min_group)
                and (self.backends is None or backend in self.backends)
                and (not self.one_host or bool(one_host))
                and (self.machines is None or machine in self.machines)
                and (self.device_types is None or (device_types is not None and set(device_types) == self.device_types))
                and (not self.needs_kernel or bool(has_kernel)))

    def sums(self, dtype: Any) -> bool:
        """Whether it runs a tensor of ``dtype`` (a ``torch.dtype`` or its name; None: not known, taken as
        one it runs)."""
        return self.dtypes is None or dtype is None or str(dtype).removeprefix("torch.") in self.dtypes

    def takes_call(self, kind: str, group_size: int, dtype: Any = None) -> bool:
        """Whether a call of ``kind`` over ``group_size`` ranks of ``dtype`` takes this form, at a size it takes."""
        return kind in self.kinds and group_size >= self.min_group and self.sums(dtype)

    def takes(self, kind: str, group_size: int, nbytes: float, dtype: Any = None) -> bool:
        """Whether a call of ``kind`` of ``nbytes`` (per rank) over ``group_size`` ranks of ``dtype`` takes this
        form on a group it runs on: the one condition the runtime and the pricing read."""
        return self.takes_call(kind, group_size, dtype) and (self.max_bytes is None or nbytes <= self.max_bytes)

    def link(self, group_link: LinkProfile, links: Callable[[str], LinkProfile | None]) -> LinkProfile:
        """The link its cost is priced on: ``links(link_field)`` (ValueError when the profile has none), else
        ``group_link``."""
        if self.link_field is None:
            return group_link
        link = links(self.link_field)
        if link is None:
            raise ValueError(f'small_all_reduce="{self.form}" needs {self.link_field}= (Hardware.{self.link_field})')
        return link

    def own_time(self, kind: str, nbytes: Any, group_size: int, link: LinkProfile, arith: Arithmetic) -> Any:
        """Its own cost of one call on ``link`` (module table), in ``arith``."""
        if self.terms is None:
            raise AssertionError(f"{self.form} is the backend's own collective: priced by cost_model.collectives")
        steps, factor, multiplier = self.terms(kind, arith.integer(group_size))
        sent = nbytes if multiplier == 1 else multiplier * nbytes
        return arith.real(link_time(link, steps, factor, sent))

    def time(self, kind: str, nbytes: Any, group_size: int, dtype: Any, *, group_link: LinkProfile,
             links: Callable[[str], LinkProfile | None], arith: Arithmetic, backend: Callable[[], Any]) -> Any:
        """One call's link time where this form runs: its own cost where it takes the call (a size threshold
        in ``arith``: decided on numbers, a ``Piecewise`` on expressions), else ``backend()``, the backend's
        price (no in-graph wait, no cold-cache cost)."""
        if self.terms is None or not self.takes_call(kind, group_size, dtype):
            return backend()

        def own() -> Any:
            return self.own_time(kind, nbytes, group_size, self.link(group_link, links), arith)

        if self.max_bytes is None:
            return own()
        return arith.choose(arith.at_most(nbytes, self.max_bytes), own, backend)


def _symmetric_memory_terms(kind: str, p: Any) -> tuple[Any, Any, Any]:
    # [SYMM] one kernel: two barriers (every rank signals its peers at once, one link latency each whatever p);
    # each rank loads the p - 1 peers' n bytes
    return 2, p - 1, 1


def _shared_memory_terms(kind: str, p: Any) -> tuple[Any, Any, Any]:
    # p - 1 flags waited for; an all-reduce copies its n in and reads the p copies ((p + 1) n), an all-gather
    # copies its n / p in and reads the n of the output ((p + 1) / p n)
    if kind == "all_reduce":
        return p - 1, p + 1, 1
    if kind == "all_gather":
        return p - 1, (p + 1) / p, 1
    raise ValueError(f"no shared-memory form of {kind!r}; it has: all_reduce, all_gather")


def _one_shot_terms(kind: str, p: Any) -> tuple[Any, Any, Any]:
    # [T05] pairwise exchange (an all_to_all_single, p - 1 rounds of n/p bytes of its p·n): every rank sends its
    # whole tensor to every rank and sums the p copies (memory bound, not priced, as the ring's reduction)
    return p - 1, (p - 1) / p, p


FORM_TABLE: Mapping[CollectiveForm, FormSpec] = MappingProxyType({
    CollectiveForm.SYMMETRIC_MEMORY: FormSpec(
        CollectiveForm.SYMMETRIC_MEMORY, kinds=("all_reduce",), terms=_symmetric_memory_terms,
        link_field="symmetric_memory_link", one_host=True,
        device_types=frozenset({"cuda"}), needs_kernel=True, min_group=2, max_bytes=ONE_SHOT_MAX_BYTES,
        dtypes=SYMMETRIC_MEMORY_DTYPES, across_nodes=CollectiveForm.RING),
    CollectiveForm.SHARED_MEMORY: FormSpec(
        CollectiveForm.SHARED_MEMORY, kinds=("all_reduce", "all_gather"), terms=_shared_memory_terms,
        link_field="shared_memory_link", backends=("gloo",), one_host=True,
        machines=SHARED_MEMORY_MACHINES, device_types=frozenset({"cpu"}), pays_cold_call=True,
        across_nodes=CollectiveForm.ONE_SHOT, measured_as="shared_memory_all_reduce"),
    CollectiveForm.ONE_SHOT: FormSpec(
        CollectiveForm.ONE_SHOT, kinds=("all_reduce",), terms=_one_shot_terms, backends=("gloo",),
        min_group=ONE_SHOT_MIN_GROUP, max_bytes=ONE_SHOT_MAX_BYTES),
    CollectiveForm.RING: FormSpec(
        CollectiveForm.RING, kinds=("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"),
        terms=None, label="backend", in_training=True),
})
"""Every :class:`CollectiveForm`'s row, in the order the runtime tries them (module table)."""

if set(FORM_TABLE) != set(CollectiveForm):  # pragma: no cover - a form added without its row
    raise AssertionError(f"FORM_TABLE lacks rows for {sorted(set(CollectiveForm) - set(FORM_TABLE))}")


def runs_as(form: str, *, spans_nodes: bool) -> FormSpec:
    """The row of what runs on a profile whose ``small_all_reduce`` is ``form``: its own, or on a group that
    spans nodes its ``across_nodes`` form (memory is not shared across nodes)."""
    spec = FORM_TABLE[CollectiveForm.from_name(form)]
    if spans_nodes and spec.across_nodes is not None:
        return FORM_TABLE[spec.across_nodes]
    return spec


def form_measured_as(sample_kind: str) -> FormSpec | None:
    """The row whose calibration samples are of ``sample_kind`` (``FormSpec.measured_as``), or None."""
    return next((spec for spec in FORM_TABLE.values() if spec.measured_as == sample_kind), None)
