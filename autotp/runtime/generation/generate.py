"""Text generation with a tensor-parallel causal LM and its sharded KV cache.

:func:`generate` (also :meth:`TensorParallelModule.generate`) follows HuggingFace's
``model.generate`` for decoder-only models: greedy decoding by default, sampling with
``do_sample=True`` (temperature, then top-k, then top-p, then a draw from the softmax), rows that
end with ``eos_token_id`` padded with ``pad_token_id``, left padding given by ``attention_mask``,
and a ``streamer`` (any object with ``put(tokens)`` and ``end()``, e.g. ``TextStreamer``).

Every rank runs the same loop on the same replicated logits, so every rank picks the same
tokens: greedy trivially, sampling because each rank draws from its own generator seeded with
the same ``seed``, the way one process seeded with ``seed`` would (``torch.manual_seed(seed)``
before ``model.generate``). Per token the loop does one graph call (the decode graph, one token
per row, the position as a tensor) and a few small tensor ops; nothing is traced, planned or
compiled after :func:`autotp.compile`.

When the decode plan issues no collective (the planner kept the whole model and cache on every
rank: at batch 1 on CPU ranks that share cores, "communication eats the gain"), every rank would
run the same decode steps; on a gloo (CPU) group only the group's first rank decodes, and the
others receive its tokens at the end (a streamer there gets them after the loop). The prompt goes
through the prefill graph on every rank when that graph has collectives (it fills every rank's
copy of the cache), and on the first rank alone when it has none. On GPUs each rank has its own
device, and every rank runs the loop as above. The rule is :func:`autotp.planning.phases.first_rank_alone`,
which the planner reads too: it prices a phase run alone at a whole core (``Hardware.alone()``).

Prompts go through the prefill graph ``prefill_len`` tokens per call: the first chunk through the
prefill graph (attending to its own keys only), later ones through the continuation graph
(attending to the cache); a prompt whose length is not a multiple reads its last ``prefill_len``
tokens again (rewriting the same cache slots), and a prompt shorter than ``prefill_len`` goes one
token per call through the decode graph. A model that keeps a recurrent state (``CacheLayout.recurrent``: Mamba)
never reads a token twice: its first ``prefill_len`` tokens go through the prefill graph (from an empty state),
the rest one per decode call; a shorter prompt is refused (a plain compile builds its graphs again for it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from autotp.capture.kv_cache import CacheLayout
from autotp.planning.phases import AlonePhases, first_rank_alone
from autotp.runtime.execution.rank_local import RankLocalModel

__all__ = ["EOS_CHECK_TOKENS", "GenerationRequest", "check_request", "check_stop_check_every", "generate", "generation_loop", "next_tokens",
           "resolve_request"]

EOS_CHECK_TOKENS = 8
"""Tokens between two looks at "has every row ended" in the compiled modes (one host sync each), unless
``generate(..., stop_check_every=k)`` says otherwise."""

_ONE_RANK_TIMEOUT_S = 3600.0
"""How long the other ranks wait for rank 0's tokens when it generates alone (a whole request)."""


