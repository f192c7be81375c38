"""Random models for property-based tests: a spec (plain data) and the model it describes.

A :class:`Spec` is a tuple of steps, each a tuple ``(kind, *params)``, plus the input sizes. It
is plain data so that it pickles to the gloo workers (each rank builds the same model from it
with the same seed) and prints readably when hypothesis reports a failing example. Every step
maps a ``(batch, seq, hidden)`` tensor to a ``(batch, seq, hidden')`` one:

=================  ==========================================================================
``linear``         ``nn.Linear(hidden, out, bias)``
``act``            relu / gelu / silu / tanh / sigmoid
``scale``          times a learned vector, plus a learned bias, times or plus a constant
``mlp``            residual ``h + down(act(up(h)))``
``glu``            ``a, b = linear(h).chunk(2)``; ``a * sigmoid(b)`` (a fused projection split in two)
``attention``      residual multi-head self-attention from matmuls and softmax (optionally
                   causal, via a mask built from ``arange`` and comparison)
``norm``           LayerNorm or RMSNorm
``reduce``         subtract the mean, divide by the max, add the token mean, ... (keepdim
                   reductions over hidden or tokens, broadcast back)
``softmax``        over hidden or over tokens
``reshape``        flatten tokens ``(batch * seq, hidden)`` and back; split into heads and
                   permute ``(batch, heads, seq, head_dim)`` and back
``cat_split``      uneven ``split`` of hidden, pieces transformed and concatenated in another
                   order; or ``cat([h, act(h)])`` doubling hidden
``matmul``         ``h @ W`` with a parameter ``W (hidden, out)``
``token_mix``      a linear map over the token dim (``W (seq, seq)`` applied along seq)
=================  ==========================================================================

Sizes are drawn small and deliberately awkward (hidden 6, 10, 12 over 3 ranks; seq 1) so
uneven and degenerate splits are exercised. A spec may also *pin* a few weight matrices to
``Replicate`` or to a split of one of their dims (``constraints=``, with no memory budget), so
the solver is pushed onto strategies the cost model would rarely pick on its own (row- instead
of column-parallel, a split attention projection feeding a replicated one, ...). :func:`draw_spec` takes a ``draw`` object with
``integer(lo, hi)`` and ``choice(options)``, so hypothesis (``specs()``) and a plain
``random.Random`` (``benchmarks/fuzz.py``) generate the same family of models.
"""

from __future__ import annotations

import dataclasses
import math
import random
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["RandomDraw", "Spec", "build", "check_spec", "constraints_for", "draw_spec", "specs"]

STEP_KINDS = ("linear", "act", "scale", "mlp", "glu", "attention", "norm", "reduce", "softmax", "reshape",
              "cat_split", "matmul", "token_mix")
HIDDEN_SIZES = (4, 6, 8, 10, 12, 16, 24)
TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class Spec:
    """A random model: input sizes, steps, weight seed, and whether to return a second output."""

    batch: int
    seq: int
    hidden: int
    steps: tuple[tuple[Any, ...], ...]
    seed: int = 0
    two_outputs: bool = False
    pins: tuple[tuple[int, int], ...] = ()  # (weight matrix index, dim to split or -1 for whole)


class Draw(Protocol):
    def integer(self, lo: int, hi: int) -> int: ...
    def choice(self, options: Sequence[Any]) -> Any: ...


