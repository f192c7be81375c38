"""How a rank-local graph runs: ``eager`` (node by node), ``compiled`` (Inductor) or ``cuda_graph``.

:func:`resolve_runtime_mode` turns ``RuntimeOptions(runtime_mode=...)`` into the mode that runs on a
device (``"auto"``: ``cuda_graph`` on CUDA, ``eager`` on the CPU; a mode that cannot run there raises
when asked for by name, and ``"auto"`` falls back with a one-line message); :func:`priced_in` gives
the planning options whose hardware profile is priced in that mode (``Hardware.runtime_mode``; with
``"auto"``, a profile of another device than the one that runs, such as the default ``h100-sxm`` on CPU
ranks, keeps its own mode).

:func:`graph_runner` wraps one rank-local ``GraphModule`` for its mode. In ``compiled`` mode the graph
goes through ``torch.compile(backend="inductor", fullgraph=True)`` once, at its first call (the inputs
then fix the sizes; a plain forward whose sizes change is compiled once more with symbolic sizes, as
Dynamo's automatic dynamic shapes do, and never per call). The functional collectives
(``torch.ops._c10d_functional``) are traced as they are; the shared-memory stand-ins of a gloo group
become custom ops first (:func:`~autotp.passes.small_collectives.compiler_visible_collectives`); the KV cache
updates (``index_copy_`` into the cache buffers, which are graph inputs) stay in place: Inductor writes
the mutated inputs back into the same tensors. Inductor's FX graph cache (on by default) reuses compiled
code across processes for the same graph and sizes.

On the CPU the compiled decode graph's linear layers of one row (a decode step at batch 1) are written as a
multiply-and-sum, ``(x.unsqueeze(-2) * weight).sum(-1)``, which Inductor fuses into one vectorised pass over
the ``(out, in)`` weight, summed in float32 (:func:`one_row_linear`). At one token a matmul is a
matrix-vector product bound by reading the weight, and the CPU GEMM reads it slowly there: on the project's
AMD EPYC, two processes at once with one thread each, a tp 2 decode step's weights took 0.52x the GEMM's time
summed (``benchmarks/decode_matmul.py``). With more rows the GEMM stays: an output-major sum is as fast alone
(0.52-0.68x from 2 to 8 rows), but in a decode graph Inductor stores its output transposed and the next
layer's sum then reads its weight one element at a time (``benchmarks/runtime_modes.py``, tp 1, batch 8: 1.99x
eager's time per token that way, 0.93x with the GEMM). The weights stay as they are (no copy); a GPU keeps the
GEMM.

Dynamo checks its guards on every call: each of the decode graph's ~80 tensor inputs (weights, cache, token
ids) for shape, stride, dtype and device, which at tp 2 on this project's CPU took about 0.4 ms of a 5.5 ms
decode step. The decode graph's sizes are fixed by its cache and it is called with the same weight and cache
tensors each step, so after its first call it is run with ``skip_guard_eval_unsafe`` (Dynamo runs its one
compiled program without evaluating guards) only where this module's own check holds: every input is the
first call's tensor, or one of the same shape, stride, dtype and device, no torch function mode is active
(a ``torch.device(...)`` block is one), and the global state Dynamo checks on every call (grad mode, autocast,
default dtype, ...; its ``GlobalStateGuard``) is as it was; otherwise the guarded call runs as usual.

``cuda_graph`` mode is ``compiled`` with ``mode="reduce-overhead"`` (CUDA graph trees: captured once,
replayed per call), with the weights and the cache marked static addresses so a replay neither copies
them nor skips capture for the cache's in-place writes. It is built for CUDA devices and has not been
measured on a GPU in this project.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx

from autotp.adapters import torch_internals
from autotp.base.errors import RuntimeModeError
from autotp.base.progress import log_progress
from autotp.passes.small_collectives import COLLECTIVE_STATE_PREFIX, compiler_visible_collectives
from autotp.planning.options import PlanOptions

__all__ = ["graph_runner", "mode_and_pricing", "one_row_linear", "one_row_linears", "priced_in", "resolve_runtime_mode"]


def _cpp_compiler() -> str | None:
    """The C++ compiler Inductor's CPU code would use (``$CXX``, else ``g++``/``c++``/``clang++``), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _why_not(mode: str, device: torch.device, training: bool) -> str | None:
    """Why ``mode`` cannot run on ``device`` (None when it can)."""
    if mode == "eager":
        return None
    if training:
        return "a model compiled with training=True runs eager (autograd through the rank-local graph)"
    if mode == "cuda_graph" and (device.type != "cuda" or not torch.cuda.is_available()):
        return f"cuda_graph needs a CUDA device and the model is on {device.type}"
    if device.type == "cpu" and _cpp_compiler() is None:
        return "Inductor's CPU code needs a C++ compiler (g++ or clang++ on PATH, or $CXX) and none was found"
    return None


