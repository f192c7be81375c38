"""dp x pp x tp planning: topology in the cost model, the mesh search, its optimality and its errors.

Fast tier: meta-device capture of tiny Llama configs, no process group.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np
import pytest
import torch

import autotp
from autotp.base.errors import PlanError
from autotp.cli import main as cli
from autotp.cost_model import (
    KNOWN_HARDWARE,
    Hardware,
    bubble_fraction,
    collective_time_s,
    get_hardware,
    group_spans_nodes,
    link_collective_time_s,
    p2p_time_s,
    pipeline_time_s,
)
from autotp.cost_model.calibrate import with_nodes
from autotp.planning.mesh_plan import MeshShape, ParallelPlan
from autotp.planning.mesh_search import (
    _GIB,
    MeshCosts,
    _output_s,
    _stage_sends,
    factorizations,
    forced_dims,
    mesh_costs,
    plan_mesh,
    search_mesh,
)

H100_NODES = get_hardware("h100-multinode")


def _tiny_llama(layers: int, hidden: int = 64) -> tuple[torch.nn.Module, tuple, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    return model, (torch.zeros(1, 16, dtype=torch.long, device="meta"),), {"use_cache": False}


# --------------------------------------------------------------------------- topology

def test_collectives_across_nodes_pay_the_network() -> None:
    """tp=16 on nodes of 8 H100s: an all-reduce crosses InfiniBand; hierarchical beats a flat ring."""
    nbytes = 64 * 2**20
    inside = collective_time_s("all_reduce", nbytes, 8, H100_NODES)
    spanning = collective_time_s("all_reduce", nbytes, 16, H100_NODES, spans_nodes=True)
    flat = collective_time_s("all_reduce", nbytes, 16, dataclasses.replace(H100_NODES, devices_per_node=1),
                             spans_nodes=True)
    assert spanning > 1.5 * inside, f"a big all-reduce over 2 nodes should cost > 1.5x one node: {spanning} vs {inside}"
    small_inside = collective_time_s("all_reduce", 2**16, 8, H100_NODES)
    small_spanning = collective_time_s("all_reduce", 2**16, 16, H100_NODES, spans_nodes=True)
    assert small_spanning > 2 * small_inside, (
        f"a small (latency-bound) all-reduce over 2 nodes should cost > 2x one node: {small_spanning} vs {small_inside}")
    assert spanning < flat, f"hierarchical all-reduce ({spanning}) should beat a flat ring over IB ({flat})"
    # RS inside (8 ranks, n) + AR across 2 nodes (n/8) + AG inside: [J18]
    intra, inter = H100_NODES.intra_node, H100_NODES.inter_node
    expected = (2 * (intra.base_latency_s + 7 * intra.latency_s + 7 / 8 * nbytes / intra.bandwidth_bytes_per_s)
                + inter.base_latency_s + 2 * inter.latency_s + nbytes / 8 / inter.bandwidth_bytes_per_s)
    assert math.isclose(spanning, expected, rel_tol=1e-12), f"hierarchical formula: expected {expected}, got {spanning}"
    assert group_spans_nodes(16, 8) and not group_spans_nodes(8, 8), "a group spans nodes when bigger than a node"
    assert group_spans_nodes(3, 8, world_size=24), "tp=3 on nodes of 8: the group of ranks 6-8 straddles two nodes"
    assert not group_spans_nodes(4, 8, world_size=32), "tp=4 on nodes of 8 never straddles"
    assert p2p_time_s(nbytes, H100_NODES, spans_nodes=True) > 8 * p2p_time_s(nbytes, H100_NODES, spans_nodes=False)


def test_gloo_across_hosts_is_priced_as_its_flat_ring() -> None:
    """A CPU profile (gloo) across hosts: gloo runs one ring over the whole group, never the hierarchical split
    NCCL makes, so a group of two hosts of two ranks pays the flat ring on the network link for every step (the
    hierarchical price, cheaper here, would be a price of something that does not run)."""
    from autotp.cost_model import LinkProfile

    network = LinkProfile("slow-network", bandwidth_gbps=0.025, latency_s=3e-4, base_latency_s=9e-4)
    cpu = dataclasses.replace(get_hardware("cpu-gloo"), devices_per_node=2, inter_node=network, small_all_reduce="ring")
    nbytes = 512 * 2**10
    priced = collective_time_s("all_reduce", nbytes, 4, cpu, spans_nodes=True)
    flat = network.base_latency_s + 6 * network.latency_s + 1.5 * nbytes / network.bandwidth_bytes_per_s
    assert math.isclose(priced, flat, rel_tol=1e-9), f"gloo across hosts: expected the flat ring {flat}, got {priced}"
    nccl = dataclasses.replace(cpu, host_is_device=False)
    assert collective_time_s("all_reduce", nbytes, 4, nccl, spans_nodes=True) < 0.6 * flat, (
        "a device profile (NCCL) keeps the hierarchical form where it is cheaper")


def test_tensor_parallel_across_nodes_is_priced_expensive() -> None:
    """tp=16 on 2 nodes of 8: the MILP's plan pays more for its collectives than on one imaginary 16-GPU
    NVSwitch, and more in all than tp=8 inside one node, from the prices alone (no rule forbids it)."""
    from autotp.capture.tracing import capture
    from autotp.passes.costing import cost_strategy_graph
    from autotp.passes.pricing import price_choice
    from autotp.passes.solver import solve
    from autotp.passes.strategies import build_strategy_graph
    from autotp.planning.planner import auto_memory_budget

    model, args, kwargs = _tiny_llama(1)
    captured = capture(model, args, kwargs)
    one_switch = dataclasses.replace(H100_NODES, name="h100-one-switch", devices_per_node=16)
    price = {}
    for world_size, hardware in ((16, H100_NODES), (16, one_switch), (8, H100_NODES)):
        costed = cost_strategy_graph(build_strategy_graph(captured.graph_module, world_size,
                                                          captured.parameter_fqns()), hardware)
        price[world_size, hardware.name] = price_choice(costed, solve(costed, memory_budget_bytes=auto_memory_budget(
            costed)).choice)
    across, inside, node = price[16, H100_NODES.name], price[16, one_switch.name], price[8, H100_NODES.name]
    assert across.comm_s > 1.2 * inside.comm_s, (
        f"tp=16 across 2 nodes should pay > 1.2x one switch's collectives: {across.comm_s} vs {inside.comm_s}")
    assert across.total_s > node.total_s, (
        f"tp=16 across 2 nodes should be slower than tp=8 in one node: {across.total_s} vs {node.total_s}")


def test_pipeline_formulas_and_profiles() -> None:
    """GPipe/1F1B forward time and bubble; multi-node profiles; calibrate's two-level description."""
    assert pipeline_time_s([2.0, 2.0, 2.0, 2.0], 8) == pytest.approx((8 + 4 - 1) * 2.0)
    assert pipeline_time_s([1.0, 3.0], 4) == pytest.approx(1.0 + 3.0 + 3 * 3.0)
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    a100 = KNOWN_HARDWARE["a100-multinode"]
    assert a100.inter_node.bandwidth_gbps == 25.0 and a100.devices_per_node == 8, "DGX A100: 8 x 200 Gb/s HDR"
    assert H100_NODES.inter_node.bandwidth_gbps == 50.0, "DGX H100: 8 x 400 Gb/s NDR = 50 GB/s per GPU"
    two_level = with_nodes(KNOWN_HARDWARE["cpu-gloo"], devices_per_node=2, inter_node_bandwidth_gbps=0.5,
                           inter_node_latency_s=1e-4)
    again = Hardware.from_json(two_level.to_json())
    assert (again.devices_per_node, again.inter_node.bandwidth_gbps, again.inter_node.latency_s) == (2, 0.5, 1e-4), (
        f"two-level profile round-trip: got {again.devices_per_node}, {again.inter_node}")
    assert "devices_per_node=2" in again.source


