"""A HuggingFace causal LM with its KV cache as explicit graph state, ready for capture.

:class:`CachedCausalLM` wraps a ``*ForCausalLM`` model so that one call runs ``S`` new tokens
against a preallocated cache and returns their logits::

    logits = CachedCausalLM(model, batch_size=2, max_cache_len=256)(
        input_ids,        # (batch, S) new tokens
        position_ids,     # (batch, S) their positions in the text (left padding shifts them)
        cache_position,   # (S,) the cache slots they are written to
        attention_mask,   # (batch, max_cache_len) 1 where a slot holds a real token
    )                     # -> (batch, S, vocab); (batch, 1, vocab) with last_logits_only=True

The cache tensors (``key_cache_<layer>``, ``value_cache_<layer>``, each
``(batch, kv_heads, max_cache_len, head_dim)``, keys and values each with the head size the model writes)
are buffers of the wrapper, written with ``index_copy_`` at ``cache_position``. ``torch.export`` turns those
writes into buffer updates, which :mod:`autotp.capture.tracing` keeps as *state*: the planner chooses the cache's
placement like a parameter's (split by kv heads where attention is head-parallel, or whole), and the runtime
applies the update in place on its own block. Nothing here names a model family: the cache is
HuggingFace's ``StaticCache``, its layers shaped as the model writes them (one call on fake tensors, so a
latent cache such as DeepSeek-V3's gets the latent's shape), and the positions come in as tensors, so one
captured graph serves every position.

A model whose every layer keeps a convolution and an SSM state (Mamba, Mamba2) gets buffers ``conv_state_<layer>``
and ``ssm_state_<layer>`` instead (shaped as the model writes them), held in a transformers cache bound to them at
each call (:mod:`autotp.adapters.hf_transformers`): a first chunk runs the model's prefill path from an empty state
and its new states are copied into the buffers; any other call runs its decode path, which updates them in place.
Hybrids (attention in some layers) are refused with :class:`~autotp.base.errors.UnsupportedModelError`
(:func:`check_keys_and_values_only`).

Inside :meth:`CachedCausalLM.first_chunk` a call is the first chunk of a prompt (slots ``0..S-1`` of an
empty cache): it still writes its keys and values, but attends to those ``S`` only (the mask built for
``S`` keys, not ``max_cache_len``), as HF's own prefill does. The graph captured that way serves the
common case, a prompt of one chunk, without reading or masking the cache's empty slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autotp.adapters import hf_transformers
from autotp.base.errors import AutoTPError, CaptureError, UnsupportedModelError
from autotp.capture.tracing import shapes_only

__all__ = ["CacheLayout", "CachedCausalLM", "check_causal_lm", "check_keys_and_values_only"]


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """What a model compiled with a KV cache was built for.

    ``batch_size``: rows of the cache (a generate call may use fewer); ``max_cache_len``: the most
    tokens (prompt + new) one row can hold; ``prefill_len``: tokens one prefill call takes (the
    example input's sequence length; 1 when there is no separate prefill graph);
    ``vocab_size``: size of the logits' last dim; ``eos_token_ids`` and ``pad_token_id``: the
    model's ``generation_config`` defaults, which ``generate`` uses when the call names none (as
    HF's ``model.generate`` does). ``recurrent``: the model keeps a convolution and a recurrent state per layer
    (overwritten whole at every step): a prompt goes through the prefill graph once, its first ``prefill_len``
    tokens from an empty state, then one token per decode call, so no token is ever applied to the state twice.
    """

    batch_size: int
    max_cache_len: int
    prefill_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    recurrent: bool = False


def generation_defaults(model: torch.nn.Module) -> tuple[tuple[int, ...], int | None]:
    """``(eos ids, pad id)`` from ``model.generation_config`` (empty / ``None`` where it names none)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    eos_ids = (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in (eos or ()))
    return eos_ids, (int(pad) if isinstance(pad, int) else None)


def check_causal_lm(model: torch.nn.Module) -> None:
    """Raise ``TypeError`` unless ``model`` is a HuggingFace model with a causal-LM head."""
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if config is None or not callable(can_generate) or not can_generate() or head is None:
        raise TypeError(
            f"{type(model).__name__} is not a HuggingFace causal language model (a *ForCausalLM with an LM head "
            "and generate()); max_cache_len= and generate() need one. Load it with "
            "AutoModelForCausalLM.from_pretrained(...), or compile without max_cache_len for a plain forward."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError(f"{type(model).__name__} is an encoder-decoder model; autotp generates with decoder-only LMs")


_WHAT_WORKS = ("autotp's generation holds a KV cache (keys and values per attention layer, split by heads or "
               "whole), or a convolution and an SSM state in every layer (Mamba, Mamba2), not a mix of them and no "
               "other state. Its forward works: autotp.compile(model, example_inputs=(ids,)) and "
               "tp(ids).logits; generate with model.generate meanwhile.")


def check_keys_and_values_only(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedModelError`, naming the family, where ``model`` keeps a state between generation
    steps other than keys and values per attention layer, or a convolution and a recurrent state in every layer
    (Mamba, Mamba2: :func:`~autotp.adapters.hf_transformers.recurrent_layers_only`, held by the wrapper); hybrids
    (some layers attention, some an SSM) and state kept in module attributes are refused."""
    state = hf_transformers.recurrent_state(model)
    if state is not None and not hf_transformers.recurrent_layers_only(model):
        raise UnsupportedModelError(f"{type(model).__name__} keeps {state}; {_WHAT_WORKS}")


def _layer_class() -> type:
    _, static_layer = hf_transformers.static_cache_classes()

    class PositionedLayer(static_layer):  # type: ignore[misc, valid-type]
        """A static cache layer written at the slots given by the call (``positions``), not by a counter.

        HF's ``StaticLayer`` keeps the next slot in a tensor it increments in place; as graph
        state that counter would be one more buffer the ranks must keep equal. Here the slots
        are an input of every call, so the graph's only state is the keys and values.
        """

        positions: torch.Tensor
        first_chunk: bool = False  # the call fills slots 0..S-1 of an empty cache and attends to them only
        written: tuple[torch.Size, torch.Size] | None = None  # shapes of the last update's keys and values

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            # keys: (batch, kv_heads, max_cache_len, k_head_dim); key_states: (batch, kv_heads, S, k_head_dim);
            # values alike with v_head_dim (DeepSeek's latent cache: one "head", kv_lora_rank and rope dims)
            self.written = (key_states.shape, value_states.shape)
            if self.keys is None:  # the shapes probe (CachedCausalLM._written_shapes): nothing held yet
                return key_states, value_states
            self.keys.index_copy_(2, self.positions, key_states)
            self.values.index_copy_(2, self.positions, value_states)
            if self.first_chunk:
                return key_states, value_states
            return self.keys, self.values

        def get_seq_length(self) -> torch.Tensor | int:  # type: ignore[override]
            """Slot of the first new token: the offset of the queries in the attention mask."""
            return 0 if self.first_chunk else self.positions[0]

        def get_mask_sizes(self, query: int | torch.Tensor, *args: Any) -> tuple[int, int]:
            """``(keys attended, offset of the first)``: the whole cache, or the chunk's own keys.

            ``query``: the query length (or, before transformers 5.1, the chunk's cache positions)."""
            if self.first_chunk:
                return hf_transformers.mask_query_length(query), 0
            return self.max_cache_len, 0

    return PositionedLayer


class CachedCausalLM(torch.nn.Module):
    """``model`` with a static KV cache of ``batch_size`` rows and ``max_cache_len`` slots (see module docstring)."""

    def __init__(self, model: torch.nn.Module, *, batch_size: int, max_cache_len: int,
                 last_logits_only: bool = False, layers: range | None = None,
                 inputs_device: torch.device | None = None, shaped_by: torch.nn.Module | None = None) -> None:
        """``layers``: the decoder layers whose cache this wrapper holds (default: all); a pipeline stage
        holds its own layers' only (:mod:`autotp.runtime.mesh.mesh_generate`), the others get no buffer.
        ``inputs_device``: where :meth:`example_inputs` are made (default: the model's device; a model on meta
        is traced as if on the device of its inputs, :mod:`autotp.capture.tracing`). ``shaped_by``: the model whose
        one-token call shapes the cache (default: ``model``; a pipeline stage's view runs a slice of the layers,
        so it passes the whole model, whose weights and layer indices it shares)."""
        super().__init__()
        check_causal_lm(model)
        for name, value in (("batch_size", batch_size), ("max_cache_len", max_cache_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if isinstance(limit, int) and max_cache_len > limit:
            raise ValueError(
                f"max_cache_len={max_cache_len} is more than the model's max_position_embeddings={limit}; "
                f"pass max_cache_len <= {limit}"
            )
        hf_transformers.check_release("generation", hf_transformers.GENERATION_RELEASES)
        check_keys_and_values_only(model)
        self.model = model
        self.batch_size = batch_size
        self.max_cache_len = max_cache_len
        # generation reads only the last position's logits: HF's logits_to_keep=1 skips the LM head (and any
        # collective on its output) for the other positions of a prefill chunk
        self.logits_to_keep = 1 if last_logits_only else 0
        self.reads_cache = True  # False inside first_chunk()
        # every layer keeps a convolution and a recurrent state (Mamba, Mamba2), overwritten whole at each step
        self.recurrent = hf_transformers.recurrent_layers_only(model)
        if self.recurrent:
            self._hold_recurrent_state(model if shaped_by is None else shaped_by, layers, inputs_device)
            return
        static_cache, _ = hf_transformers.static_cache_classes()
        config = model.config.get_text_config()
        cache = static_cache(config=config, max_cache_len=max_cache_len)
        layer_class = _layer_class()
        # every layer holds every slot (a sliding window is applied by the attention mask, not by the cache)
        cache.layers = [layer_class(max_cache_len) for _ in cache.layers]
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.inputs_device = device if inputs_device is None else torch.device(inputs_device)
        self.cache = cache
        written = self._written_shapes(model if shaped_by is None else shaped_by)
        # a layer that writes no keys and values (one that reads another layer's) holds no cache
        held = [i for i in (range(len(cache.layers)) if layers is None else layers) if written[i] is not None]
        for i in held:
            (_, k_heads, _, k_dim), (_, v_heads, _, v_dim) = written[i]  # type: ignore[misc]
            keys = torch.empty(batch_size, k_heads, 0, k_dim, dtype=dtype, device=device)
            values = torch.empty(batch_size, v_heads, 0, v_dim, dtype=dtype, device=device)
            hf_transformers.initialize_static_layer(cache.layers[i], keys, values)
        for i in held:
            self.register_buffer(f"key_cache_{i}", cache.layers[i].keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", cache.layers[i].values, persistent=False)

    def _written_shapes(self, model: torch.nn.Module) -> list[tuple[torch.Size, torch.Size] | None]:
        """Per cache layer, the shapes of the keys and values ``model`` writes for one token at batch 1 (None
        where it writes none), from one call on fake tensors (:func:`autotp.capture.tracing.shapes_only`): the cache is
        shaped as the model writes it, whatever its config says (keys and values of their own head dims, a
        latent, a per-layer head count)."""
        device = self.inputs_device if self.inputs_device.type != "meta" else torch.device("cpu")
        for layer in self.cache.layers:
            layer.written = None
        with _one_token_probe(model, device, "its KV cache"), self.first_chunk():
            ids = torch.zeros(1, 1, dtype=torch.long, device=device)
            self._bind_cache(torch.zeros(1, dtype=torch.long, device=device))
            model(input_ids=ids, position_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                  **hf_transformers.cache_call_kwargs(model, self.cache, ids[0]))
        written = [layer.written for layer in self.cache.layers]
        if not any(written):
            raise UnsupportedModelError(
                f"{type(model).__name__} writes no keys and values through transformers' cache: it keeps its "
                f"state another way. {_WHAT_WORKS}"
            )
        return written

    def _hold_recurrent_state(self, model: torch.nn.Module, layers: range | None,
                              inputs_device: torch.device | None) -> None:
        """Buffers ``conv_state_<layer>`` and ``ssm_state_<layer>`` of every layer, zero, shaped (and typed) as
        ``model`` writes them for one token at batch 1 (on fake tensors), with ``batch_size`` rows."""
        if layers is not None:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} keeps a convolution and a recurrent state in every layer; a pipeline "
                "stage of such a model is not covered: generate it with autotp.compile (tensor parallel only)"
            )
        device = next(model.parameters()).device
        self.inputs_device = device if inputs_device is None else torch.device(inputs_device)
        probe_device = self.inputs_device if self.inputs_device.type != "meta" else torch.device("cpu")
        cache = hf_transformers.recurrent_cache(model)
        with _one_token_probe(model, probe_device, "its convolution and recurrent states"):
            ids = torch.zeros(1, 1, dtype=torch.long, device=probe_device)
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                  **hf_transformers.recurrent_cache_kwargs(model, cache))
        for i, layer in enumerate(cache.layers):
            state = hf_transformers.recurrent_state_tensors(layer)
            if state is None:
                raise UnsupportedModelError(
                    f"{type(model).__name__} wrote no convolution and recurrent state for layer {i} through "
                    f"transformers' cache: it keeps its state another way. {_WHAT_WORKS}"
                )
            for name, written in ((f"conv_state_{i}", state.conv), (f"ssm_state_{i}", state.recurrent)):
                # conv: (batch, channels, conv_kernel); ssm: (batch, intermediate, state_size) or per head
                self.register_buffer(name, torch.zeros(self.batch_size, *written.shape[1:], dtype=written.dtype,
                                                       device=device), persistent=False)
        self.cache = cache

    def _state_names(self, layer: int) -> tuple[str, str]:
        """The two buffers of ``layer``: keys and values, or the convolution and recurrent states."""
        if self.recurrent:
            return f"conv_state_{layer}", f"ssm_state_{layer}"
        return f"key_cache_{layer}", f"value_cache_{layer}"

    @property
    def own_layers(self) -> list[int]:
        """The layers whose cache this wrapper holds: those it has buffers for (the twin :mod:`autotp.capture.stamping`
        traces holds its few layers' only)."""
        return [i for i in range(len(self.cache.layers)) if self._state_names(i)[0] in self._buffers]

    def cache_buffer_names(self) -> list[str]:
        """Names of the cache buffers this wrapper holds (keys and values, or convolution and recurrent states,
        of each held layer)."""
        return [name for i in self.own_layers for name in self._state_names(i)]

    def stamping_layer_state(self) -> tuple[torch.nn.Module, list[tuple[str, str]]] | None:
        """For :mod:`autotp.capture.stamping`: the decoder whose layers are stamped, and each layer's cache buffers
        (state this wrapper holds outside the decoder's layer list), so that a graph traced with three layers
        is stamped out to all, cache included."""
        return self.model, [self._state_names(i) for i in self.own_layers]

    def example_inputs(self, tokens: int, batch_size: int | None = None) -> tuple[torch.Tensor, ...]:
        """Inputs of a call with ``tokens`` new tokens per row, at the start of the cache, on ``inputs_device``."""
        batch = self.batch_size if batch_size is None else batch_size
        device = self.inputs_device
        input_ids = torch.zeros(batch, tokens, dtype=torch.long, device=device)
        positions = torch.arange(tokens, device=device)
        attention_mask = torch.zeros(batch, self.max_cache_len, dtype=torch.long, device=device)
        attention_mask[:, :tokens] = 1
        return input_ids, positions.expand(batch, tokens).clone(), positions, attention_mask

    @contextmanager
    def first_chunk(self) -> Iterator[None]:
        """Calls in this block are the first chunk of a prompt: written to slots ``0..S-1`` of an empty cache,
        attending to those ``S`` keys only (see the module docstring). For capture only: the graph traced
        here is right only at ``cache_position = 0..S-1``."""
        self.reads_cache = False
        try:
            yield
        finally:
            self.reads_cache = True

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        if self.recurrent:
            return self._recurrent_forward(input_ids, cache_position, attention_mask)
        self._bind_cache(cache_position)
        out = self.model(input_ids=input_ids, position_ids=position_ids,
                         attention_mask=self._mask_of_call(attention_mask, int(input_ids.shape[1])), use_cache=True,
                         **hf_transformers.cache_call_kwargs(self.model, self.cache, cache_position),
                         **self._logits_kwargs())
        logits = out.logits  # (batch, S, vocab), or (batch, 1, vocab) with last_logits_only
        return logits[:, -1:] if self.logits_to_keep and logits.shape[1] != 1 else logits

    def _recurrent_forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor,
                           attention_mask: torch.Tensor) -> torch.Tensor:
        """A call of a model whose layers keep a convolution and a recurrent state: in a first chunk from an
        empty state (the model's prefill path; its new states are copied into the buffers whole), else from the
        buffers (its decode path, which updates them in place). The model gets the padding mask of the call's
        own tokens; positions are implied by the state."""
        cache = hf_transformers.recurrent_cache(self.model)
        held = self.own_layers  # all, or the few layers of the twin that autotp.capture.stamping traces
        for i in held:
            conv, ssm = (getattr(self, name) for name in self._state_names(i))  # through the module: buffer updates
            hf_transformers.bind_recurrent_state(
                cache.layers[i], hf_transformers.RecurrentLayerState(conv, ssm) if self.reads_cache else None)
        mask = attention_mask[:, :input_ids.shape[1]] if not self.reads_cache else attention_mask.index_select(
            1, cache_position)  # (batch, S)
        out = self.model(input_ids=input_ids, attention_mask=mask, use_cache=True,
                         **hf_transformers.recurrent_cache_kwargs(self.model, cache), **self._logits_kwargs())
        for i in held:
            state = hf_transformers.recurrent_state_tensors(cache.layers[i])
            for name, new in zip(self._state_names(i), (None, None) if state is None else (state.conv, state.recurrent),
                                 strict=True):
                buffer = getattr(self, name)
                if new is None:
                    raise UnsupportedModelError(f"{type(self.model).__name__} left the state of layer {i} unwritten")
                if new is not buffer:  # the prefill path's new tensors; the decode path wrote the buffers in place
                    buffer.copy_(new)
        logits = out.logits  # (batch, S, vocab), or (batch, 1, vocab) with last_logits_only
        return logits[:, -1:] if self.logits_to_keep and logits.shape[1] != 1 else logits

    def _bind_cache(self, cache_position: torch.Tensor) -> None:
        """Point every cache layer at this call's slots, and each held layer at its buffers."""
        held = set(self.own_layers)
        for i, layer in enumerate(self.cache.layers):
            layer.positions = cache_position
            layer.first_chunk = not self.reads_cache
            if i in held:
                # read the buffers through the module, so that export sees the writes as buffer updates
                layer.keys = getattr(self, f"key_cache_{i}")
                layer.values = getattr(self, f"value_cache_{i}")

    def _mask_of_call(self, attention_mask: torch.Tensor, tokens: int) -> torch.Tensor:
        """The padding mask the model gets: every slot's, or in a first chunk its own ``tokens`` slots'."""
        return attention_mask if self.reads_cache else attention_mask[:, :tokens]

    def _logits_kwargs(self) -> dict[str, int]:
        """``logits_to_keep`` for HF models whose forward takes it (transformers >= 4.50), else nothing."""
        import inspect

        if self.logits_to_keep and "logits_to_keep" in inspect.signature(self.model.forward).parameters:
            return {"logits_to_keep": self.logits_to_keep}
        return {}


@contextmanager
def _one_token_probe(model: torch.nn.Module, device: torch.device, what: str) -> Iterator[None]:
    """A call of ``model`` on fake tensors (:func:`autotp.capture.tracing.shapes_only`) that finds the shapes of ``what``;
    a failure of the model's own code becomes a :class:`CaptureError` naming it (autotp's own errors pass)."""
    try:
        with shapes_only(model, device):
            yield
    except AutoTPError:
        raise
    except Exception as error:  # any failure of the model's own code, named with its cause
        raise CaptureError(f"could not run {type(model).__name__} on one token to find the shapes of {what} "
                           f"({type(error).__name__}: {error})") from error