def resolve_runtime_mode(requested: str, device: torch.device, *, training: bool = False,
                         talk: bool = False) -> str:
    """The mode that runs on ``device`` for ``RuntimeOptions(runtime_mode=requested)`` (see module docstring).

    RuntimeModeError saying what works when a mode given by name cannot run; ``"auto"`` falls back
    (``cuda_graph`` -> ``compiled`` -> ``eager``) with one progress line when ``talk``."""
    if requested != "auto":
        why = _why_not(requested, device, training)
        if why is not None:
            raise RuntimeModeError(f"runtime_mode={requested!r} cannot run here: {why}; pass "
                                   "autotp.RuntimeOptions(runtime_mode='eager') (runs everywhere), or 'auto'")
        return requested
    wanted = "cuda_graph" if device.type == "cuda" else "eager"
    for mode in ("cuda_graph", "compiled", "eager")[("cuda_graph", "compiled", "eager").index(wanted):]:
        why = _why_not(mode, device, training)
        if why is None:
            return mode
        log_progress(talk, f"runtime_mode='auto': not {mode} ({why})")
    return "eager"


def mode_and_pricing(options: PlanOptions, requested: str, device: torch.device, *, training: bool = False,
                     talk: bool = False) -> tuple[str, PlanOptions]:
    """What every front door does before it plans: the mode that runs (:func:`resolve_runtime_mode`) and
    ``options`` priced in it (:func:`priced_in`)."""
    mode = resolve_runtime_mode(requested, device, training=training, talk=talk)
    return mode, priced_in(options, mode, requested=requested, device=device)


def priced_in(options: PlanOptions, mode: str, *, requested: str, device: torch.device) -> PlanOptions:
    """``options`` whose hardware profile is priced in runtime ``mode`` (``Hardware.runtime_mode``), the mode
    resolved from ``requested`` on ``device``.

    A mode given by name always sets the profile's. With ``"auto"`` a profile of another kind of device than
    the one that runs (the default ``h100-sxm`` planned on CPU ranks: a plan for the machine it describes)
    keeps its own mode; a profile of the device that runs is priced in the mode that runs."""
    profile = options.hardware_profile
    describes_this_device = profile.host_is_device == (device.type == "cpu")
    if profile.runtime_mode == mode or (requested == "auto" and not describes_this_device):
        return options
    return dataclasses.replace(options, hardware=dataclasses.replace(profile, runtime_mode=mode))


def graph_runner(graph_module: fx.GraphModule, mode: str, *, what: str, talk: bool = False,
                 static: tuple[torch.Tensor, ...] = ()) -> Callable[..., Any]:
    """A function of ``graph_module``'s inputs that runs it in ``mode`` (see module docstring).

    ``what`` names the graph in progress lines (``"decode"``); ``static``: the tensors that every call
    passes again (weights, cache), marked static addresses in ``cuda_graph`` mode."""
    if mode == "eager":
        return graph_module
    if mode not in ("compiled", "cuda_graph"):
        raise ValueError(f"runtime mode must be 'eager', 'compiled' or 'cuda_graph', got {mode!r}")
    return _CompiledGraph(graph_module, mode, what=what, talk=talk, static=static)


# Dynamo's own check of the global state its guards read (grad mode, autocast, default dtype, ...); None on a
# torch without it: every call keeps Dynamo's guards
_GlobalState = torch_internals.GlobalStateGuard

_SUMMED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LINEAR = torch.ops.aten.linear.default


def _swaps(node: fx.Node) -> bool:
    """Whether ``node`` swaps the two dims of a 2-D tensor (``t``, ``transpose(0, 1)``, ``permute([1, 0])``)."""
    if node.target is torch.ops.aten.t.default:
        return True
    if node.target is torch.ops.aten.transpose.int:
        first, second = cast(int, node.args[1]), cast(int, node.args[2])
        return first % 2 != second % 2
    if node.target is torch.ops.aten.permute.default:
        return [d % 2 for d in cast("list[int]", node.args[1])] == [1, 0]
    return False


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(x, weight, bias)``; for one row written as the multiply-and-sum that Inductor fuses into one pass
    over the ``(out, in)`` weight (the module docstring), summed in float32 as the GEMM does. The branch is taken
    when Dynamo traces, where the sizes are static."""
    if x.numel() != x.shape[-1]:
        return torch.ops.aten.linear.default(x, weight, bias)
    out = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
    return (out if bias is None else out + bias.float()).to(x.dtype)


def one_row_linears(graph_module: fx.GraphModule, example_inputs: tuple[Any, ...]) -> fx.GraphModule:
    """A copy of ``graph_module`` whose linear layers (``linear(x, w[, b])``, ``mm(x, t(w))``, ``addmm(b, x,
    t(w))``) of a 2-D plain float CPU weight input go through :func:`one_row_linear`; ``graph_module`` itself
    when it has none."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    weights = {node for node, value in zip(placeholders, example_inputs)
               if type(value) in (torch.Tensor, torch.nn.Parameter) and value.dim() == 2
               and value.device.type == "cpu" and value.dtype in _SUMMED_DTYPES}
    graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(graph_module.graph, remap))
    local = {remap[node] for node in weights}
    changed = False
    for node in list(graph.nodes):
        transpose: fx.Node | None = None
        if node.target is _LINEAR and node.args[1] in local and not node.kwargs:
            args: tuple[Any, ...] = tuple(node.args)
        elif (node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and not node.kwargs
              and isinstance(node.args[-1], fx.Node) and _swaps(node.args[-1]) and node.args[-1].args[0] in local):
            x, transpose = node.args[-2], cast(fx.Node, node.args[-1])
            weight = transpose.args[0]
            args = (x, weight) if node.target is torch.ops.aten.mm.default else (x, weight, node.args[0])
        else:
            continue
        with graph.inserting_before(node):
            product = graph.call_function(one_row_linear, args)
        product.meta.update(node.meta)
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        if transpose is not None and not transpose.users:  # the transpose nothing reads now
            graph.erase_node(transpose)
        changed = True
    if not changed:
        return graph_module
    graph.lint()
    return fx.GraphModule(graph_module, graph)


