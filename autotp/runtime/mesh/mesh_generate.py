"""Text generation over a ``DeviceMesh``: ``autotp.compile_mesh(model, mesh, example_inputs=(ids,), max_cache_len=N)``.

Returns a :class:`MeshGenerationModule`; its :meth:`~MeshGenerationModule.generate` takes the
arguments of :func:`autotp.runtime.generation.generate.generate` (HuggingFace ``model.generate``'s) and
returns the whole batch's tokens on every rank. Greedy decoding gives the tokens one process does.

- **tp**: each ``mesh["tp"]`` sub-group compiles its part for generation as
  :func:`autotp.compile` with ``max_cache_len`` does over one group (decode and prefill graphs,
  one set of weight shards, the KV cache placed by the planner): see :mod:`autotp.runtime.generation.compile_for_generation`.
- **pp**: each stage compiles a :class:`StageCachedLM`: the model with the other stages' layer
  blocks replaced by pass-throughs (their weights dropped), a KV cache for its own layers only,
  stage 0 taking the token ids and the others the previous stage's hidden states, the last stage
  giving logits and the others their last block's hidden states. Per prompt chunk and per new
  token, stage ``i`` runs its graph and sends the hidden states to stage ``i + 1``
  (``dist.send``/``recv`` over ``mesh["pp"]``, each tp rank to the same tp rank of the next
  stage); the last stage picks the tokens and broadcasts them over ``mesh["pp"]``, so every rank
  runs the same loop (:func:`~autotp.runtime.generation.generate.generation_loop`): same eos stop, same
  ``max_new_tokens``. No microbatches: one token per row per step leaves nothing to overlap.
- **dp**: each ``mesh["dp"]`` replica generates its slice of the rows (``torch.tensor_split``
  order, as the forward pass splits the batch) with a cache of ``ceil(batch / dp)`` rows; the
  replicas' outputs, padded with ``pad_token_id`` to the longest (a replica whose rows all ended
  stops early, as HF pads finished rows), are gathered so every rank returns every row.

Sampling (``do_sample=True``) needs ``seed``: the last stage's ranks draw from a generator seeded
with ``seed + replica index``, so a run is reproducible; with ``dp == 1`` the draws equal one
process's with ``torch.manual_seed(seed)``-style seeding of :func:`autotp.runtime.generation.generate.generate`
(with ``dp > 1`` each replica draws for its rows only, so the samples differ from one process's).

A stage's ``tp_plan`` in the :class:`~autotp.planning.mesh_plan.ParallelPlan` is a forward plan of
the stage's forward graph; generation plans each stage's decode and prefill graphs itself (on the
first rank of its tp group), so the plan's stage cuts are used and its ``tp_plan`` s are not.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autotp.base.module_paths import layer_blocks
from autotp.capture.kv_cache import CachedCausalLM
from autotp.capture.trace_cache import open_trace_cache
from autotp.capture.tracing import check_model, trace_device
from autotp.planning.even_stages import even_parallel_plan
from autotp.planning.mesh_plan import ParallelPlan, as_parallel_plan
from autotp.planning.options import PlanOptions, plan_options
from autotp.runtime.agreement.exchanges import agreed_options, options_record, ranks_agree
from autotp.runtime.execution.module import TensorParallelModule
from autotp.runtime.execution.options import RuntimeOptions, runtime_host
from autotp.runtime.execution.rank_local import GenerationGraphs
from autotp.runtime.execution.runtime_modes import mode_and_pricing
from autotp.runtime.generation.compile_for_generation import check_generation_inputs, compile_for_generation
from autotp.runtime.mesh.mesh_module import (
    check_plan_for_mesh,
    dim_group,
    gather_batch,
    mesh_coordinate,
    mesh_record,
    mesh_shape_of,
    replica_sizes,
)

__all__ = ["MeshGenerationModule", "StageCachedLM", "compile_generation_on_mesh", "stage_view"]


# --------------------------------------------------------------------------- one stage's model

class _PassThrough(nn.Module):
    """Stands in for another stage's layer block: returns the hidden states it is given."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class _Slot:
    """One tensor handed between the stage wrapper and a block within one call (a plain object, not a
    module attribute: ``torch.export`` traces through it as through a local variable)."""

    value: torch.Tensor | None = None


class _Inject(nn.Module):
    """The stage's first block, fed the previous stage's hidden states (``slot.value``, set per call) instead
    of what the model computed before it (the embedding of placeholder inputs, discarded)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.slot = _Slot()

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.block(self.slot.value, *args, **kwargs)


class _Tap(nn.Module):
    """The stage's last block, keeping its output hidden states (``slot.value``) for the next stage."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.slot = _Slot()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.block(*args, **kwargs)
        self.slot.value = out[0] if isinstance(out, tuple) else out
        return out


