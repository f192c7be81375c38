"""``autotp plan SPEC``: plan a model from the command line, on the meta device.

SPEC names the model, in one of three forms:

- a built-in tiny preset (:data:`PRESETS`): ``tiny-llama``, ``tiny-gpt2``, ``tiny-bert``;
- a path to a transformers ``config.json`` (or a directory holding one): the model is built
  from the config with ``AutoModelForCausalLM`` (``AutoModel`` if that does not apply) on the
  meta device, so a 70B config needs no weights and no GPU; nothing is downloaded;
- ``package.module:factory`` (importable from the current directory too): ``factory()`` is called under ``torch.device("meta")`` and
  returns a module, ``(module, args)`` or ``(module, args, kwargs)``. A factory that takes
  ``batch`` and ``seq_len`` keyword arguments is given them (and can be plotted).

Transformers models are fed ``input_ids`` of shape ``(batch, seq_len)``; the prefill phase is
``seq_len`` tokens per sequence, decode one token (the KV-cache read is not modelled). The
plan is printed (:meth:`Plan.summary`), and written as HTML, JSON or DOT on request;
``--plot`` draws the predicted forward time against world size 1-8 for both phases
(matplotlib, ``pip install 'autotp[viz]'``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from autotp.cli.arguments import constraint, hardware_profile, memory_budget, output_path, positive_float, positive_int

__all__ = ["PRESETS", "ModelSpec", "SpecError", "add_plan_parser", "load_spec", "run_plan"]

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                   "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
                   "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "tiny-gpt2": {"model_type": "gpt2", "vocab_size": 1000, "n_embd": 256, "n_layer": 2, "n_head": 8,
                  "n_positions": 2048, "bos_token_id": 0, "eos_token_id": 0},
    "tiny-bert": {"model_type": "bert", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 2,
                  "num_attention_heads": 8, "intermediate_size": 512, "max_position_embeddings": 2048},
}
"""Built-in SPECs: transformers configs of small random models (2 layers, hidden 256)."""

PLOT_WORLD_SIZES = tuple(range(1, 9))
_DTYPES = ("float32", "bfloat16", "float16")


class SpecError(ValueError):
    """SPEC names no model autotp can build; the message says what forms SPEC takes."""


class ModelSpec:
    """How to build the model and its example inputs for one (batch, seq_len)."""

    def __init__(self, description: str, build: Callable[[int, int], tuple[Any, tuple, dict]],
                 shapes_vary: bool) -> None:
        self.description = description
        self._build = build
        self.shapes_vary = shapes_vary  # False: the inputs are the factory's own, whatever batch/seq_len

    def build(self, batch: int, seq_len: int) -> tuple[Any, tuple, dict]:
        return self._build(batch, seq_len)


def _torch_dtype(name: str | None) -> Any:
    import torch

    return getattr(torch, name) if name else None


def _hf_spec(config: Any, description: str, dtype: str | None) -> ModelSpec:
    import torch

    def build(batch: int, seq_len: int) -> tuple[Any, tuple, dict]:
        import transformers

        config.use_cache = False
        # encoder-decoder models (T5, BART) are built with their LM head and fed decoder tokens too
        head = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
        with torch.device("meta"):
            model = _from_config(transformers, head, config)
        if dtype:
            model = model.to(_torch_dtype(dtype))
        ids = torch.zeros(batch, seq_len, dtype=torch.long)  # (batch, seq)
        parameters = inspect.signature(model.forward).parameters
        kwargs: dict[str, Any] = {"use_cache": False} if "use_cache" in parameters else {}
        if config.is_encoder_decoder and "decoder_input_ids" in parameters:
            kwargs["decoder_input_ids"] = ids
        return model.eval(), (ids,), kwargs

    return ModelSpec(description, build, shapes_vary=True)


def _from_config(transformers: Any, head: Any, config: Any) -> Any:
    """The model of ``config`` with ``head`` (else the bare ``AutoModel``), attention through SDPA where it has one.

    SDPA is one fused attention op the planner has a rule for; models without attention
    (Mamba, RWKV) refuse ``"sdpa"`` and are built with ``"eager"``, which they ignore.
    """
    for auto in (head, transformers.AutoModel):
        for attention in ("sdpa", "eager"):
            try:
                return auto.from_config(config, attn_implementation=attention)
            except ValueError as exc:
                error = exc
                if "attention" not in str(exc) and "attn" not in str(exc):
                    break  # not about attention: try the next auto class
    raise SpecError(f"transformers cannot build a {config.model_type} model from this config: "
                    f"{_first_lines(error)}")


def _first_lines(exc: BaseException, lines: int = 2) -> str:
    """The first lines of an error's text (transformers' own messages can run to kilobytes)."""
    text = " ".join(str(exc).strip().splitlines()[:lines])
    return text if len(text) <= 300 else text[:300] + " ..."


def _config_from_dict(values: dict[str, Any], where: str = "the config") -> Any:
    """A transformers config from its dict form; :class:`SpecError` says what is wrong with it."""
    import difflib

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    values = dict(values)
    model_type = values.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise SpecError(
            f"{where}: model_type {model_type!r} is not an architecture transformers {transformers.__version__} "
            f"knows{hint} (a newer transformers may know it; or pass a package.module:factory SPEC that builds the model)"
        )
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds (validation errors, TypeError, ...)
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise SpecError(f"{where} is not a valid {model_type} config: {_first_lines(cause)}") from None


def _factory_spec(spec: str, dtype: str | None) -> ModelSpec:
    import torch

    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: modules next to the user are importable
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"cannot import {module_name!r} for SPEC {spec!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise SpecError(f"{module_name} has no callable {attr!r} (SPEC {spec!r} names package.module:factory)")
    params = inspect.signature(factory).parameters
    takes_shapes = "batch" in params and "seq_len" in params

    def build(batch: int, seq_len: int) -> tuple[Any, tuple, dict]:
        with torch.device("meta"):
            made = factory(batch=batch, seq_len=seq_len) if takes_shapes else factory()
        if isinstance(made, torch.nn.Module):
            config = getattr(made, "config", None)
            if config is None or not hasattr(config, "vocab_size"):
                raise SpecError(f"{spec} returned a module without example inputs; return (model, args) or "
                                "(model, args, kwargs) from the factory")
            ids = torch.zeros(batch, seq_len, dtype=torch.long)
            made = (made, (ids,), {})
        if not (isinstance(made, tuple) and 2 <= len(made) <= 3 and isinstance(made[0], torch.nn.Module)):
            raise SpecError(f"{spec} must return a module, (module, args) or (module, args, kwargs); "
                            f"got {type(made).__name__}")
        model, args = made[0], tuple(made[1])
        kwargs = dict(made[2]) if len(made) == 3 else {}
        if dtype:
            model = model.to(_torch_dtype(dtype))
        return model.eval(), args, kwargs

    return ModelSpec(f"{spec}()", build, shapes_vary=takes_shapes)


def load_spec(spec: str, *, dtype: str | None = None) -> ModelSpec:
    """Resolve SPEC (see module doc) to a :class:`ModelSpec`; raises :class:`SpecError`."""
    if spec in PRESETS:
        return _hf_spec(_config_from_dict(PRESETS[spec]), f"preset {spec}", dtype)
    if os.path.isdir(spec) or spec.endswith(".json") or os.path.isfile(spec):
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        if not os.path.isfile(path):
            raise SpecError(f"no such config file: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError(f"{path} is not a readable JSON config: {exc}") from exc
        if not isinstance(values, dict) or "model_type" not in values:
            raise SpecError(f"{path} has no \"model_type\"; it must be a transformers config.json")
        config = _config_from_dict(values, path)
        chosen = dtype or _config_dtype(values) or "bfloat16"
        return _hf_spec(config, f"{path} ({values['model_type']})", chosen)
    if re.fullmatch(r"[\w.]+:\w+", spec):
        return _factory_spec(spec, dtype)
    raise SpecError(
        f"SPEC {spec!r} is not a preset ({', '.join(PRESETS)}), an existing config.json path or directory, "
        "or package.module:factory"
    )


def _config_dtype(values: dict[str, Any]) -> str | None:
    found = values.get("torch_dtype") or values.get("dtype")
    return found if found in _DTYPES else None


# --------------------------------------------------------------------------- running

def _say(message: str) -> None:
    print(f"[autotp plan] {message}", file=sys.stderr, flush=True)


def add_plan_parser(commands: Any) -> None:
    """Register ``autotp plan`` on the CLI's sub-command parser."""
    plan = commands.add_parser(
        "plan",
        help="plan a model (preset, config.json or package.module:factory) on the meta device and report it",
        description="Build the model on the meta device (no weights, no GPU, no process group), plan it for "
                    "--world-size ranks of --hardware, print the per-layer summary and optionally write the "
                    "plan as interactive HTML, versioned JSON (apply it with autotp.compile(model, plan=...)), "
                    "Graphviz DOT, and a PNG of predicted latency against world size 1-8.",
        epilog="SPEC: a preset (" + ", ".join(PRESETS) + "), a path to a transformers config.json (or its "
               "directory), or package.module:factory. Example: autotp plan llama-70b/config.json "
               "--world-size 8 --hardware h100-sxm --html plan.html --json plan.json --plot latency.png",
    )
    plan.add_argument("spec", metavar="SPEC", help="preset name, config.json path, or package.module:factory")
    plan.add_argument("--world-size", type=positive_int, default=8, help="ranks to split over (default: 8)")
    plan.add_argument("--hardware", type=hardware_profile, default="h100-sxm",
                      help="hardware profile name (h100-sxm, h200, a100-sxm, pcie-gpu, ...; a wrong name lists them "
                           "all) or JSON path from `autotp calibrate`, as autotp.PlanOptions(hardware=...) (default: h100-sxm)")
    plan.add_argument("--batch", type=positive_int, default=1, help="sequences per forward pass (default: 1)")
    plan.add_argument("--seq-len", type=positive_int, default=1024,
                      help="prefill tokens per sequence (default: 1024); decode is 1 token")
    plan.add_argument("--phase", choices=("prefill", "decode"), default="prefill",
                      help="which forward pass to plan and report (default: prefill)")
    plan.add_argument("--dtype", choices=_DTYPES, default=None,
                      help="parameter dtype (default: the config's torch_dtype, else bfloat16; presets float32)")
    plan.add_argument("--memory-budget", type=memory_budget, default="auto", metavar="BYTES",
                      help="weights per rank: 'auto' (every matrix split, default), 'none', or e.g. 20GiB")
    plan.add_argument("--constraint", type=constraint, action="append", default=[], metavar="PATTERN=PLACEMENT",
                      help="pin matching parameters/nodes, e.g. 'model.layers.*.mlp.down_proj.weight=R' (repeatable)")
    plan.add_argument("--html", type=output_path, metavar="PATH", help="write the interactive HTML view here")
    plan.add_argument("--json", type=output_path, metavar="PATH", help="write the plan (versioned JSON) here")
    plan.add_argument("--dot", type=output_path, metavar="PATH", help="write Graphviz DOT here (identical layers folded)")
    plan.add_argument("--plot", type=output_path, metavar="PNG",
                      help="plot predicted latency vs world size 1-8, prefill and decode (needs matplotlib)")
    plan.add_argument("--explain", action="append", default=[], metavar="NAME",
                      help="also explain this node or parameter FQN (repeatable)")
    plan.add_argument("--max-rows", type=positive_int, default=40, help="rows per table in the summary (default: 40)")
    plan.add_argument("--time-limit", type=positive_float, default=120.0, help="solver time limit per plan, seconds (default: 120)")
    plan.add_argument("--parallelism", type=parallelism, default="tp", metavar="tp|auto|DIM=N,...",
                      help="'tp' (default): one tensor-parallel group; 'auto': search dp x pp x tp over the nodes of "
                           "--hardware and print every factorization considered; 'tp=8' or 'tp=8,pp=2': fix dims")
    plan.add_argument("--objective", choices=("latency", "throughput"), default="latency",
                      help="with --parallelism: latency of one request, or requests/s at --throughput-batch")
    plan.add_argument("--throughput-batch", type=positive_int, default=64,
                      help="with --parallelism: requests per batch for the throughput figures (default: 64)")


