"""Dropout on split activations: one random stream per rank (``autotp.compile(..., training=True, dropout="split")``).

A dropout mask is drawn from a random number generator. Where the activation is *replicated*
(or a ``Partial`` sum: every rank's part must be masked alike) every rank must draw the same mask:
all ranks draw from the default generator, seeded alike (``autotp.compile`` checks that their
states agree), in the same order, so the masks equal one process's with that seed. Where the
activation is *split* (``Shard``/``BlockShard``: e.g. attention probabilities split by heads),
each rank holds different elements, and their masks must be independent: Megatron-LM draws them
from a separate model-parallel generator seeded ``seed + 2718 + tp_rank``
(``megatron.core.tensor_parallel.random``). This module does the same:

- :class:`RankStreams`: this rank's own generator state per device, seeded
  ``torch.initial_seed() + 2718 + rank`` when the rank-local graph is built (deterministic for a
  seed; :func:`manual_seed`, ``tp.manual_seed(seed)``, seeds both streams again), kept apart from
  the default generator;
- :class:`RankStream`: the target of a random op on a split activation in the rank-local graph;
  it runs the op with the rank's state swapped into the device's default generator and swaps it
  back, so the default stream (shared by the replicated dropouts) advances exactly as on the
  other ranks;
- :func:`rank_stream_target`: which ops take it (what the rewrite asks, per node).

By default (``dropout="replicated"``) the sharding rules offer no split for a sampling op, so
every mask is drawn whole and the loss equals one process's with the same seed; a split
activation is gathered before its dropout (and attention with ``dropout_p > 0`` runs whole on
every rank). ``dropout="split"`` lets the planner keep them split (a mask per rank; the loss is
then that of another, equally valid, draw). Activation checkpointing of blocks
(:mod:`autotp.runtime.training.checkpointing`) replays the rank's stream from the same state when it
recomputes a block, so the recomputed masks are the forward's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from autotp.base.placements import Placement, split_of

__all__ = ["DROPOUT", "STREAM_SEED_OFFSET", "RankStream", "RankStreams", "check_dropout", "manual_seed",
           "rank_seed", "rank_stream_target"]

DROPOUT = ("replicated", "split")
"""Values of the ``dropout=`` option: every mask drawn whole from the shared stream, or split
activations masked from per-rank streams (see the module doc)."""

STREAM_SEED_OFFSET = 2718
"""Megatron-LM's offset of the model-parallel seed (``seed + 2718 + tp_rank``)."""


def check_dropout(value: object) -> str:
    """``value`` when it is one of :data:`DROPOUT`; else a :class:`ValueError` naming them."""
    if value not in DROPOUT:
        raise ValueError(f"dropout={value!r}: expected 'replicated' (every mask drawn whole, the same on every rank; "
                         "the default) or 'split' (dropout on split activations from per-rank random streams)")
    return str(value)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


class RankStreams:
    """This rank's own random generator state per device (see the module doc); one per rank-local graph."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.states: dict[torch.device, torch.Tensor] = {}

    @contextlib.contextmanager
    def active(self, device: torch.device) -> Iterator[None]:
        """Inside: ``device``'s default generator draws from this rank's stream (which then advances)."""
        generator = _default_generator(device)
        if device not in self.states:
            fresh = torch.Generator(device=device)
            fresh.manual_seed(self.seed)
            self.states[device] = fresh.get_state()
        shared = generator.get_state()
        generator.set_state(self.states[device])
        try:
            yield
        finally:
            self.states[device] = generator.get_state()
            generator.set_state(shared)

    def reseed(self, seed: int) -> None:
        """Start the streams again from ``seed`` (this rank's: see :func:`manual_seed`)."""
        self.seed = seed
        self.states = {}

    def snapshot(self) -> dict[torch.device, torch.Tensor]:
        """The streams' states now (to replay them: :meth:`replaying`)."""
        return dict(self.states)

    @contextlib.contextmanager
    def replaying(self, snapshot: dict[torch.device, torch.Tensor]) -> Iterator[None]:
        """Inside: the streams draw again from ``snapshot``; afterwards they continue where they were."""
        now = self.states
        self.states = dict(snapshot)
        try:
            yield
        finally:
            self.states = now


class RankStream:
    """The target of one sampling op on a split activation: the op, run on this rank's stream."""

    __module__ = "autotp.passes.random_streams"

    def __init__(self, target: Any, streams: RankStreams) -> None:
        self.target = target
        self.streams = streams
        self.__name__ = f"rank_stream_{getattr(target, '__name__', 'op')}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        with self.streams.active(device):
            return self.target(*args, **kwargs)

    def __repr__(self) -> str:
        return f"RankStream({self.target})"


def rank_stream_target(node: fx.Node, output: Placement, streams: RankStreams | None) -> Any:
    """The target the rank-local graph calls for ``node`` under output placement ``output``: a
    :class:`RankStream` for a sampling op whose output is split (when ``streams`` is given), else
    ``node.target``."""
    from autotp.capture.tracing import draws_random_numbers

    if streams is None or split_of(output) is None or not draws_random_numbers(node):
        return node.target
    return RankStream(node.target, streams)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of ``rank``'s own stream for a run seeded ``seed``: Megatron-LM's ``seed + 2718 + tp_rank``."""
    return (seed + STREAM_SEED_OFFSET + rank) % 2**63


def manual_seed(graph_module: torch.nn.Module, seed: int, rank: int) -> None:
    """Seed a training step's random numbers on this rank: the shared stream (``torch.manual_seed(seed)``,
    the same on every rank) and this rank's own streams in ``graph_module`` (:func:`rank_seed`)."""
    torch.manual_seed(seed)
    for module in graph_module.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if isinstance(node.target, RankStream):
                    node.target.streams.reseed(rank_seed(seed, rank))
