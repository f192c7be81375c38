"""Generation for a plain compile of a causal LM, and a plain forward for a generation compile: each built at
its first use.

``autotp.compile(model, example_inputs=(ids,))`` of a HuggingFace causal LM traces one forward graph;
``tp.generate(ids, max_new_tokens=N)`` then needs a KV cache and the decode and prefill graphs that
``compile(..., max_cache_len=)`` builds. :class:`GenerationOnDemand` builds them on that first call,
with the same planning options, group and machinery (:func:`autotp.runtime.generation.compile_for_generation.compile_for_generation`,
given as ``build``), and keeps them for later calls:

- the cache has one row per row of the request and :func:`cache_length` slots: prompt +
  ``max_new_tokens`` rounded up to a power of two (at least :data:`MIN_CACHE_LEN`), at most the model's
  ``max_position_embeddings``; a later request that needs more rows or slots builds them again, larger
  (one set at a time: the old cache is dropped first);
- prompts go ``seq`` tokens per prefill call, ``seq`` the sequence length of the compile's example ids;
- every weight shard that the generation plan places as the forward plan does is the forward module's
  own tensor (:meth:`~autotp.runtime.execution.module.TensorParallelModule.share_weights`), so only the others are
  held twice.

The graphs are built from the model passed to ``compile``: it is held by a weak reference (the tensor-parallel
model does not keep the full weights alive), so it must still exist, with the weights it was compiled with,
at the first ``generate``. A model compiled from a checkpoint (``from_pretrained``, ``load``,
``compile(..., checkpoint=)``) builds them from that checkpoint instead (the files' headers were kept): each
rank takes the blocks its forward module holds where the generation plan places a weight alike, and reads only
the others (:class:`HeldBlocks`); a model on meta, which holds no weights, is kept alive.

Every rank must make the same request: the ranks agree on the cache size
(:func:`autotp.runtime.agreement.exchanges.ranks_agree`) before anything is traced, and any difference raises the same
error on every rank.

The other way round, ``autotp.compile(model, example_inputs=(ids,), max_cache_len=N)`` builds the generation
graphs only, whose forward is one decode step. :class:`ForwardOnDemand` gives it the model's own forward: the
first call that is not a decode step (``tp(ids)``, as the model is called) compiles the model as a plain
``autotp.compile`` would, with the same options and the call's inputs as example inputs (dynamic batch and
sequence dims: one compile serves every size), and holds the generation module's weight shards wherever the
two plans place a weight alike. The model (or, for a model on meta, the checkpoint) must still be there then.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autotp.adapters import hf_transformers
from autotp.runtime.agreement.exchanges import options_record, ranks_agree
from autotp.runtime.checkpoints.loading import ReadRequest, TensorEntry, TensorSource, match_keys, tensor_aliases
from autotp.runtime.execution.module import TensorParallelModule

__all__ = ["MIN_CACHE_LEN", "ForwardOnDemand", "GenerationOnDemand", "HeldBlocks", "cache_length"]

MIN_CACHE_LEN = 64
"""The fewest slots per row of a cache built on demand: short requests share one size, so one build serves them."""

WRAPPED_PREFIX = "model."
"""FQN prefix of the model's weights inside the generation graphs (:class:`~autotp.capture.kv_cache.CachedCausalLM`
holds the model as ``.model``)."""


def cache_length(needed: int, limit: int | None) -> int:
    """Slots per row for a request of ``needed`` tokens (prompt + new): the next power of two, at least
    :data:`MIN_CACHE_LEN`, at most ``limit`` (the model's ``max_position_embeddings``; None: no limit).
    ValueError, saying the fix, when ``needed`` exceeds ``limit``."""
    if limit is not None and needed > limit:
        raise ValueError(
            f"the request needs {needed} tokens per row (prompt + max_new_tokens), more than the model's "
            f"max_position_embeddings={limit}; pass a max_new_tokens {needed - limit} smaller (or a shorter prompt)"
        )
    length = max(MIN_CACHE_LEN, 1 << (needed - 1).bit_length())
    return length if limit is None else min(length, limit)


class HeldBlocks:
    """The checkpoint ``files`` seen through a plain compile's module ``tp``: a block that ``tp`` holds (same
    checkpoint tensor, same blocks of every rank, dtype and device) is given as ``tp``'s tensor, not read again,
    so a rank never holds two copies of it while the generation graphs are built; other blocks are read."""

    def __init__(self, files: TensorSource, tp: TensorParallelModule, model: torch.nn.Module) -> None:
        """``model``: the module ``tp`` was compiled from (its FQNs are ``tp``'s)."""
        self.path = files.path
        self.entries = files.entries
        self._files = files
        state = tp.local_state()
        self._held: dict[str, tuple[Any, torch.Tensor]] = {}  # checkpoint key -> (every rank's block, tensor)
        for fqn, key in match_keys(tensor_aliases(model), files).items():
            if fqn in tp.layout and fqn in state:
                self._held.setdefault(key, (tp.layout[fqn][1], state[fqn]))

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def __getitem__(self, key: str) -> TensorEntry:
        return self._files[key]

    def describe(self) -> str:
        return self._files.describe()

    def read(self, requests: list[ReadRequest]) -> list[torch.Tensor]:
        """Each request's block: ``tp``'s tensor where it holds that block, else read from the files."""
        out: list[torch.Tensor | None] = []
        for request in requests:
            held = self._held.get(request.entry.key)
            same = held is not None and held[0] == request.blocks and (held[1].dtype, held[1].device) == (
                request.dtype, request.device)
            out.append(held[1].detach() if same and held is not None else None)
        missing = [i for i, value in enumerate(out) if value is None]
        for i, value in zip(missing, self._files.read([requests[i] for i in missing]), strict=True):
            out[i] = value
        return [value for value in out if value is not None]


class _BuiltOnDemand:
    """What both builders hold: the compiled model by weak reference (a real model's weights must not be kept alive
    by the tensor-parallel one; a model on meta holds none, the checkpoint gives them, and is kept), how to build,
    the group, and what was built."""

    def __init__(self, model: torch.nn.Module, *, build: Callable[..., TensorParallelModule],
                 group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self._model = weakref.ref(model)
        self._kept = model if any(p.device.type == "meta" for p in model.parameters()) else None
        self._build = build
        self._group = group
        self._timeout_s = timeout_s
        self._built: TensorParallelModule | None = None

    @property
    def built(self) -> TensorParallelModule | None:
        """The module built so far (None before the first use)."""
        return self._built

    def _source(self, what: str, otherwise: str) -> torch.nn.Module:
        """The compiled model (on meta when read from a checkpoint); ValueError saying what to do when it is gone:
        ``what`` is built from it, and ``otherwise`` is the other way to get it."""
        model = self._model()
        if model is None:
            raise ValueError(f"{what} from the model passed to autotp.compile, and that model no longer exists (the "
                             f"tensor-parallel model keeps only its shards); keep a reference to it until then, or "
                             f"{otherwise}")
        return model


class GenerationOnDemand(_BuiltOnDemand):
    """``generation_on_demand`` of a plain compile's :class:`TensorParallelModule`: called as
    ``(tp, input_ids, max_new_tokens)``, returns a module compiled for generation with room for the request
    (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple[Any, ...], *,
                 build: Callable[[torch.nn.Module, tuple[Any, ...], int, TensorSource | None], TensorParallelModule],
                 group: dist.ProcessGroup | None, timeout_s: float, files: TensorSource | None = None) -> None:
        """``build(model, example_inputs, max_cache_len, files)`` compiles ``model`` for generation (every rank),
        reading its weights from ``files`` when given (the checkpoint the plain compile read) or slicing the
        model's otherwise."""
        super().__init__(model, build=build, group=group, timeout_s=timeout_s)
        if self._kept is not None and files is None:
            raise ValueError(f"{type(model).__name__} has parameters on the meta device and no checkpoint to read "
                             "them from; compile it with checkpoint='path/to/model' or load its weights first")
        ids = example_inputs[0] if example_inputs else None
        traced_ids = isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()
        self._prefill_len = int(ids.shape[1]) if traced_ids else 1
        on_device = isinstance(ids, torch.Tensor) and ids.device.type != "meta"
        self._device = ids.device if on_device else torch.device("cpu")  # where the example ids live
        self._files = files

    def __call__(self, tp: TensorParallelModule, input_ids: torch.Tensor, max_new_tokens: int) -> TensorParallelModule:
        rows, prompt = (int(s) for s in input_ids.shape)
        built = self._built
        layout = built.generation.layout if built is not None and built.generation is not None else None
        if (layout is not None and rows <= layout.batch_size and prompt + max_new_tokens <= layout.max_cache_len
                and not (layout.recurrent and prompt < layout.prefill_len)):
            return built  # type: ignore[return-value]
        with ranks_agree(self._group, timeout_s=self._timeout_s, what="generate (building the KV cache)") as agreement:
            model = self._source("generate builds its KV cache and graphs at its first call",
                                 "compile with max_cache_len=N to build them at compile time")
            limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
            max_cache_len = cache_length(prompt + max_new_tokens, limit if isinstance(limit, int) else None)
            if layout is not None:  # grow, never shrink: an earlier request's size still fits
                rows, max_cache_len = max(rows, layout.batch_size), max(max_cache_len, layout.max_cache_len)
            prefill_len = min(self._prefill_len, max_cache_len)
            if hf_transformers.recurrent_layers_only(model):  # a recurrent state starts empty in the prefill graph
                prefill_len = min(prefill_len, prompt)     # only: the prompt's first chunk goes through it whole
            agreement.record = options_record({"cache rows": rows, "max_cache_len": max_cache_len,
                                               "prompt tokens per prefill call": prefill_len}, weights=None)
        self._built = None  # the old graphs and cache go before the new ones are built
        example = (torch.zeros(rows, prefill_len, dtype=torch.long, device=self._device),)  # (batch, seq) token ids
        files = None if self._files is None else HeldBlocks(self._files, tp, model)
        built = self._build(model, example, max_cache_len, files)
        with ranks_agree(self._group, timeout_s=self._timeout_s, what="generate (sharing the weights)") as agreement:
            built.share_weights(tp, prefix=WRAPPED_PREFIX)  # the model's weights must be those compiled
            agreement.record = options_record({}, weights=None)
        built.generation_config = tp.generation_config
        self._built = built
        return built


class ForwardOnDemand(_BuiltOnDemand):
    """``forward_on_demand`` of a generation compile's :class:`TensorParallelModule`: called as
    ``(tp, args, kwargs)`` with a call that is not a decode step, returns the module of the model's plain forward,
    built at the first such call and kept (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *,
                 build: Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], TensorParallelModule],
                 group: dist.ProcessGroup | None, timeout_s: float) -> None:
        """``build(model, example_inputs, example_kwargs)`` compiles ``model``'s plain forward (every rank), as the
        generation compile was asked to, its weights from the model or from the checkpoint it read."""
        super().__init__(model, build=build, group=group, timeout_s=timeout_s)

    def __call__(self, tp: TensorParallelModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TensorParallelModule:
        if self._built is not None:
            return self._built
        model = self._source("this module was compiled for generation; its plain forward (tp(ids)) is compiled at "
                             "the first such call", "compile it without max_cache_len as well")
        built = self._build(model, args, kwargs)
        with ranks_agree(self._group, timeout_s=self._timeout_s, what="tp(...) (sharing the weights)") as agreement:
            built.share_weights(tp, other_prefix=WRAPPED_PREFIX)  # the generation graphs' weights stay the only copy
            agreement.record = options_record({}, weights=None)
        self._built = built
        return built