def parallelism(text: str) -> str | dict[str, int]:
    """``--parallelism``: ``tp``, ``auto``, or ``dim=size`` pairs separated by commas (``tp=8,pp=2``)."""
    if text in ("tp", "auto"):
        return text
    dims: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        if not sep or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: use 'tp', 'auto' or dims like 'tp=8,pp=2'")
        dims[name.strip()] = int(size)
    return dims


def _run_mesh_plan(spec: ModelSpec, args: argparse.Namespace) -> int:
    """``autotp plan --parallelism auto|DIM=N``: search dp x pp x tp and print every factorization."""
    from autotp.base.errors import AutoTPError
    from autotp.planning.mesh_search import plan_mesh

    for flag in ("json", "html", "dot", "plot"):
        if getattr(args, flag):
            print(f"autotp plan: --{flag} writes a tensor-parallel Plan; leave it out with --parallelism", file=sys.stderr)
            return 2
    model, call_args, call_kwargs = spec.build(args.batch, args.seq_len if args.phase == "prefill" else 1)
    try:
        result = plan_mesh(model, call_args, call_kwargs, world_size=args.world_size, hardware=args.hardware,
                           parallelism=args.parallelism, objective=args.objective,
                           throughput_batch=args.throughput_batch, time_limit_s=args.time_limit, progress=True)
    except ValueError as exc:
        print(f"autotp plan: {exc}", file=sys.stderr)
        return 2
    except AutoTPError as exc:
        print(f"autotp plan: {exc}", file=sys.stderr)
        return 1
    print(result.candidates_table())
    print()
    print(result)
    return 0


