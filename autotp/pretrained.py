"""Front doors for models bigger than one device: ``from_pretrained`` and ``load``.

Both build nothing but a model on the ``meta`` device, plan it (planning needs no weights), and
read only this rank's blocks: from a transformers safetensors checkpoint
(:func:`from_pretrained`), or from a ``torch.distributed.checkpoint`` directory written by
:meth:`TensorParallelModule.save` at any world size (:func:`load`); ``generate`` reads its graphs'
blocks from the same files. See :mod:`autotp.runtime.checkpoints.loading` and :mod:`autotp.runtime.checkpoints.saving`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from autotp.adapters import torchao
from autotp.driver import compile_group
from autotp.planning.options import PlanOptions, moved_to_options, plan_options
from autotp.planning.plan import Plan
from autotp.runtime.execution.module import TensorParallelModule
from autotp.runtime.execution.options import RuntimeOptions, runtime_options

__all__ = ["from_pretrained", "load"]


def from_pretrained(path: str | os.PathLike[str], *, world_size: int | None = None, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu", example_inputs: tuple[Any, ...] | None = None,
                    example_kwargs: dict[str, Any] | None = None, group: Any = None,
                    plan: Plan | str | os.PathLike[str] | None = None, options: PlanOptions | None = None,
                    runtime: RuntimeOptions | None = None, quantization_config: Any = None,
                    **deprecated: Any) -> TensorParallelModule:
    """A transformers checkpoint directory -> this rank's tensor-parallel model (call on every rank).

    The config's architecture (``config.architectures[0]``) is built on the meta device in
    ``dtype`` (default: the config's ``dtype``, else float32), traced with ``example_inputs``
    (default: one sequence of 16 token ids) and ``example_kwargs`` (default none: a HF model is traced with
    ``use_cache=False`` and called with or without it, see :mod:`autotp.adapters.hf_transformers`) on ``device``, planned, and
    each rank reads only its blocks from the safetensors files, cast to ``dtype``, straight onto ``device``.
    ``group``, ``plan``, ``options`` and ``runtime`` as in :func:`autotp.compile`. For a causal
    LM, ``tp.generate(ids, ...)`` builds its generation graphs on the first call from the same checkpoint:
    captured on the meta model, each rank reading the blocks of the weights that it does not hold already
    (see :mod:`autotp.runtime.generation.generation_on_demand`).

    ``quantization_config`` (a ``transformers.TorchAoConfig``): the meta model is quantized as transformers
    would (the same weights), and each rank quantizes its blocks of the float checkpoint as it reads them
    (whole rows where per-row scales need them, see :func:`autotp.runtime.checkpoints.loading.quantize_on_read` and
    docs/quantization.md).

    ``runtime.trace_cache`` (default True here): the traced program is kept in ``$AUTOTP_CACHE_DIR`` (default
    ``~/.cache/autotp``, never inside ``path``) and reused by the next load of the same model and
    inputs' specs, which then skips ``torch.export`` (see :mod:`autotp.capture.trace_cache`);
    ``RuntimeOptions(trace_cache=False)`` or ``$AUTOTP_CACHE=0`` turns it off, a path puts it there.
    """
    options = plan_options(moved_to_options("autotp.from_pretrained", options, deprecated, taken=("hardware",)))
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:
        raise ValueError(f"{path}/config.json names no transformers architecture I can build ({architectures!r}); "
                         "build the model on the meta device yourself and call autotp.compile(model, ..., checkpoint=path)")
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype)
    model.eval()
    if quantization_config is None and getattr(config, "quantization_config", None) is not None:
        quantization_config = torchao.saved_config(config.quantization_config)  # a checkpoint saved quantized
    if quantization_config is not None:
        torchao.quantize_as_transformers_does(model, quantization_config)
    device = torch.device(device)
    if example_inputs is None:
        example_inputs = (torch.zeros(1, 16, dtype=torch.long, device=device),)  # (batch, seq) token ids
    return compile_group(model, example_inputs=example_inputs, example_kwargs=example_kwargs, world_size=world_size,
                         group=group, plan=plan, checkpoint=path, max_cache_len=None, options=options,
                         runtime=runtime_options(runtime, trace_cache=True))


def load(path: str | os.PathLike[str], model: torch.nn.Module, *, world_size: int | None = None,
         example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any] | None = None, group: Any = None,
         plan: Plan | str | os.PathLike[str] | None = None, options: PlanOptions | None = None,
         runtime: RuntimeOptions | None = None, **deprecated: Any) -> TensorParallelModule:
    """Read a directory written by ``tp.save(path)`` (at any world size) into ``model`` (meta is fine), split
    over ``world_size`` ranks: ``autotp.compile(model, world_size=world_size, ..., checkpoint=path)``
    (``runtime.trace_cache`` defaults to True, as in :func:`from_pretrained`). A causal LM's ``tp.generate``
    reads its generation graphs' blocks from ``path`` too, as after :func:`from_pretrained`."""
    options = plan_options(moved_to_options("autotp.load", options, deprecated, taken=("hardware",)))
    return compile_group(model, example_inputs=example_inputs, example_kwargs=example_kwargs, world_size=world_size,
                         group=group, plan=plan, checkpoint=path, max_cache_len=None, options=options,
                         runtime=runtime_options(runtime, trace_cache=True))