def next_tokens(logits: torch.Tensor, *, do_sample: bool, temperature: float, top_k: int | None,
                top_p: float | None, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of every row from its last logits ``(batch, vocab)``, as HF generate picks it."""
    scores = logits.to(torch.float32)
    if not do_sample:
        return scores.argmax(dim=-1)
    if temperature != 1.0:
        scores = scores / temperature
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # (batch, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)
        drop[..., -1:] = False  # keep at least the most likely token
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def _check(tp: RankLocalModel, input_ids: Any, attention_mask: Any, max_new_tokens: Any,
           do_sample: bool, seed: int | None) -> None:
    layout = tp.generation.layout if tp.generation is not None else None
    if layout is None:
        raise TypeError(
            "this tensor-parallel model was compiled without a KV cache and builds none (only a HuggingFace causal LM "
            "compiled for inference does), so it cannot generate; compile it with "
            "autotp.compile(model, example_inputs=(ids,), max_cache_len=N) (N: prompt + new tokens per row)"
        )
    check_request(layout, tp.world_size, input_ids, attention_mask, max_new_tokens, do_sample, seed)


def check_stop_check_every(stop_check_every: Any) -> None:
    """ValueError unless ``stop_check_every`` is None (the runtime mode's default) or an int >= 1."""
    if stop_check_every is not None and (isinstance(stop_check_every, bool) or not isinstance(stop_check_every, int)
                                         or stop_check_every < 1):
        raise ValueError(f"stop_check_every must be an int >= 1 (tokens between two host reads of whether every row "
                         f"has ended) or None for the runtime mode's default, got {stop_check_every!r}; e.g. "
                         f"stop_check_every=8")


def _check_new_tokens(max_new_tokens: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")


def check_request(layout: CacheLayout, world_size: int, input_ids: Any, attention_mask: Any, max_new_tokens: Any,
                  do_sample: bool, seed: int | None) -> None:
    """ValueError, saying the fix, when a generate request does not fit the cache or lacks a seed to sample
    the same tokens on ``world_size`` ranks."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError(f"input_ids must be integer token ids of shape (batch, seq), got {input_ids!r:.80}")
    batch, prompt = (int(s) for s in input_ids.shape)
    if prompt < 1:
        raise ValueError("input_ids has no tokens; pass at least one prompt token per row")
    _check_new_tokens(max_new_tokens)
    if prompt + max_new_tokens > layout.max_cache_len:
        raise ValueError(
            f"the prompt ({prompt} tokens) plus max_new_tokens={max_new_tokens} is {prompt + max_new_tokens} tokens, "
            f"more than the KV cache holds (max_cache_len={layout.max_cache_len}); pass max_new_tokens <= "
            f"{layout.max_cache_len - prompt}, or compile with max_cache_len >= {prompt + max_new_tokens}"
        )
    if layout.recurrent and prompt < layout.prefill_len:
        raise ValueError(
            f"the prompt has {prompt} tokens, fewer than the {layout.prefill_len} of the prefill graph; this model "
            f"keeps a recurrent state, which only the prefill graph starts from empty, so a prompt needs at least "
            f"{layout.prefill_len} tokens: compile with example ids of {prompt} tokens (or fewer)"
        )
    if batch > layout.batch_size:
        raise ValueError(
            f"input_ids has {batch} rows but the KV cache was built for {layout.batch_size} (the batch of "
            f"example_inputs at compile time); split the batch, or compile with example ids of batch {batch}"
        )
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or tuple(attention_mask.shape) != (batch, prompt)):
        shown = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must have the shape of input_ids {(batch, prompt)}, got {shown}")
    if do_sample and seed is None and world_size > 1:
        raise ValueError(
            "do_sample=True needs seed=<int> on more than one rank: every rank draws the tokens itself, and only "
            "the same seed makes them draw the same ones"
        )


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One ``generate`` call's settings, each from the call, else its ``generation_config``, else the model's
    (:func:`resolve_request`)."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None


_HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
"""HF ``GenerationConfig()``'s defaults, for a model without a ``generation_config``."""

_HF_MAX_LENGTH = 20
"""``GenerationConfig().max_length`` up to transformers 4.x, which HF's ``generate`` reads as "no length set"."""

_HF_DEFAULT_NEW_TOKENS = 20
"""New tokens HF's ``generate`` makes when neither the call nor a config sets a length."""


def resolve_request(input_ids: Any, given: dict[str, Any], generation_config: Any,
                    model_config: Any) -> GenerationRequest:
    """The settings of a ``generate`` call as HF's ``generate`` decides them: a value the call gives (not
    None) wins, then ``generation_config``'s (the call's, else the model's ``model_config``), then HF's
    defaults. New tokens: ``max_new_tokens``, else ``max_length`` minus the prompt (a ``max_new_tokens`` of the
    call or the config wins over any ``max_length``, as in HF), else 20 (HF's default; HF also caps it at
    ``max_position_embeddings``, where here a request longer than the model allows raises); ValueError when
    ``max_length`` leaves no new token."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be integer token ids of shape (batch, seq), got {input_ids!r:.80}")
    base = generation_config if generation_config is not None else model_config

    def setting(name: str) -> Any:
        if given.get(name) is not None:
            return given[name]
        value = getattr(base, name, None)
        return value if value is not None else _HF_DEFAULTS.get(name)

    prompt = int(input_ids.shape[1])
    new_tokens = setting("max_new_tokens")  # the call's or the config's: either wins over max_length, as in HF
    max_length = setting("max_length")
    if new_tokens is None and given.get("max_length") is None and max_length in (None, _HF_MAX_LENGTH):
        new_tokens = _HF_DEFAULT_NEW_TOKENS  # no length set anywhere: HF generates 20 new tokens
    if new_tokens is None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= prompt:
            raise ValueError(
                f"max_length={max_length!r} (prompt and new tokens) leaves no new token after a prompt of {prompt} "
                f"tokens; pass max_new_tokens=N, or an int max_length > {prompt}"
            )
        new_tokens = max_length - prompt
    _check_new_tokens(new_tokens)
    return GenerationRequest(max_new_tokens=new_tokens, do_sample=bool(setting("do_sample")),
                             temperature=float(setting("temperature")), top_k=setting("top_k"),
                             top_p=setting("top_p"), eos_token_id=setting("eos_token_id"),
                             pad_token_id=setting("pad_token_id"))


def generate(tp: RankLocalModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             max_new_tokens: int | None = None, max_length: int | None = None, generation_config: Any = None,
             do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             seed: int | None = None, streamer: Any = None, stop_check_every: int | None = None) -> torch.Tensor:
    """Prompt ``input_ids`` ``(batch, prompt)`` followed by up to ``max_new_tokens`` generated tokens per row.

    Same arguments and result as HuggingFace ``model.generate``: a setting the call leaves out (or None)
    comes from ``generation_config`` (an HF ``GenerationConfig``; default: the model's), else HF's
    defaults (greedy, ``top_k=50``, ``top_p=1.0``, ``temperature=1.0``, 20 new tokens);
    ``max_new_tokens`` wins over ``max_length`` (prompt + new tokens). ``attention_mask`` (1 = token,
    0 = padding) allows a left-padded batch. Generation stops early when every row has produced an
    ``eos_token_id``; rows that finished earlier continue with ``pad_token_id`` (pad falls back to the
    first eos id); pass ``eos_token_id=[]`` to generate ``max_new_tokens`` whatever the model's eos.
    ``seed`` seeds the sampling generator (needed with ``do_sample`` on more than one rank).
    A ``streamer`` gets the prompt, then each step's tokens, then ``end()``.

    ``stop_check_every=k``: whether every row has ended is computed on the device per token and read on the
    host only every ``k`` tokens (one sync each), the tokens past the end dropped, so the result is HF's for any
    ``k``; default 1 in eager mode, :data:`EOS_CHECK_TOKENS` in the compiled modes (a streamer reads every
    token, so it makes it 1).

    A model compiled without ``max_cache_len`` (a plain compile of a causal LM) builds its generation
    graphs on the first call, with a KV cache sized for the request, and again when a later request
    needs more (see :mod:`autotp.runtime.generation.generation_on_demand`).
    """
    check_stop_check_every(stop_check_every)
    if stop_check_every is None:
        stop_check_every = 1 if tp.runtime_mode == "eager" else EOS_CHECK_TOKENS
    request = resolve_request(input_ids, {"max_new_tokens": max_new_tokens, "max_length": max_length,
                                          "do_sample": do_sample, "temperature": temperature, "top_k": top_k,
                                          "top_p": top_p, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id},
                              generation_config, tp.generation_config)
    if tp.generation is None and tp.generation_on_demand is not None:
        tp = tp.generation_on_demand(tp, input_ids, request.max_new_tokens)
    new_tokens = request.max_new_tokens
    _check(tp, input_ids, attention_mask, new_tokens, request.do_sample, seed)
    assert tp.generation is not None
    layout = tp.generation.layout

    def loop(streamer: Any, new_tokens: int = new_tokens) -> torch.Tensor:
        return generation_loop(layout, tp.phase_runner, input_ids, attention_mask,
                               max_new_tokens=new_tokens, eos_token_id=request.eos_token_id,
                               pad_token_id=request.pad_token_id, seed=seed, streamer=streamer,
                               stop_check_every=stop_check_every,
                               pick=lambda logits, generator: next_tokens(
                                   logits, do_sample=request.do_sample, temperature=request.temperature,
                                   top_k=request.top_k, top_p=request.top_p, generator=generator))

    alone = _alone_phases(tp)
    if not alone.decode:
        return loop(streamer)
    return _on_first_rank(tp, loop, input_ids, streamer, prompt_together=not alone.prefill)


def _alone_phases(tp: RankLocalModel) -> AlonePhases:
    """Which phases the group's first rank runs alone (see the module docstring), by the rule the planner
    priced them with (:func:`~autotp.planning.phases.first_rank_alone`): ranks of a gloo group share a host."""
    import torch.distributed as dist

    generation = tp.generation
    assert generation is not None, "generate checks that the model was compiled for generation"
    prompt_plans = [graph.plan for graph in (generation.prefill, generation.continuation) if graph is not None]
    return first_rank_alone(world_size=tp.world_size,
                            ranks_share_host=dist.is_initialized() and dist.get_backend(tp.group) == "gloo",
                            decode_collectives=bool((generation.decode_plan or tp.plan).collectives),
                            prefill_collectives=any(plan.collectives for plan in prompt_plans))


def _on_first_rank(tp: RankLocalModel, loop: Callable[..., torch.Tensor], input_ids: torch.Tensor,
                   streamer: Any, *, prompt_together: bool) -> torch.Tensor:
    """Run ``loop`` on the group's first rank and give its tokens (or its error) to every rank; with
    ``prompt_together`` the other ranks first run the prompt with it (its prefill graph has collectives)
    and stop before the first decode step."""
    import torch.distributed as dist

    from autotp.base.errors import AutoTPError
    from autotp.runtime.agreement.exchanges import share_from_first

    first = dist.get_rank(tp.group) == 0
    tokens: torch.Tensor | None = None
    failure: Exception | None = None
    try:
        if first:
            tokens = loop(streamer)
        elif prompt_together:
            loop(None, 1)  # the prompt through the prefill graph with rank 0; the first token needs no decode call
    except Exception as exc:  # noqa: BLE001 - the other ranks must not wait for tokens that never come
        failure = exc
    sent = share_from_first(tokens if failure is None else f"{type(failure).__name__}: {failure}", group=tp.group,
                            timeout_s=_ONE_RANK_TIMEOUT_S, what="the tokens generated on rank 0")
    if failure is not None:
        raise failure
    if isinstance(sent, str):
        raise AutoTPError(f"generation failed on rank 0 of the group: {sent}")
    if not first and streamer is not None:  # the same calls a streamer gets on rank 0, after the fact
        prompt = int(input_ids.shape[1])
        streamer.put(sent[:, :prompt])
        for step in range(prompt, int(sent.shape[1])):
            streamer.put(sent[:, step])
        streamer.end()
    return sent


def generation_loop(layout: CacheLayout, phase_runner: Callable[[str], Callable[[tuple[torch.Tensor, ...]], Any]],
                    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, max_new_tokens: int,
                    eos_token_id: int | list[int] | None, pad_token_id: int | None, seed: int | None, streamer: Any,
                    pick: Callable[[Any, torch.Generator | None], torch.Tensor], stop_check_every: int = 1,
                    ) -> torch.Tensor:
    """The loop of :func:`generate` over a checked request: the prompt through the prefill (or decode) graph,
    then one decode call per new token.

    ``phase_runner("decode" | "prefill")`` gives a function of the graph's flat inputs ``(tokens,
    positions, cache_position, mask)`` returning logits ``(batch, S, vocab)`` (or ``None`` where this
    rank computes no logits: a pipeline stage other than the last); ``pick(logits, generator)``
    returns every row's next token (the same on every rank). A pipeline
    (:mod:`autotp.runtime.mesh.mesh_generate`) runs this same loop on every stage. ``stop_check_every``: tokens
    between two host reads of whether every row has ended (1: per token; more: no host sync in between,
    the extra tokens dropped at the end, so the result is the same).
    """
    if eos_token_id is None:  # as HF's generate: the model's generation_config decides
        eos_token_id = list(layout.eos_token_ids)
    if pad_token_id is None:
        pad_token_id = layout.pad_token_id
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    rows, prompt = (int(s) for s in input_ids.shape)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if rows < layout.batch_size:  # fill the cache's other rows with copies of the first (dropped at the end)
        extra = layout.batch_size - rows
        input_ids = torch.cat([input_ids, input_ids[:1].expand(extra, -1)])
        attention_mask = torch.cat([attention_mask, attention_mask[:1].expand(extra, -1)])
    batch = layout.batch_size
    device = input_ids.device  # the loop's tensors stay where the ids are (on a GPU: no copy per step)
    ids = input_ids.to(torch.long)
    mask = torch.zeros(batch, layout.max_cache_len, dtype=torch.long, device=device)  # (batch, max_cache_len): 1 = token
    mask[:, :prompt] = attention_mask
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # (batch, max_cache_len) position of each slot's token
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    chunk = layout.prefill_len
    prefill_in_chunks = chunk > 1 and prompt >= chunk and not layout.recurrent
    runners = {"decode": phase_runner("decode")}
    if prefill_in_chunks:
        runners["prefill"] = phase_runner("prefill")  # the first chunk: attends to its own keys only
        if prompt > chunk:
            runners["continuation"] = phase_runner("continuation")

    def run(start: int, tokens: torch.Tensor) -> torch.Tensor | None:
        """Run ``tokens`` (batch, S) at cache slots start..start+S-1; logits of the last one (batch, vocab)."""
        length = int(tokens.shape[1])
        cache_position = torch.arange(start, start + length, device=device)
        runner = runners["decode" if length == 1 else "prefill" if start == 0 else "continuation"]
        logits = runner((tokens, positions[:, start:start + length], cache_position, mask))
        return None if logits is None else logits[:, -1]

    if layout.recurrent:  # the state starts empty at the first chunk; later tokens are applied once each
        runners["prefill"] = phase_runner("prefill")
        logits = runners["prefill"]((ids[:, :chunk], positions[:, :chunk], torch.arange(chunk, device=device), mask))
        logits = None if logits is None else logits[:, -1]
        for start in range(chunk, prompt):
            logits = run(start, ids[:, start:start + 1])
    elif prefill_in_chunks:
        starts = list(range(0, prompt - chunk + 1, chunk))
        if prompt % chunk:
            starts.append(prompt - chunk)
        for start in starts:
            logits = run(start, ids[:, start:start + chunk])
    else:
        for start in range(prompt):
            logits = run(start, ids[:, start:start + 1])

    if streamer is not None:
        streamer.put(input_ids[:rows].cpu())
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    eos_ids = torch.tensor(eos, dtype=torch.long, device=device)
    if streamer is not None:
        stop_check_every = 1  # the streamer reads every token on the host anyway, and must get no token past the end
    new: list[torch.Tensor] = []
    ended: list[torch.Tensor] = []  # per step, whether every row had ended after it (a tensor: no host read)
    for step in range(max_new_tokens):
        token = pick(logits, generator)
        if eos:
            token = torch.where(unfinished, token, torch.full_like(token, pad))
            unfinished &= ~torch.isin(token, eos_ids)
            ended.append(~unfinished[:rows].any())
        new.append(token)
        if streamer is not None:
            streamer.put(token[:rows].cpu())
        if step == max_new_tokens - 1 or (eos and (step + 1) % stop_check_every == 0 and bool(ended[-1])):
            break
        slot = prompt + step
        mask[:, slot] = 1
        positions[:, slot] = positions[:, slot - 1] + 1  # the previous slot holds a token (padding is on the left)
        logits = run(slot, token.unsqueeze(1))
    if eos and stop_check_every > 1:  # keep the tokens up to the first step after which every row had ended
        stops = torch.stack(ended).nonzero()
        if stops.numel():
            new = new[:int(stops[0, 0]) + 1]
    if streamer is not None:
        streamer.end()
    return torch.cat([input_ids[:rows], torch.stack(new, dim=1)[:rows]], dim=1)
