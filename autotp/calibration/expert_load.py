"""Measure a router's load: run the model on calibration data and count the rows each expert receives.

:func:`measure_expert_load` runs the user's own model, eagerly, on the user's batches (no export, no process
group), under a dispatch mode that watches the ops it runs. It counts what the planner prices, at the op the
planner recognises an MoE block by (:mod:`autotp.planning.experts`): a grouped GEMM (``aten._grouped_mm``,
transformers' ``grouped_mm_fallback``) whose weight is a 3-D parameter ``(E, K, N)`` (or a view of one) reads
rows sorted by expert, with the cumulative row count of each expert in its offsets ``offs (E,)``; the rows of
expert e are ``offs[e] - offs[e-1]``. So no router is read by class or module name, and what is counted is what
the experts computed, whatever the router did to choose (group-limited top-k, a bias, a softmax before or after).
Consecutive grouped GEMMs that read the same offsets tensor are one block (its gate/up and down projections),
counted once; the block is named by its weights' fully qualified names, the names the planner sees on the
exported graph's parameter placeholders (:class:`~autotp.planning.expert_load.ExpertLoad`). The top-k is read
from the last ``topk`` that ran before the block with as many indices as the block has rows.

Blocks computed another way (transformers' ``experts_implementation="eager"`` loop, ``"batched_mm"``) are not
grouped GEMMs; the planner does not place their experts either, and nothing is counted for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from autotp.adapters.torch_internals import TorchDispatchMode
from autotp.base.progress import log_progress
from autotp.passes.rules.experts import is_grouped_mm
from autotp.planning.expert_load import BlockLoad, ExpertLoad

__all__ = ["measure_expert_load"]


class _Block:
    """One block's running counts while measuring."""

    def __init__(self, experts: int) -> None:
        self.weights: list[str] = []
        self.rows = [0] * experts
        self.top_k: int | None = None


class _RoutedRows(TorchDispatchMode):
    """Counts, per MoE block, the rows each expert's grouped GEMM computes (module docstring)."""

    def __init__(self, expert_weights: dict[int, str]) -> None:
        super().__init__()
        self.expert_weights = expert_weights  # storage address of a 3-D parameter -> its FQN
        self.blocks: dict[str, _Block] = {}  # the FQN of the block's first weight -> counts
        self._last_offs: torch.Tensor | None = None  # held, so its address is not reused by another tensor
        self._last_block: _Block | None = None
        self._last_topk: tuple[int, ...] | None = None  # shape of the indices of the last topk

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.topk.default:
            self._last_topk = tuple(out[1].shape)
        elif is_grouped_mm(func):
            self._count(args, kwargs)
        return out

    def _count(self, args: tuple, kwargs: dict) -> None:
        inputs, weight = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        if not isinstance(offs, torch.Tensor) or weight.dim() != 3 or offs.dim() != 1 or offs.numel() < 2:
            return
        fqn = self.expert_weights.get(_storage_address(weight))
        if fqn is None or offs.numel() != weight.shape[0]:
            return
        if offs is self._last_offs and self._last_block is not None:  # the next projection of the same block
            if fqn not in self._last_block.weights:
                self._last_block.weights.append(fqn)
            return
        block = next((b for b in self.blocks.values() if fqn in b.weights), None)
        if block is None:
            block = self.blocks[fqn] = _Block(offs.numel())
            block.weights.append(fqn)
        ends = [0] + [int(end) for end in offs.tolist()]  # cumulative rows per expert
        for expert in range(len(block.rows)):
            block.rows[expert] += ends[expert + 1] - ends[expert]
        rows = inputs.shape[0]
        if block.top_k is None and self._last_topk and len(self._last_topk) >= 1:
            count = 1
            for size in self._last_topk:
                count *= size
            if count == rows:
                block.top_k = self._last_topk[-1]
        self._last_offs, self._last_block = offs, block


def _storage_address(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s data starts (a view shares its base's), or None for a tensor without plain storage (a
    quantized weight made of several tensors)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _call(model: torch.nn.Module, batch: Any) -> None:
    """``model`` on one batch: a dict is keyword arguments, a tuple or list positional ones, anything else one."""
    if isinstance(batch, dict):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


def measure_expert_load(model: torch.nn.Module, batches: Iterable[Any], *, progress: bool = False) -> ExpertLoad:
    """Run ``model`` on every batch of ``batches`` (calibration data) and count the rows its router sends to each
    expert of every mixture-of-experts block; pass the result as ``autotp.PlanOptions(expert_load=...)`` to plan for
    that load instead of a uniform router.

    A batch is a dict of keyword arguments (``{"input_ids": ids, "attention_mask": mask}``), a tuple of positional
    ones, or one tensor. The model runs as it is (its device, dtype and mode; call ``model.eval()`` first), without
    gradients, on one device: no process group. ``progress`` prints a line per batch to stderr. Save the result
    with :meth:`~autotp.planning.expert_load.ExpertLoad.save` to plan with it later (``expert_load=path``).

    Raises a ValueError when no batch is given, and when no grouped GEMM over expert weights ran (a model without
    experts, or one whose experts run another way: see :mod:`autotp.calibration.expert_load`).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"measure_expert_load takes the model (a torch.nn.Module), got {type(model).__name__}")
    if any(param.device.type == "meta" for param in model.parameters()):
        raise ValueError("measure_expert_load runs the model, and its weights are on the meta device: load the "
                         "trained weights first (planning with the load needs none)")
    expert_weights = {_storage_address(param): name
                      for name, param in model.named_parameters() if param.dim() == 3 and param.shape[0] >= 2}
    expert_weights.pop(None, None)
    counted = 0
    total = len(batches) if hasattr(batches, "__len__") else None
    recorder = _RoutedRows(expert_weights)
    with torch.no_grad():
        for batch in batches:
            with recorder:
                _call(model, batch)
            counted += 1
            routed = sum(sum(b.rows) for b in recorder.blocks.values())
            log_progress(progress, f"expert load: batch {counted}{f'/{total}' if total else ''}, "
                                   f"{routed} rows routed in {len(recorder.blocks)} blocks")
    if counted == 0:
        raise ValueError("measure_expert_load needs at least one batch of calibration data, e.g. "
                         "batches=[{'input_ids': ids}]")
    if not recorder.blocks:
        raise ValueError(f"no grouped GEMM over expert weights ran in {type(model).__name__} on these batches: autotp "
                         "measures (and places) experts computed by a grouped GEMM (transformers' "
                         "experts_implementation='grouped_mm', its default); a model without experts has no load")
    blocks = tuple(BlockLoad(tuple(b.weights), tuple(b.rows), b.top_k) for b in recorder.blocks.values())
    return ExpertLoad(blocks, counted)