class _CompiledGraph:
    """``graph_module`` compiled by Inductor at its first call and reused after (see :func:`graph_runner`)."""

    def __init__(self, graph_module: fx.GraphModule, mode: str, *, what: str, talk: bool,
                 static: tuple[torch.Tensor, ...]) -> None:
        self.mode, self.what, self.talk = mode, what, talk
        self.graph_module = compiler_visible_collectives(graph_module)
        if mode == "cuda_graph":  # and the memory the collectives share with the other ranks
            shared = (b for name, b in self.graph_module.named_buffers() if name.startswith(COLLECTIVE_STATE_PREFIX))
            for tensor in (*static, *shared):
                torch_internals.mark_static_address(tensor)
        self.compiled: Callable[..., Any] | None = None
        self.calls = 0
        # the decode graph's first arguments and the global state then (the module docstring)
        self.first: tuple[Any, ...] | None = None
        self.unguarded = 0  # calls run without Dynamo's guards

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            return self._run(args)
        log_progress(self.talk, f"compiling the {self.what} graph with Inductor ({self.mode})")
        start = time.perf_counter()
        decode = self.mode == "compiled" and self.what == "decode"  # static sizes (the module docstring)
        graph_module = one_row_linears(self.graph_module, args) if decode else self.graph_module
        self.compiled = torch.compile(graph_module, backend="inductor", fullgraph=True,
                                      mode="reduce-overhead" if self.mode == "cuda_graph" else None)
        out = self._run(args)
        if decode and _GlobalState is not None:
            self.first = (_GlobalState(), args)
        log_progress(self.talk, f"compiled the {self.what} graph in {time.perf_counter() - start:.1f} s")
        return out

    def _as_first_call(self, args: tuple[Any, ...]) -> bool:
        """Whether ``args`` and the global state are what the decode graph was compiled for: each argument the
        first call's object, or a tensor of its shape, stride, dtype and device; no torch function mode active;
        and the state Dynamo checks on every call (grad mode, autocast, default dtype, ...) as it was then. Then
        Dynamo's guards would pass."""
        if (self.first is None or len(args) != len(self.first[1]) or not self.first[0].check()
                or torch_internals.current_function_mode_stack()):
            return False
        for arg, seen in zip(args, self.first[1]):
            if arg is seen:
                continue
            if not (isinstance(arg, torch.Tensor) and isinstance(seen, torch.Tensor)) or (
                    arg.shape, arg.stride(), arg.dtype, arg.device, arg.requires_grad) != (
                    seen.shape, seen.stride(), seen.dtype, seen.device, seen.requires_grad):
                return False
        return True

    def _run(self, args: tuple[Any, ...]) -> Any:
        try:
            return self._run_compiled(args)
        except torch_internals.dynamo_unsupported() as exc:
            # an error raised inside the compiled graph (a peer's failure, a check of this rank's input) reaches
            # GraphModule's error report, whose traceback generator Dynamo refuses under fullgraph=True: its
            # Unsupported hides the graph's own error, which is the one to raise
            raised = exc.__context__
            if raised is None or isinstance(raised, torch_internals.dynamo_unsupported()):
                raise
            raise raised.with_traceback(raised.__traceback__) from None

    def _run_compiled(self, args: tuple[Any, ...]) -> Any:
        assert self.compiled is not None, "compiled at the first call"
        if self.calls > 1 and self._as_first_call(args):
            self.unguarded += 1
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self.compiled(*args)
        if self.mode != "cuda_graph":
            return self.compiled(*args)
        # a replay overwrites the previous replay's outputs: each call is a new step, and what it returns is
        # copied out (logits of one chunk or token), so a caller may keep it
        torch.compiler.cudagraph_mark_step_begin()
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in self.compiled(*args))