class RandomDraw:
    """``Draw`` over a ``random.Random`` (for the benchmark's many examples)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[Any]) -> Any:
        return options[self.rng.randrange(len(options))]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def draw_spec(draw: Draw, max_steps: int = 6) -> Spec:
    """A random :class:`Spec`; the hidden size after each step is tracked so every step is valid."""
    batch = draw.integer(1, 3)
    seq = draw.choice((1, 2, 3, 4, 5, 8))
    hidden = draw.choice(HIDDEN_SIZES)
    width = hidden
    steps: list[tuple[Any, ...]] = []
    for _ in range(draw.integer(1, max_steps)):
        kind = draw.choice(STEP_KINDS)
        if kind == "linear":
            out = draw.choice(HIDDEN_SIZES)
            steps.append((kind, out, bool(draw.integer(0, 1))))
            width = out
        elif kind == "act":
            steps.append((kind, draw.choice(("relu", "gelu", "silu", "tanh", "sigmoid"))))
        elif kind == "scale":
            steps.append((kind, draw.choice(("weight", "bias", "times_const", "plus_const"))))
        elif kind == "mlp":
            steps.append((kind, draw.choice(HIDDEN_SIZES), draw.choice(("relu", "gelu", "silu"))))
        elif kind == "glu":
            out = draw.choice(HIDDEN_SIZES)
            steps.append((kind, out))
            width = out
        elif kind == "attention":
            steps.append((kind, draw.choice(_divisors(width)), bool(draw.integer(0, 1))))
        elif kind == "norm":
            steps.append((kind, draw.choice(("layer", "rms"))))
        elif kind == "reduce":
            steps.append((kind, draw.choice(("center", "max_scale", "token_mean", "token_sum_gate", "var_scale"))))
        elif kind == "softmax":
            steps.append((kind, draw.choice((-1, 1))))
        elif kind == "reshape":
            steps.append((kind, draw.choice(("flatten_tokens", "heads")), draw.choice(_divisors(width))))
        elif kind == "cat_split":
            mode = draw.choice(("reorder", "double")) if width > 1 else "double"
            cut = draw.integer(1, width - 1) if mode == "reorder" else 0
            steps.append((kind, mode, cut))
            width = width * 2 if mode == "double" else width
        elif kind == "matmul":
            out = draw.choice(HIDDEN_SIZES)
            steps.append((kind, out))
            width = out
        elif kind == "token_mix":
            steps.append((kind,))
    two_outputs = bool(draw.integer(0, 1))
    pins = tuple((draw.integer(0, 31), draw.choice((-1, 0, 1))) for _ in range(draw.choice((0, 0, 1, 2))))
    return Spec(batch, seq, hidden, tuple(steps), seed=draw.integer(0, 2**16), two_outputs=two_outputs, pins=pins)


def specs(max_steps: int = 6) -> Any:
    """Hypothesis strategy of :class:`Spec` (imports hypothesis lazily)."""
    from hypothesis import strategies as st

    class _HypothesisDraw:
        def __init__(self, draw: Any) -> None:
            self._draw = draw

        def integer(self, lo: int, hi: int) -> int:
            return self._draw(st.integers(lo, hi))

        def choice(self, options: Sequence[Any]) -> Any:
            return self._draw(st.sampled_from(list(options)))

    @st.composite
    def _spec(draw: Any) -> Spec:
        return draw_spec(_HypothesisDraw(draw), max_steps)

    return _spec()


_ACTS = {"relu": torch.relu, "gelu": nn.functional.gelu, "silu": nn.functional.silu, "tanh": torch.tanh,
         "sigmoid": torch.sigmoid}


class _Step(nn.Module):
    """One step of a :class:`Spec` with its parameters."""

    def __init__(self, step: tuple[Any, ...], width: int, seq: int) -> None:
        super().__init__()
        self.step = step
        kind = step[0]
        self.out_width = width
        if kind == "linear":
            self.proj = nn.Linear(width, step[1], bias=step[2])
            self.out_width = step[1]
        elif kind == "scale":
            self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(width))
        elif kind == "mlp":
            self.up, self.down = nn.Linear(width, step[1]), nn.Linear(step[1], width)
        elif kind == "glu":
            self.proj = nn.Linear(width, 2 * step[1])
            self.out_width = step[1]
        elif kind == "attention":
            self.qkv = nn.Linear(width, 3 * width)
            self.out = nn.Linear(width, width, bias=False)
        elif kind == "norm":
            self.norm = nn.LayerNorm(width) if step[1] == "layer" else nn.RMSNorm(width)
            with torch.no_grad():
                self.norm.weight.add_(0.1 * torch.randn(width))
        elif kind == "cat_split":
            self.proj = nn.Linear(width - step[2], width - step[2]) if step[1] == "reorder" else None
            self.out_width = width * 2 if step[1] == "double" else width
        elif kind == "matmul":
            self.weight = nn.Parameter(torch.randn(width, step[1]) / math.sqrt(width))
            self.out_width = step[1]
        elif kind == "token_mix":
            self.weight = nn.Parameter(torch.randn(seq, seq) / math.sqrt(seq))

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: (batch, seq, width)
        kind, params = self.step[0], self.step[1:]
        batch, seq, width = h.shape
        if kind == "linear":
            return self.proj(h)
        if kind == "act":
            return _ACTS[params[0]](h)
        if kind == "scale":
            mode = params[0]
            if mode == "weight":
                return h * self.weight
            if mode == "bias":
                return h + self.weight
            return h * 0.5 if mode == "times_const" else h + 1.0
        if kind == "mlp":
            return h + self.down(_ACTS[params[1]](self.up(h)))
        if kind == "glu":
            a, b = self.proj(h).chunk(2, dim=-1)
            return a * torch.sigmoid(b)
        if kind == "attention":
            heads, causal = params
            q, k, v = self.qkv(h).split(width, dim=-1)
            q, k, v = (t.view(batch, seq, heads, width // heads).transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
            scores = q @ k.transpose(-1, -2) / math.sqrt(width // heads)  # (b, heads, s, s)
            if causal:
                positions = torch.arange(seq, device=h.device)
                mask = positions[None, :] > positions[:, None]  # (s, s): True above the diagonal
                scores = scores.masked_fill(mask, float("-inf"))
            attended = torch.softmax(scores, dim=-1) @ v  # (b, heads, s, d)
            return h + self.out(attended.transpose(1, 2).reshape(batch, seq, width))
        if kind == "norm":
            return self.norm(h)
        if kind == "reduce":
            mode = params[0]
            if mode == "center":
                return h - h.mean(dim=-1, keepdim=True)
            if mode == "max_scale":
                return h / (1.0 + h.abs().amax(dim=-1, keepdim=True))
            if mode == "token_mean":
                return h + h.mean(dim=1, keepdim=True)
            if mode == "token_sum_gate":
                return h * torch.sigmoid(h.sum(dim=1, keepdim=True))
            return h / torch.sqrt(1.0 + h.var(dim=-1, keepdim=True))
        if kind == "softmax":
            return torch.softmax(h, dim=params[0])
        if kind == "reshape":
            mode, heads = params
            if mode == "flatten_tokens":
                flat = h.reshape(batch * seq, width)  # (batch * seq, width)
                return torch.tanh(flat).reshape(batch, seq, width)
            split = h.view(batch, seq, heads, width // heads).permute(0, 2, 1, 3)  # (b, heads, s, d)
            split = split * torch.softmax(split.sum(dim=-1, keepdim=True), dim=2)
            return split.permute(0, 2, 1, 3).reshape(batch, seq, width)
        if kind == "cat_split":
            mode, cut = params
            if mode == "double":
                return torch.cat([h, torch.tanh(h)], dim=-1)
            first, rest = h.split([cut, width - cut], dim=-1)
            return torch.cat([self.proj(rest), first * 2.0], dim=-1)
        if kind == "matmul":
            return h @ self.weight
        if kind == "token_mix":
            return (h.transpose(1, 2) @ self.weight).transpose(1, 2)  # mixes tokens, per channel
        raise ValueError(f"unknown step kind {kind!r}")


class FuzzModel(nn.Module):
    """The model a :class:`Spec` describes."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.two_outputs = spec.two_outputs
        steps = []
        width = spec.hidden
        for step in spec.steps:
            module = _Step(step, width, spec.seq)
            steps.append(module)
            width = module.out_width
        self.steps = nn.ModuleList(steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = x
        for step in self.steps:
            h = step(h)
        if self.two_outputs:
            return h, h.sum(dim=-1)
        return h


def build(spec: Spec) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model and its example input, both from ``spec.seed`` (the caller's RNG is untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = FuzzModel(spec).eval()
        x = torch.randn(spec.batch, spec.seq, spec.hidden)  # (batch, seq, hidden)
    return model, (x,)


def constraints_for(spec: Spec, model: nn.Module) -> dict[str, Any]:
    """The spec's pins as ``autotp`` constraints: weight matrices (in name order) kept whole or split on a dim."""
    from autotp.base.placements import Replicate, Shard

    matrices = sorted((name, p) for name, p in model.named_parameters() if p.dim() == 2)
    constraints: dict[str, Any] = {}
    for index, dim in spec.pins:
        if not matrices:
            break
        name, param = matrices[index % len(matrices)]
        if dim == -1:
            constraints[name] = Replicate()
        elif param.shape[dim] > 1:
            constraints[name] = Shard(dim)
    return constraints


def check_spec(rank: int, world_size: int, spec: Spec) -> dict[str, Any]:
    """On one gloo rank: compile the spec's model and compare with the original.

    Returns ``max_error`` (max abs difference, scaled down by the output's magnitude where it
    exceeds 1), ``fallback_ops``, ``collectives`` and ``error`` (the exception text of a crash,
    else ``None``).
    """
    import autotp

    model, args = build(spec)
    with torch.no_grad():
        expected = model(*args)
    constraints = constraints_for(spec, model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp_model = autotp.compile(model, example_inputs=args,
                                      options=autotp.PlanOptions(constraints=constraints or None, memory_budget=None if constraints else "auto"))
        got = tp_model(*args)
    except Exception as exc:  # noqa: BLE001 - reported, counted by the benchmark, failed by the test
        return {"max_error": math.inf, "fallback_ops": (), "collectives": {}, "split": False,
                "error": f"{type(exc).__name__}: {exc}"}
    expected_t = expected if isinstance(expected, tuple) else (expected,)
    got_t = got if isinstance(got, tuple) else (got,)
    errors = [((e - g).abs().max() / max(1.0, e.abs().max().item())).item() for e, g in zip(expected_t, got_t)]
    split = any(p not in ("R", "P") for p in tp_model.plan.parameters.values())
    return {"max_error": max(errors), "fallback_ops": tp_model.plan.fallback_ops,
            "collectives": tp_model.collective_counts(), "split": split, "error": None}