# --------------------------------------------------------------------------- search

@pytest.fixture(scope="module")
def six_layer_costs() -> MeshCosts:
    """Costs of a 6-layer tiny Llama on nodes of 4 H100s (so 8 ranks make 2 nodes), tp in 1, 2, 4, 8."""
    model, args, kwargs = _tiny_llama(6)
    hardware = dataclasses.replace(H100_NODES, name="h100-nodes-of-4", devices_per_node=4)
    return mesh_costs(model, args, kwargs, [1, 2, 4, 8], hardware)


def _brute_force(costs: MeshCosts, world_size: int, objective: str, batch: int) -> float:
    """Best objective over every factorization, every cut of the layers and every microbatch count."""
    hardware, capacity, layers = costs.hardware, costs.hardware.memory_gib * _GIB, len(costs.names)
    best = math.inf
    for mesh in factorizations(world_size):
        if mesh.pp > layers or (objective == "throughput" and batch % mesh.dp):
            continue
        per_replica = 1 if objective == "latency" else batch // mesh.dp
        counts = [1] if objective == "latency" else [m for m in range(1, per_replica + 1) if per_replica % m == 0]
        units, pre, post = costs.units[mesh.tp], costs.pre[mesh.tp], costs.post[mesh.tp]
        sends = _stage_sends(mesh, hardware)
        for m in counts:
            b = per_replica // m
            unit_s, pre_s, post_s = costs.times(mesh.tp, b)
            # every tp rank sends the whole boundary; crossing sends from one node share its link
            send = [p2p_time_s(units[0].boundary_bytes(b) * sharing, hardware, spans_nodes=s)
                    for s, sharing in sends]
            for inner in itertools.combinations(range(1, layers), mesh.pp - 1):
                cuts = (0, *inner, layers)
                stage_s, fits = [], True
                for k in range(mesh.pp):
                    span = range(cuts[k], cuts[k + 1])
                    seconds = sum(unit_s[u] for u in span) + (send[k] if k < mesh.pp - 1 else 0.0)
                    memory = sum(units[u].parameter_bytes for u in span) + 2 * max(units[u].activation_bytes(b)
                                                                                     for u in span)
                    if k == 0:
                        seconds += pre_s
                        memory += pre.parameter_bytes + 2 * pre.activation_bytes(b)
                    if k == mesh.pp - 1:
                        seconds += post_s
                        memory += post.parameter_bytes + 2 * post.activation_bytes(b)
                    fits &= memory <= capacity
                    stage_s.append(seconds)
                if fits:
                    value = pipeline_time_s(stage_s, m) + _output_s(costs, mesh, m * b)
                    best = min(best, value if objective == "latency" else -batch / value)
    return best


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_search_is_optimal_against_brute_force(six_layer_costs: MeshCosts, objective: str) -> None:
    """8 ranks (2 nodes of 4), 6 layers: every factorization x every cut x every microbatch count,
    with a memory limit that rules out the biggest stages; the search finds the brute-force optimum."""
    costs = six_layer_costs
    units = costs.units[1]
    whole = (sum(u.parameter_bytes for u in units) + costs.pre[1].parameter_bytes + costs.post[1].parameter_bytes)
    tight = dataclasses.replace(costs.hardware, memory_gib=0.6 * whole / _GIB)  # 1 device cannot hold the model
    costs = dataclasses.replace(costs, hardware=tight, _times={})
    plan = search_mesh(costs, 8, objective=objective, batch=16)
    expected = _brute_force(costs, 8, objective, 16)
    got = plan.predicted["latency_s"] if objective == "latency" else -plan.predicted["throughput_per_s"]
    assert got == pytest.approx(expected, rel=1e-9), f"{objective}: search {got} vs brute force {expected} ({plan.mesh})"
    rows = {str(r["mesh"]): r for r in plan.candidates}
    assert "does not fit" in rows["dp8 x pp1 x tp1"]["note"], f"one device cannot hold it: {rows['dp8 x pp1 x tp1']}"
    slow, fast = rows["dp1 x pp1 x tp8"]["latency_s"], rows["dp2 x pp1 x tp4"]["latency_s"]
    assert slow > fast, f"tp=8 over 2 nodes of 4 should be slower than tp=4 inside one: {slow} vs {fast}"
    assert plan.stages[0].first_block == 0 and plan.stages[-1].stop_block == 6, f"stages cover the layers: {plan.stages}"
    assert plan.split_points == tuple(costs.names[s.first_block] for s in plan.stages[1:])