def _shape_for(args: argparse.Namespace, phase: str) -> tuple[int, int]:
    return args.batch, (args.seq_len if phase == "prefill" else 1)


def _capture(spec: ModelSpec, batch: int, seq_len: int, phase: str) -> Any:
    from autotp.capture.tracing import capture, inputs_on_model_device

    started = time.perf_counter()
    model, call_args, call_kwargs = spec.build(batch, seq_len)
    params = sum(p.numel() for p in model.parameters())
    count = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.2f} M"
    _say(f"{phase}: built {type(model).__name__} ({count} parameters) on meta; tracing "
         f"(batch {batch}, {seq_len} token{'s' if seq_len > 1 else ''})...")
    captured = capture(model, inputs_on_model_device(model, call_args), inputs_on_model_device(model, call_kwargs))
    _say(f"{phase}: traced {len(captured.graph_module.graph.nodes)} nodes in {time.perf_counter() - started:.1f} s")
    return captured


def _options(args: argparse.Namespace, world_size: int) -> Any:
    """The :class:`~autotp.planning.options.PlanOptions` of the command line (validated before any tracing)."""
    from autotp.planning.options import PlanOptions

    return PlanOptions(world_size=world_size, hardware=args.hardware, memory_budget=args.memory_budget,
                       time_limit_s=args.time_limit, constraints=dict(args.constraint) or None)


