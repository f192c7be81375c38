"""Plans of tiny models shared by the planning and inspection tests (test_planning, test_reference, test_inspect*).

Planning a tiny Llama takes seconds on a 2-core machine, so each (model, world size, options)
plan is made once per test session and reused; plans are frozen values, so sharing is safe.
"""

from __future__ import annotations

import functools
import warnings

import models

import autotp
from autotp.planning.plan import Plan

__all__ = ["tiny_plan"]


@functools.lru_cache(maxsize=32)
def tiny_plan(name: str = "llama", world_size: int = 4, *, layers: int = 2, memory_budget: object = "auto",
              constraints: tuple[tuple[str, str], ...] = (), device: str = "meta", hardware: str = "h100-sxm") -> Plan:
    """The plan of ``models.BUILDERS[name]`` (``constraints`` as pairs).

    Planned on the meta device unless ``device="cpu"``: a plan to apply to the real model is
    made on it, since tracing on meta can add nodes (e.g. ``contiguous``) the real trace lacks.
    """
    kwargs = {"layers": layers} if name != "mlp" else {}
    model, args, kw = models.BUILDERS[name](device=device, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback-op warning is tested elsewhere
        return autotp.plan(model, args, kw, world_size=world_size, options=autotp.PlanOptions(memory_budget=memory_budget, constraints=dict(constraints) or None, hardware=hardware))


def stacked_plan(plan: Plan, layers: int, *, container: str = "model.layers") -> Plan:
    """A copy of ``plan`` with its last layer repeated until there are ``layers`` layers.

    Makes an 80-layer plan from a 2-layer one in milliseconds, for tests of the reports'
    folding and size (planning a real 80-layer model takes minutes on 2 cores). Layer ``i``'s
    nodes are clones of the last layer's, renamed ``<name>__l<i>``, reading the previous
    clone where the original read the layer before it; nodes after the layers read the last
    clone. Predicted totals are scaled to match.
    """
    import dataclasses
    import re

    from autotp.planning.blocks import node_module

    def layer_of(module: str) -> int | None:
        match = re.match(re.escape(container) + r"\.(\d+)(\.|$)", module)
        return int(match.group(1)) if match else None

    existing = sorted({i for n in plan.nodes if (i := layer_of(node_module(n))) is not None})
    last, before = existing[-1], existing[-2]
    members = {i: [n for n in plan.nodes if layer_of(node_module(n)) == i] for i in (before, last)}
    if len(members[before]) != len(members[last]):
        raise ValueError("the last two layers differ; cannot stack")
    prev_of = {a.name: b.name for a, b in zip(members[before], members[last])}  # layer before -> last layer
    last_names = {n.name for n in members[last]}
    rename = {}  # name in layer `i` -> name; built per clone

    def rewrite(text: str, i: int) -> str:
        return text.replace(f"{container}.{last}", f"{container}.{i}")

    nodes = list(plan.nodes)
    collectives = list(plan.collectives)
    last_of_layer = {n.name: n.name for n in members[last]}  # last-layer node -> its newest clone
    insert_at = max(i for i, n in enumerate(nodes) if n.name in last_names) + 1
    added_compute = added_comm = 0.0
    for i in range(last + 1, layers):
        rename = {name: f"{name}__l{i}" for name in last_names}
        clones = []
        for node in members[last]:
            inputs = tuple(rename[p] if p in rename else last_of_layer.get(prev_of.get(p, ""), p) for p in node.input_nodes)
            clones.append(dataclasses.replace(node, name=rename[node.name], module=rewrite(node.module, i),
                                              target=rewrite(node.target, i), input_nodes=inputs))
            added_compute += node.compute_s
        for c in plan.collectives:
            if c.producer in last_names:
                collectives.append(dataclasses.replace(c, producer=rename[c.producer], module=rewrite(c.module, i),
                                                       consumers=tuple(rename.get(x, x) for x in c.consumers)))
                added_comm += c.time_s
        nodes[insert_at:insert_at] = clones
        insert_at += len(clones)
        last_of_layer = {name: rename[name] for name in last_names}
    after = [dataclasses.replace(n, input_nodes=tuple(last_of_layer.get(p, p) if p in last_names else p
                                                      for p in n.input_nodes))
             for n in nodes[insert_at:]]
    nodes[insert_at:] = after
    parameters = dict(plan.parameters)
    for n in nodes:
        if n.op == "placeholder" and n.target.startswith(container) and n.target not in parameters:
            parameters[n.target] = n.output
    return dataclasses.replace(plan, nodes=tuple(nodes), collectives=tuple(collectives), parameters=parameters,
                               predicted_compute_s=plan.predicted_compute_s + added_compute,
                               predicted_comm_s=plan.predicted_comm_s + added_comm)


MEGATRON_LLAMA: tuple[tuple[str, str], ...] = (
    ("*.q_proj.weight", "S(0)"), ("*.k_proj.weight", "S(0)"), ("*.v_proj.weight", "S(0)"),
    ("*.gate_proj.weight", "S(0)"), ("*.up_proj.weight", "S(0)"),
    ("*.o_proj.weight", "S(1)"), ("*.down_proj.weight", "S(1)"),
    ("*norm.weight", "R"), ("model.embed_tokens.weight", "S(1)"), ("lm_head.weight", "S(0)"),
)
"""Constraints that pin a tiny Llama's weights to the Megatron-LM layout (column-parallel q/k/v and
gate/up, row-parallel o/down, norms whole), so tests of how a plan is *shown* or *exported* do not
depend on what the cost model prefers this week."""


def local_shape(shape: tuple[int, ...], placement: str, world_size: int) -> tuple[int, ...]:
    """The shape of rank 0's block of a tensor under ``placement`` (even splits)."""
    if not placement.startswith("S("):
        return tuple(shape)
    dim = int(placement[2:placement.index(")")])
    return tuple(size // world_size if d == dim else size for d, size in enumerate(shape))