def test_two_layer_copy_prices_like_the_whole_model(six_layer_costs: MeshCosts) -> None:
    """tp=8 over 2 nodes of 4, batch 8 (priced from captures at batch 2 and 4 of a two-layer copy): the
    search's price of the 6-layer model equals the planner's price of the whole model traced at batch 8."""
    from autotp.capture.tracing import capture
    from autotp.planning.options import PlanOptions
    from autotp.planning.planner import plan_graph

    model, args, kwargs = _tiny_llama(6)
    unit_s, pre_s, post_s = six_layer_costs.times(8, 8)
    searched = float(unit_s.sum()) + pre_s + post_s
    captured = capture(model, (torch.zeros(8, 16, dtype=torch.long, device="meta"),), kwargs)
    whole = plan_graph(captured, PlanOptions(world_size=8, hardware=six_layer_costs.hardware))
    direct = whole.predicted_compute_s + whole.predicted_comm_s
    assert searched == pytest.approx(direct, rel=1e-9), f"search prices {searched} s, the whole model {direct} s"


@pytest.mark.slow  # searches a mesh twice, once through the CLI: about 9 s on 2 cores
def test_plan_front_door_and_cli(capsys) -> None:
    """autotp.plan_mesh(mesh=dp1 x pp2 x tp4) on 8 H100s: a ParallelPlan that prints its mesh, stages and
    predictions; `autotp plan --parallelism tp=2,pp=2` prints the table with the choice marked."""
    model, args, kwargs = _tiny_llama(4)
    plan = autotp.plan_mesh(model, args, kwargs, world_size=8, options=autotp.PlanOptions(hardware="h100-multinode"),
                            mesh=MeshShape(dp=1, pp=2, tp=4), objective="throughput")
    assert isinstance(plan, ParallelPlan) and plan.mesh == MeshShape(dp=1, pp=2, tp=4), f"got {plan}"
    assert len(plan.split_points) == 1 and plan.split_points[0].startswith("model.layers."), plan.split_points
    text = str(plan)
    for needed in (str(plan.mesh), "stage 0", "stage 1", "throughput", "GiB per device", "tensor-parallel plan"):
        assert needed in text, f"{needed!r} missing from:\n{text}"
    code = cli.main(["plan", "tiny-llama", "--world-size", "8", "--hardware", "h100-multinode", "--seq-len", "16",
                     "--parallelism", "tp=2,pp=2"])
    out = capsys.readouterr().out
    assert code == 0, f"exit code {code}"
    rows = re.findall(r"^([* ])\s+(\d+)\s+(\d+)\s+(\d+)\s", out, flags=re.MULTILINE)
    assert rows == [("*", "2", "2", "2")], f"one factorization (dp2 pp2 tp2), chosen; got {rows} in:\n{out}"
    assert "ParallelPlan: dp2 x pp2 x tp2" in out, out