def _with_modules(module: nn.Module, replacements: dict[str, nn.Module], prefix: str = "") -> nn.Module:
    """A shallow copy of ``module`` with the submodules at the FQNs of ``replacements`` swapped; the
    modules on the way are copied, everything else (weights included) is shared with ``module``."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    for name, child in module._modules.items():
        fqn = prefix + name
        if fqn in replacements:
            clone._modules[name] = replacements[fqn]
        elif child is not None and any(key.startswith(fqn + ".") for key in replacements):
            clone._modules[name] = _with_modules(child, replacements, fqn + ".")
    return clone


def _fqn_of(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules(remove_duplicate=False):
        if module is target:
            return name
    raise ValueError(f"{type(target).__name__} is not a submodule of {type(model).__name__}")


def stage_view(model: nn.Module, first: int, stop: int, *, last: bool) -> tuple[nn.Module, _Inject | None, _Tap | None]:
    """``model`` as pipeline stage ``[first, stop)`` of its layer blocks (see :mod:`autotp.runtime.mesh.mesh_generate`),
    sharing its weights; ``model`` itself is left as it was. Returns the view, the first block's
    :class:`_Inject` (``None`` for stage 0) and the last block's :class:`_Tap` (``None`` for the last stage)."""
    blocks = layer_blocks(model)
    replacements: dict[str, nn.Module] = {fqn: _PassThrough() for index, fqn in enumerate(blocks)
                                          if not first <= index < stop}
    inject = tap = None
    if first > 0:
        inject = _Inject(model.get_submodule(blocks[first]))
        replacements[blocks[first]] = inject
        replacements[_fqn_of(model, model.get_input_embeddings())] = nn.Identity()
    if not last:
        inner = replacements.get(blocks[stop - 1], model.get_submodule(blocks[stop - 1]))
        tap = _Tap(inner)
        replacements[blocks[stop - 1]] = tap
        replacements[_fqn_of(model, model.get_output_embeddings())] = nn.Identity()
    return _with_modules(model, replacements), inject, tap