def _plan(captured: Any, args: argparse.Namespace, world_size: int, label: str) -> Any:
    from autotp.planning.planner import plan_graph

    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallback ops are listed in the summary
        plan = plan_graph(captured, _options(args, world_size))
    _say(f"{label}: tp={world_size} planned in {time.perf_counter() - started:.1f} s, predicted "
         f"{plan.predicted_time_s * 1e3:.3f} ms per forward")
    return plan


def _plot(path: str, spec: ModelSpec, args: argparse.Namespace, main: tuple[str, Any, Any]) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'autotp[viz]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from autotp.base.errors import PlanError

    main_phase, main_captured, main_plan = main
    series: dict[str, list[tuple[int, float, float]]] = {}
    for phase in ("prefill", "decode"):
        if not spec.shapes_vary and phase != main_phase:
            _say(f"{phase}: skipped (the factory takes no batch/seq_len)")
            continue
        captured = main_captured if phase == main_phase else _capture(spec, *_shape_for(args, phase), phase)
        points = []
        for i, world_size in enumerate(PLOT_WORLD_SIZES, 1):
            if phase == main_phase and world_size == main_plan.world_size:
                plan = main_plan
            else:
                try:
                    plan = _plan(captured, args, world_size, f"plot {phase} {i}/{len(PLOT_WORLD_SIZES)}")
                except PlanError as exc:
                    _say(f"plot {phase}: tp={world_size} has no plan ({str(exc).splitlines()[0]})")
                    continue
            points.append((world_size, plan.predicted_compute_s, plan.predicted_comm_s))
        series[phase] = points
    figure, axes = plt.subplots(1, len(series), figsize=(5.2 * len(series), 3.8), squeeze=False)
    for ax, (phase, points) in zip(axes[0], series.items()):
        ws = [p[0] for p in points]
        compute = [p[1] * 1e3 for p in points]
        comm = [p[2] * 1e3 for p in points]
        ax.bar(ws, compute, color="#1971c2", label="compute")
        ax.bar(ws, comm, bottom=compute, color="#c92a2a", label="communication")
        totals = [a + b for a, b in zip(compute, comm)]
        ax.plot(ws, totals, "k.-", linewidth=1)
        ax.set_ylim(0, max(totals, default=1.0) * 1.25)  # room for the legend above the bars
        batch, seq_len = _shape_for(args, phase)
        ax.set_title(f"{phase}: batch {batch} x {seq_len} token{'s' if seq_len > 1 else ''}")
        ax.set_xlabel("world size (tensor-parallel ranks)")
        ax.set_ylabel("predicted forward time (ms)")
        ax.set_xticks(list(PLOT_WORLD_SIZES))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(f"autotp: {spec.description} on {args.hardware}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run_plan(args: argparse.Namespace) -> int:
    """``autotp plan``: build, trace, plan, print, write; returns the exit code."""
    from autotp.base.errors import AutoTPError
    from autotp.inspect import explain, to_dot, to_html

    started = time.perf_counter()
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("autotp plan: --plot needs matplotlib: pip install 'autotp[viz]'", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec, dtype=args.dtype)
    except SpecError as exc:
        print(f"autotp plan: {exc}", file=sys.stderr)
        return 2
    try:
        _options(args, args.world_size)  # a bad --hardware or budget fails here, before tracing
    except (TypeError, ValueError) as exc:
        print(f"autotp plan: {exc}", file=sys.stderr)
        return 2
    _say(f"model: {spec.description}; world size {args.world_size}, hardware {args.hardware}")
    if args.parallelism != "tp":
        return _run_mesh_plan(spec, args)
    try:
        captured = _capture(spec, *_shape_for(args, args.phase), args.phase)
        _say(f"{args.phase}: planning (strategies, costs, MILP)...")
        plan = _plan(captured, args, args.world_size, args.phase)
    except (AutoTPError, SpecError, ValueError) as exc:
        print(f"autotp plan: {exc}", file=sys.stderr)
        return 1
    print(plan.summary(max_rows=args.max_rows))
    for name in args.explain:
        print()
        try:
            print(explain(plan, name))
        except KeyError as exc:
            print(f"explain: {exc.args[0]}")
    title = f"{spec.description}, {args.phase}, tp={args.world_size} on {args.hardware}"
    if args.json:
        plan.save(args.json)
        _say(f"wrote {args.json}")
    if args.html:
        to_html(plan, args.html, title=title)
        _say(f"wrote {args.html}")
    if args.dot:
        with open(args.dot, "w", encoding="utf-8") as f:
            f.write(to_dot(plan))
        _say(f"wrote {args.dot}")
    if args.plot:
        _plot(args.plot, spec, args, (args.phase, captured, plan))
        _say(f"wrote {args.plot}")
    _say(f"done in {time.perf_counter() - started:.1f} s")
    return 0