def test_bad_mesh_requests_say_what_to_pass() -> None:
    """Unknown dim, sizes that do not divide the world, a mesh of another size, tp straddling nodes,
    pp beyond the layers, nothing that fits: clear errors before (or instead of) planning."""
    with pytest.raises(ValueError, match="unknown mesh dim 'ep'.*dp, pp, tp"):
        forced_dims({"ep": 2}, None, 16)
    with pytest.raises(ValueError, match="not a multiple of tp=3"):
        forced_dims({"tp": 3}, None, 16)
    with pytest.raises(ValueError, match="has 8 ranks but world_size is 16"):
        forced_dims("auto", MeshShape(dp=2, pp=1, tp=4), 16)
    model, args, kwargs = _tiny_llama(2)
    with pytest.raises(ValueError, match="tp=3 neither divides nor is a multiple of the 8 devices per node"):
        plan_mesh(model, args, kwargs, world_size=24, hardware="h100-multinode", parallelism={"tp": 3})
    with pytest.raises(ValueError, match="pp=4 is more pipeline stages than the model's 2 layers"):
        plan_mesh(model, args, kwargs, world_size=16, hardware="h100-multinode", parallelism={"pp": 4})
    with pytest.raises(ValueError, match="objective must be one of"):
        plan_mesh(model, args, kwargs, world_size=16, hardware="h100-multinode", objective="cost")
    costs = MeshCosts(dataclasses.replace(H100_NODES, memory_gib=1e-9), ("l.0",), {1: ()}, {}, {}, {})
    costs.units[1] = (_unit(),)
    costs.pre[1] = costs.post[1] = _unit()
    with pytest.raises(PlanError, match="no mesh of 1 .* fits the model.*does not fit"):
        search_mesh(costs, 1)


def _unit():
    from autotp.planning.mesh_search import _Affine, _Unit

    zero = _Affine(0.0, 0.0)
    return _Unit((), 1e-3, zero, 2**20, zero, zero)


def test_best_cuts_balance_time_not_layer_count() -> None:
    """pp=2 over 4 layers where layer 0 is as slow as the other three together: cut after layer 0."""
    from autotp.planning.mesh_search import best_cuts

    unit_s = np.array([3.0, 1.0, 1.0, 1.0])
    found = best_cuts(unit_s, np.zeros(4), np.zeros(4), [0.0], capacity=1.0)
    assert found == ((0, 1, 4), 3.0), f"expected cut after layer 0 with slowest stage 3.0, got {found}"