class StageCachedLM(CachedCausalLM):
    """Pipeline stage ``[first, stop)`` of a causal LM with the KV cache of its own layers, ready for capture.

    Called like :class:`~autotp.capture.kv_cache.CachedCausalLM` except that the first input is the
    token ids on stage 0 and the previous stage's hidden states ``(batch, S, hidden)`` on the others;
    returns logits ``(batch, 1, vocab)`` on the last stage, its last block's hidden states
    ``(batch, S, hidden)`` on the others."""

    _inject: _Inject | None
    _tap: _Tap | None

    def __init__(self, model: nn.Module, first: int, stop: int, *, last: bool, batch_size: int,
                 max_cache_len: int) -> None:
        view, inject, tap = stage_view(model, first, stop, last=last)
        super().__init__(view, batch_size=batch_size, max_cache_len=max_cache_len, last_logits_only=True,
                         layers=range(first, stop), shaped_by=model)
        # plain attributes, not submodules: they are inside self.model already
        self.__dict__["_inject"] = inject
        self.__dict__["_tap"] = tap
        self.hidden_size = int(model.get_input_embeddings().weight.shape[-1])
        self.dtype = next(model.parameters()).dtype

    def stamping_layer_state(self) -> None:
        """Not stamped (:mod:`autotp.capture.stamping`): a stage runs a slice of the layers, through hooks of its own."""
        return None

    def example_inputs(self, tokens: int, batch_size: int | None = None) -> tuple[torch.Tensor, ...]:
        ids, positions, cache_position, mask = super().example_inputs(tokens, batch_size)
        if self._inject is None:
            return ids, positions, cache_position, mask
        hidden = torch.zeros(*ids.shape, self.hidden_size, dtype=self.dtype, device=ids.device)
        return hidden, positions, cache_position, mask

    def forward(self, first_input: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        self._bind_cache(cache_position)
        if self._inject is None:
            given = {"input_ids": first_input}
        else:
            self._inject.slot.value = first_input
            given = {"inputs_embeds": first_input}  # shapes the mask; the first block reads first_input itself
        out = self.model(**given, position_ids=position_ids,
                         attention_mask=self._mask_of_call(attention_mask, int(first_input.shape[1])), cache=self.cache,
                         use_cache=True, **self._logits_kwargs())
        if self._tap is not None:
            value, self._tap.slot.value = self._tap.slot.value, None
            assert value is not None
            return value
        logits = out.logits
        return logits[:, -1:] if self.logits_to_keep and logits.shape[1] != 1 else logits


# --------------------------------------------------------------------------- the module

class MeshGenerationModule(nn.Module):
    """This rank's part of a causal LM compiled for generation over a dp x pp x tp mesh (see
    :mod:`autotp.runtime.mesh.mesh_generate`). ``generate`` returns the whole batch's tokens on every rank.

    Attributes: ``plan`` (the :class:`ParallelPlan`: mesh and stage cuts), ``stage_module`` (this rank's
    :class:`~autotp.runtime.execution.module.TensorParallelModule`, with its ``generation`` graphs and plans),
    ``stage_index``, ``replica_index``.
    """

    stage_module: TensorParallelModule
    generation: GenerationGraphs

    def __init__(self, plan: ParallelPlan, mesh: Any, stage_module: TensorParallelModule, *, hidden_size: int,
                 dtype: torch.dtype, seed_offset: int) -> None:
        super().__init__()
        self.plan = plan
        self.stage_module = stage_module
        self.stage_index = mesh_coordinate(mesh, "pp")
        self.replica_index = mesh_coordinate(mesh, "dp")
        assert stage_module.generation is not None, "compiled with max_cache_len, the stage has generation graphs"
        self.generation = stage_module.generation
        self._dp_group = dim_group(mesh, "dp") if plan.mesh.dp > 1 else None
        self._pp_group = dim_group(mesh, "pp") if plan.mesh.pp > 1 else None
        self._hidden = (hidden_size, dtype)
        self._seed_offset = seed_offset

    @property
    def world_size(self) -> int:
        return self.plan.mesh.world_size

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this rank holds: its stage's, split over its tp group."""
        return int(self.stage_module.parameter_bytes())

    def cache_bytes(self) -> int:
        """Bytes of KV cache this rank holds: its stage's layers, its block of their heads, its replica's rows."""
        return int(self.stage_module.cache_bytes())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a model compiled with mesh= and max_cache_len= generates: call .generate(input_ids, ...); "
                        "compile without max_cache_len for a forward pass over the mesh")

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = 50, top_p: float | None = 1.0, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, seed: int | None = None, streamer: Any = None) -> torch.Tensor:
        """Prompt ``input_ids`` ``(batch, prompt)`` then up to ``max_new_tokens`` new tokens per row, the whole
        batch on every rank; arguments as :func:`autotp.runtime.generation.generate.generate` (call on every rank)."""
        from autotp.runtime.generation.generate import check_request, generation_loop, next_tokens

        layout = self.generation.layout
        dp = self.plan.mesh.dp
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be integer token ids of shape (batch, seq), got {input_ids!r:.80}")
        rows = int(input_ids.shape[0])
        if dp > 1:
            if rows < dp:
                raise ValueError(f"input_ids has {rows} row(s) but the mesh has dp={dp} replicas, each generating "
                                 f"its slice of the rows; pass at least {dp} rows or use a mesh with a smaller dp")
            if streamer is not None:
                raise ValueError("streamer= with dp > 1: each replica generates other rows; stream from a mesh "
                                 "without dp, or read the returned tokens")
            sizes = replica_sizes(rows, dp)
            start = sum(sizes[: self.replica_index])
            stop = start + sizes[self.replica_index]
            input_ids = input_ids[start:stop]
            attention_mask = attention_mask[start:stop] if isinstance(attention_mask, torch.Tensor) else attention_mask
        check_request(layout, self.world_size, input_ids, attention_mask, max_new_tokens, do_sample, seed)
        last = self.plan.mesh.pp - 1
        group = self._pp_group

        def pick(logits: torch.Tensor | None, generator: torch.Generator | None) -> torch.Tensor:
            """The last stage picks every row's token; the other stages receive it."""
            if self.stage_index == last:
                assert logits is not None
                token = next_tokens(logits, do_sample=do_sample, temperature=temperature, top_k=top_k,
                                    top_p=top_p, generator=generator)
            else:
                token = torch.empty(layout.batch_size, dtype=torch.long)
            if group is not None:
                dist.broadcast(token, group=group, group_src=last)
            return token

        output = generation_loop(layout, self._phase_runner, input_ids, attention_mask,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                 pad_token_id=pad_token_id,
                                 seed=None if seed is None else seed + self._seed_offset,
                                 streamer=streamer, pick=pick)
        if dp == 1:
            return output
        assert self._dp_group is not None
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        longest = torch.tensor([output.shape[1]])
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self._dp_group)
        if output.shape[1] < int(longest):  # this replica's rows all ended early: pad them, as HF does
            output = torch.cat([output, output.new_full((output.shape[0], int(longest) - output.shape[1]), pad)], 1)
        return gather_batch(output, sizes, self._dp_group)

    def _phase_runner(self, phase: str) -> Any:
        """The stage's graph for ``phase`` between a receive from the previous stage and a send to the next:
        logits on the last stage, ``None`` on the others (see :func:`~autotp.runtime.generation.generate.generation_loop`)."""
        inner = self.stage_module.phase_runner(phase)
        if self._pp_group is None:
            return inner
        group, index, last = self._pp_group, self.stage_index, self.plan.mesh.pp - 1
        hidden_size, dtype = self._hidden

        def run(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
            first = inputs[0]
            if index > 0:
                first = torch.empty(*inputs[0].shape, hidden_size, dtype=dtype)
                dist.recv(first, group=group, group_src=index - 1)
            out = inner((first, *inputs[1:]))
            if index == last:
                return out
            dist.send(out.contiguous(), group=group, group_dst=index + 1)
            return None

        return run


# --------------------------------------------------------------------------- compile

def compile_generation_on_mesh(model: nn.Module, mesh: Any, *, example_inputs: tuple[Any, ...], max_cache_len: int,
                               plan: ParallelPlan | str | os.PathLike[str] | None, options: PlanOptions,
                               runtime: RuntimeOptions) -> MeshGenerationModule:
    """This rank's :class:`MeshGenerationModule` (see the module docstring and :func:`autotp.compile_mesh`).
    ``options``: each stage's planning options (the generation graphs have static shapes: the cache fixes
    them, so ``dynamic`` does not apply), priced in the runtime mode that runs. ``runtime``: its ``runtime_mode``
    runs each stage's graphs (as :func:`autotp.compile`'s), its ``trace_cache`` keeps and reuses their programs
    and plans."""
    timeout_s = runtime.agreement_timeout_s
    with ranks_agree(None, timeout_s=timeout_s, what="autotp.compile_mesh(..., max_cache_len=...)") as agreement:
        check_model(model)
        shape = mesh_shape_of(mesh)
        batch, _ = check_generation_inputs(model, example_inputs, max_cache_len)
        if batch < shape.dp:
            raise ValueError(f"the example ids have {batch} row(s) but the mesh has dp={shape.dp} replicas, each "
                             f"with a cache for its slice of the rows; pass at least {shape.dp} rows")
        plan = as_parallel_plan(plan)
        plan = check_plan_for_mesh(plan if plan is not None else even_parallel_plan(model, shape), shape, model)
        device = trace_device(example_inputs, {})
        mode, options = mode_and_pricing(plan_options(options, world_size=shape.tp), runtime.runtime_mode, device,
                                         talk=options.progress and dist.get_rank() == 0)
        record = mesh_record(plan, example_inputs, {})
        record.update(max_cache_len=max_cache_len, expected_new_tokens=options.expected_new_tokens,
                      options=agreed_options(options))
        agreement.record = options_record(record, weights=dict(model.state_dict()) if runtime.check_weights else None)
    rows = math.ceil(batch / shape.dp)  # every replica's cache holds the largest slice
    ids = example_inputs[0][:rows]
    tp_group = dim_group(mesh, "tp")
    if tp_group is None:  # no tp dim: each rank is its own group of one (created on every rank, in order)
        tp_group, _ = dist.new_subgroups(group_size=1)
    stage_index = mesh_coordinate(mesh, "pp")
    wrapper = None
    if shape.pp > 1:
        stage = plan.stages[stage_index]
        wrapper = StageCachedLM(model, stage.first_block, stage.stop_block, last=stage_index == shape.pp - 1,
                                batch_size=rows, max_cache_len=max_cache_len)
    module = compile_for_generation(model, (ids,), max_cache_len=max_cache_len, options=options, plan=None,
                                    group=tp_group, rank=dist.get_rank(tp_group), host=runtime_host(runtime),
                                    wrapper=wrapper, timeout_s=timeout_s, runtime_mode=mode,
                                    trace_cache=open_trace_cache(runtime.trace_cache))
    return MeshGenerationModule(plan, mesh, module, hidden_size=int(model.get_input_embeddings().weight.shape[-1]),
                                dtype=next(model.parameters()).dtype, seed_offset=mesh_coordinate(mesh, "dp"))