def test_searched_plan_runs_on_the_mesh_runtime(gloo) -> None:
    """4 gloo ranks, mesh dp1 x pp2 x tp2 planned on cpu-gloo (throughput at batch 4): the mesh runtime runs
    the searched ParallelPlan (its cuts and microbatches) and every rank returns the whole batch's logits,
    equal to one process's."""
    from models import tiny_llama
    from test_mesh_runtime import TINY, _run_meshes

    model, args, kwargs = tiny_llama(**TINY, layers=2, batch=4)
    plan = autotp.plan_mesh(model, args, kwargs, world_size=4, options=autotp.PlanOptions(hardware="cpu-gloo"), mesh=MeshShape(dp=1, pp=2, tp=2),
                            objective="throughput", throughput_batch=4)
    dims = (plan.mesh.dp, plan.mesh.pp, plan.mesh.tp)
    results = gloo.run(4, _run_meshes, [(dims, ("dp", "pp", "tp"), 4, plan)])
    for rank, [(_, shape, error)] in enumerate(results):
        assert shape == (4, 8, 1000), f"{plan.mesh} rank {rank}: expected the whole batch's logits, got {shape}"
        assert error < 1e-5, f"{plan.mesh}, {plan.microbatches} microbatch(es), rank {rank}: logits differ by {error}"


def test_parallel_plan_json_round_trip_and_corrupt_files(tmp_path) -> None:
    """A dp1 x pp2 x tp2 plan with a stage tp_plan, predictions and a search row saves and loads equal; a file
    that is not JSON, a tensor-parallel Plan, another version, a missing field: PlanMismatchError naming the
    file and the fix."""
    import json

    from autotp.base.errors import PlanMismatchError
    from autotp.planning.even_stages import even_parallel_plan
    from autotp.planning.mesh_plan import as_parallel_plan

    model, _, _ = _tiny_llama(2)
    even = even_parallel_plan(model, MeshShape(pp=2, tp=2), microbatches=2, schedule="1f1b")
    tp_plan = autotp.plan(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)),
                          (torch.randn(2, 8),), world_size=2)
    row = {"mesh": MeshShape(pp=2, tp=2), "note": "", "latency_s": 1e-3, "latency_cuts": (0, 1, 2),
           "latency_parts": {"compute": 8e-4}, "chosen": True}
    plan = dataclasses.replace(even, stages=(dataclasses.replace(even.stages[0], tp_plan=tp_plan), *even.stages[1:]),
                               predicted={"latency_s": 1e-3}, candidates=(row,), layer_blocks=("model.layers.0",
                                                                                              "model.layers.1"))
    path = tmp_path / "mesh_plan.json"
    plan.save(path)
    loaded = as_parallel_plan(str(path))
    assert loaded == plan, f"round trip changed the plan:\n{plan}\n--- loaded ---\n{loaded}"
    assert loaded.stages[0].tp_plan == tp_plan and loaded.candidates[0]["mesh"] == MeshShape(pp=2, tp=2)
    data = json.loads(path.read_text())
    bad = {"not_json.json": "{oops", "tp_plan.json": tp_plan.to_json(),
           "version.json": json.dumps({**data, "version": 99}),
           "missing.json": json.dumps({k: v for k, v in data.items() if k != "stages"})}
    expected = {"not_json.json": "not JSON", "tp_plan.json": "a tensor-parallel Plan (load it with autotp.Plan.load)",
                "version.json": "format version 99; this autotp reads version 1", "missing.json": "missing field 'stages'"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(PlanMismatchError) as info:
            ParallelPlan.load(tmp_path / name)
        message = str(info.value)
        assert expected[name] in message and name in message and "re-create it" in message, \
            f"{name}: expected {expected[name]!r}, got {message!r}"
    with pytest.raises(FileNotFoundError, match="no such file"):
        as_parallel_plan(str(tmp_path / "absent.json"))


# --------------------------------------------------------------------------- what the mesh runtime does

def test_output_hand_out_is_priced_as_the_runtime_runs_it(six_layer_costs: MeshCosts) -> None:
    """The whole batch's logits reach every rank as the mesh runtime hands them out: with dp the replicas' last
    stages (their first tp rank each) all-gather the shapes, then their slices (a ring over the 2 nodes of 4: one
    group crosses), then each hands the batch to its replica's other ranks; with pp alone the last stage's first tp rank hands it
    to the stages before the last. A hand-out crosses into each node once: pp2 x tp4 with stage k on node k sends
    the logits across once, then inside node 0 (where the 4 pipelines used to broadcast across at once). Each
    hand-out sends a header first (161 int64s). A decode step hands out each row's token over the
    pipeline and gathers nothing."""
    costs = six_layer_costs
    hardware = costs.hardware
    assert costs.output_leaves == 1 and costs.output_bytes(1) > 0, (costs.output_leaves, costs.output_bytes(1))
    inter, intra = hardware.inter_node, hardware.intra_node

    def inside(nbytes: float) -> float:  # the source's sends inside its node, all under way at once
        return intra.base_latency_s + intra.latency_s + nbytes / intra.bandwidth_bytes_per_s

    def across_then_inside(nbytes: float) -> float:  # one send across, then the receiver's sends inside its node
        return (inter.base_latency_s + inter.latency_s + nbytes / inter.bandwidth_bytes_per_s
                + intra.latency_s + nbytes / intra.bandwidth_bytes_per_s)

    whole = costs.output_bytes(3) * 2  # 3 rows per replica, 2 replicas
    dp2 = _output_s(costs, MeshShape(dp=2, pp=1, tp=4), 3)
    expected = (link_collective_time_s("all_gather", 72.0 * 2, 2, inter)  # the shapes: a row of 9 int64s each
                + link_collective_time_s("all_gather", whole, 2, inter) + inside(1288.0) + inside(whole))
    assert dp2 == pytest.approx(expected, rel=1e-12), (dp2, expected)
    pp2 = _output_s(costs, MeshShape(dp=1, pp=2, tp=4), 3)
    expected = across_then_inside(1288.0) + across_then_inside(costs.output_bytes(3))
    assert pp2 == pytest.approx(expected, rel=1e-12), (pp2, expected)
    assert _output_s(costs, MeshShape(dp=1, pp=1, tp=8), 4) == 0.0, "tp alone: its output gather is in its graph"
    step = dataclasses.replace(costs, generation_step=True)
    assert _output_s(step, MeshShape(dp=8, pp=1, tp=1), 8) == 0.0, "decode: the replicas gather once, at the end"
    assert _output_s(step, MeshShape(dp=1, pp=2, tp=4), 1) == pytest.approx(
        link_collective_time_s("broadcast", 8.0 * 4, 2, inter, algorithm="tree")), (
        "decode: the token, over the 4 pipelines at once")


def test_a_hand_out_crosses_into_each_host_once() -> None:
    """The tree the mesh runtime hands the output out along (``host_tree_children``): from rank 3 of 2 hosts of 2,
    one send across (3 -> 0) and the rest inside the hosts (3 -> 2, 0 -> 1); on 4 hosts of 2 a binomial tree over the
    hosts. At 200 Mbit/s it takes one transfer's time where gloo's broadcast over the same ranks takes three."""
    from autotp.cost_model import LinkProfile
    from autotp.cost_model.collectives import binomial_broadcasts_s, host_tree_children, host_tree_deliveries_s

    def pairs(ranks: range) -> dict[int, int]:  # hosts of 2 consecutive ranks
        return {rank: rank // 2 for rank in ranks}

    assert host_tree_children(range(4), 3, pairs(range(4))) == {3: [0, 2], 0: [1], 1: [], 2: []}
    tree = host_tree_children(range(8), 7, pairs(range(8)))
    assert tree == {7: [0, 2, 6], 0: [4, 1], 2: [3], 4: [5], 1: [], 3: [], 5: [], 6: []}, tree
    crossings = [(sender, child) for sender, sent_to in tree.items() for child in sent_to if sender // 2 != child // 2]
    assert sorted(child // 2 for _, child in crossings) == [0, 1, 2], f"each other host entered once: {crossings}"
    assert host_tree_children([0, 1, 2], 1, {0: "a", 1: "a", 2: "a"}) == {1: [0, 2], 0: [], 2: []}, (
        "one host: the source sends to each rank")
    assert host_tree_children([0, 1, 2, 3], 2, {0: "x", 1: "y", 2: "x", 3: "y"}) == {2: [1, 0], 1: [3], 0: [], 3: []}, (
        "hosts as the front door found them, not consecutive ranks: 2 -> 1 across, 2 -> 0 and 1 -> 3 inside")
    network = LinkProfile("slow-network", bandwidth_gbps=0.025, latency_s=3e-4, base_latency_s=9e-4)
    hardware = dataclasses.replace(get_hardware("cpu-gloo"), devices_per_node=2, inter_node=network)
    n = 4 * 2**20
    one = n / network.bandwidth_bytes_per_s
    hand_out = host_tree_deliveries_s([([0, 1, 2, 3], 3)], n, hardware)
    assert one < hand_out < 1.1 * one, hand_out / one
    assert binomial_broadcasts_s([([0, 1, 2, 3], 3)], n, hardware) > 2.9 * one


def test_a_broadcast_is_gloos_binomial_tree_with_shared_links() -> None:
    """gloo's broadcast over 4 ranks on 2 nodes of 2 from rank 3: its tree sends 3 -> 0 and 3 -> 1 at once (both
    leave node 1 and enter node 0: each at half the link) and 0 -> 2 once 0 has the data, so about three
    transfers' time where a tree priced by its depth says two (measured on the cluster of docs/benchmarks/layouts.md:
    521 ms for 4 MiB at 200 Mbit/s, where one transfer took 175 ms)."""
    from autotp.cost_model import LinkProfile
    from autotp.cost_model.collectives import binomial_broadcasts_s

    network = LinkProfile("slow-network", bandwidth_gbps=0.025, latency_s=3e-4, base_latency_s=9e-4)
    hardware = dataclasses.replace(get_hardware("cpu-gloo"), devices_per_node=2, inter_node=network)
    n = 4 * 2**20
    one = n / network.bandwidth_bytes_per_s
    tree = binomial_broadcasts_s([([0, 1, 2, 3], 3)], n, hardware)
    assert tree == pytest.approx(network.base_latency_s + 2 * network.latency_s + 3 * one, rel=1e-9), tree / one
    pair = binomial_broadcasts_s([([0, 2], 2)], n, hardware)
    assert pair == pytest.approx(network.base_latency_s + network.latency_s + one, rel=1e-9)
    both = binomial_broadcasts_s([([0, 2], 2), ([1, 3], 3)], n, hardware)  # two pipelines' sends leave node 1 at once
    assert both == pytest.approx(network.base_latency_s + network.latency_s + 2 * one, rel=1e-9)
    inside = binomial_broadcasts_s([([0, 1], 1)], n, hardware)
    assert inside < 0.1 * pair, "a broadcast inside a node stays off the network"


def test_sends_between_hosts_pay_their_line_past_the_burst() -> None:
    """A measured link of one-way sends between nodes with a burst (a token bucket's: 50 kB, then 25 MB/s). From
    rank 3 of 2 nodes of 2: the hand-out of 512 KiB crosses once and pays its bytes beyond the burst at the rate,
    then the send inside node 0; one of 16 KiB, within the burst, pays a send's fixed cost inside a node for its
    crossing; gloo's broadcast, whose two crossing sends leave node 1 at once, shares the burst between them."""
    from autotp.cost_model import LinkProfile
    from autotp.cost_model.collectives import binomial_broadcasts_s, host_tree_deliveries_s

    network = LinkProfile("slow-network", bandwidth_gbps=0.020, latency_s=3e-4, base_latency_s=9e-4)
    sends = LinkProfile("slow-network-send", bandwidth_gbps=0.025, latency_s=0.0, burst_bytes=50_000)
    hardware = dataclasses.replace(get_hardware("cpu-gloo"), devices_per_node=2, inter_node=network,
                                   inter_node_send=sends)
    rate, intra = sends.bandwidth_bytes_per_s, hardware.intra_node
    floor_s = intra.base_latency_s + intra.latency_s

    def inside(n: int) -> float:
        return intra.latency_s + n / intra.bandwidth_bytes_per_s

    n = 512 * 2**10
    assert host_tree_deliveries_s([([0, 1, 2, 3], 3)], n, hardware) == pytest.approx(
        (n - 50_000) / rate + inside(n), rel=1e-9)
    small = 16 * 2**10
    assert host_tree_deliveries_s([([0, 1, 2, 3], 3)], small, hardware) == pytest.approx(
        floor_s + inside(small), rel=1e-9)
    assert binomial_broadcasts_s([([0, 1, 2, 3], 3)], n, hardware) == pytest.approx(
        (2 * (n - 25_000) + (n - 50_000)) / rate, rel=1e-9), "3 -> 0 and 3 -> 1 at once, then 0 -> 2"


def test_stage_sends_are_whole_and_share_a_node_link(six_layer_costs: MeshCosts) -> None:
    """Every tp rank sends the whole boundary to its peer of the next stage; the sends that leave a node together
    share its link (pp 2 x tp 4 on 2 nodes of 4: four crossing sends from node 0)."""
    from autotp.planning.mesh_search import _send_times

    costs = six_layer_costs
    boundary = costs.units[4][0].boundary_bytes(2)
    got = _send_times(costs, MeshShape(dp=1, pp=2, tp=4), 2)
    assert got == [pytest.approx(p2p_time_s(4 * boundary, costs.hardware, spans_nodes=True))], got
    assert _send_times(costs, MeshShape(dp=2, pp=2, tp=2), 2) == [
        pytest.approx(p2p_time_s(boundary, costs.hardware, spans_nodes=False))]


def test_a_stage_alone_computes_at_the_busy_scale_of_its_machine() -> None:
    """Four ranks on one machine measured 0.5 of the all-busy time with one or two busy, 1.0 with four: one
    request through pp 4 runs each stage alone (0.5 of its compute), tp 4 and dp 4 keep every rank busy (as
    priced), pp 2 x tp 2 has two ranks busy; with microbatches filling the pipeline every stage is busy. A
    profile without the scale prices every pipeline as pipeline_time_s does."""
    from autotp.planning.mesh_search import replica_time_s

    machine = dataclasses.replace(get_hardware("cpu-gloo"), devices_per_node=2, ranks_per_machine=4,
                                  busy_compute_scale=((1, 0.5), (2, 0.5), (4, 1.0)))
    compute, other = [0.01, 0.01, 0.01, 0.01], [0.001] * 4
    assert replica_time_s(compute, other, MeshShape(dp=1, pp=4, tp=1), 1, machine) == pytest.approx(4 * 0.006)
    assert replica_time_s(compute[:1], other[:1], MeshShape(dp=4, pp=1, tp=1), 1, machine) == pytest.approx(0.011)
    assert replica_time_s(compute[:2], other[:2], MeshShape(dp=1, pp=2, tp=2), 1, machine) == pytest.approx(0.012)
    # 4 microbatches through pp 4: the first passes stages with 1, 2, 3, 4 of them busy, then 3 at the full pace
    filled = 0.006 + 0.006 + (0.01 * 0.75 + 0.001) + 0.011
    assert replica_time_s(compute, other, MeshShape(dp=1, pp=4, tp=1), 4, machine) == pytest.approx(filled + 3 * 0.011)
    plain = dataclasses.replace(machine, busy_compute_scale=())
    stages = [c + o for c, o in zip(compute, other)]
    assert replica_time_s(compute, other, MeshShape(dp=1, pp=4, tp=1), 3, plain) == pytest.approx(
        pipeline_time_s(stages, 3))
    assert machine.busy_scale(3) == pytest.approx(0.75) and machine.busy_scale(8) == 1.0


def test_busy_scale_fields_round_trip_and_are_checked() -> None:
    profile = dataclasses.replace(get_hardware("cpu-gloo"), ranks_per_machine=4,
                                  busy_compute_scale=((1, 0.52), (2, 0.55), (3, 0.8), (4, 1.0)))
    again = Hardware.from_json(profile.to_json())
    assert (again.ranks_per_machine, again.busy_compute_scale) == (4, profile.busy_compute_scale)
    assert again.machine_ranks() == 4 and get_hardware("cpu-gloo").machine_ranks() == get_hardware(
        "cpu-gloo").devices_per_node
    with pytest.raises(ValueError, match="busy_compute_scale needs distinct"):
        dataclasses.replace(profile, busy_compute_scale=((2, 0.5), (1, 0.5)))
    with pytest.raises(ValueError, match="ranks_per_machine must be an int"):
        dataclasses.replace(profile, ranks_per_machine=-1)


def test_a_decode_step_is_priced_as_the_planner_prices_its_cached_graph() -> None:
    """``mesh_costs(..., decode_cache_len=N)`` prices the step generation runs (the KV cache's writes, attention over
    every slot, each kernel's first call in the graph) as the planner prices that graph whole: one stage of tp 1
    agrees with the cost pass over the cached graph, and a second stage pays its kernels' first calls again."""
    from autotp.capture.kv_cache import CachedCausalLM
    from autotp.capture.tracing import capture
    from autotp.passes.costing import cost_strategy_graph
    from autotp.passes.strategies import build_strategy_graph

    model, args, _ = _tiny_llama(4)
    cpu = dataclasses.replace(get_hardware("cpu-gloo"), first_call_s=(("kernel", 50e-6),))
    costs = mesh_costs(model, args, None, [1], cpu, decode_cache_len=24)
    assert costs.generation_step
    whole = search_mesh(costs, 1, objective="latency", batch=1)

    step = CachedCausalLM(model, batch_size=1, max_cache_len=24)
    cap = capture(step, step.example_inputs(1), {})
    graph = build_strategy_graph(cap.graph_module, 1, {**cap.parameter_fqns(), **cap.state_fqns()},
                                 frozenset(cap.state))
    costed = cost_strategy_graph(graph, cpu)
    planner = sum(costed.compute_s[name][0] for name in graph.order)
    assert whole.predicted["latency_s"] == pytest.approx(planner, rel=0.02), (whole.predicted, planner)
    assert any(node.target == torch.ops.aten.index_copy.default for node in cap.graph_module.graph.nodes), (
        "the priced step writes the cache")

    stages = search_mesh(costs, 2, objective="latency", batch=1, forced={"dp": 1, "pp": 2, "tp": 1})
    layer_kernels = len(costs.units[1][1].kernels_called)
    assert layer_kernels > 5
    stage_s = sum(stage.predicted_s for stage in stages.stages)
    assert stage_s >= planner + layer_kernels * 50e-6 * 0.99, (stage_s, planner, layer_kernels)
