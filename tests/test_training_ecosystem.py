"""Training with the rest of PyTorch: DCP resume, activation checkpointing, FSDP2 over tensor parallelism.

Real gloo ranks, a tiny Llama (2 layers, hidden 48) compiled with ``training=True``.
"""

from __future__ import annotations

import warnings

import models
import torch

import autotp
from autotp.runtime.training.training_checkpoint import load_training_state, save_training_state

_LLAMA = {"num_heads": 4, "num_kv_heads": 2, "intermediate": 96, "hidden": 48, "layers": 2, "vocab_size": 96,
          "seq_len": 8}


def _compiled(group: object = None) -> tuple[torch.nn.Module, torch.Tensor, autotp.TensorParallelModule]:
    model, (ids,), _ = models.tiny_llama(**_LLAMA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model.train(), example_inputs=(ids,), example_kwargs={"labels": ids}, options=autotp.PlanOptions(training=True),
                            group=group)
    return model, ids, tp


def _resume_and_checkpoint(rank: int, world_size: int, directory: str) -> dict:
    """Activation checkpointing of the whole call gives the same gradients; 2 AdamW steps, a DCP save,
    2 more steps; then a fresh AdamW and the saved state loaded back: the same 2 losses again."""
    from torch.utils.checkpoint import checkpoint

    _, ids, tp = _compiled()
    tp(ids, labels=ids).loss.backward()
    plain = {name: p.grad.clone() for name, p in tp.named_parameters()}
    tp.zero_grad(set_to_none=True)
    checkpoint(lambda batch: tp(batch, labels=batch).loss, ids, use_reentrant=False).backward()
    recomputed = max((p.grad - plain[name]).abs().max().item() for name, p in tp.named_parameters())
    tp.zero_grad(set_to_none=True)
    blocks = _checkpointed_blocks(tp, ids, plain)

    def step(optimizer: torch.optim.Optimizer) -> float:
        loss = tp(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    optimizer = torch.optim.AdamW(tp.parameters(), lr=1e-2)
    for _ in range(2):
        step(optimizer)
    save_training_state(tp, optimizer, directory)
    after = [step(optimizer) for _ in range(2)]
    fresh = torch.optim.AdamW(tp.parameters(), lr=0.5)  # its lr is replaced by the saved one
    load_training_state(tp, fresh, directory)
    resumed = [step(fresh) for _ in range(2)]
    return {"recomputed": recomputed, "after": after, "resumed": resumed, **blocks}


def _saved_for_backward(tp: torch.nn.Module, ids: torch.Tensor) -> int:
    """Tensors autograd keeps for the backward of one loss (counted by a saved-tensors hook), after its backward."""
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = tp(ids, labels=ids).loss
    loss.backward()
    return saved


def _checkpointed_blocks(tp: autotp.TensorParallelModule, ids: torch.Tensor, plain: dict) -> dict:
    """The same model compiled with activation_checkpointing="blocks" and outputs="local": its gradients'
    largest difference from ``plain``, the blocks it checkpoints, the tensors saved for backward with and
    without, its output placements and how far its logits are from this rank's block of ``tp``'s."""
    model, _, _ = models.tiny_llama(**_LLAMA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blocks = autotp.compile(model.train(), example_inputs=(ids,), example_kwargs={"labels": ids},
                                options=autotp.PlanOptions(training=True, activation_checkpointing="blocks",
                                                           outputs="local"))
    with torch.no_grad():
        whole, local = tp(ids, labels=ids), blocks(ids, labels=ids)
    width = whole.logits.shape[-1] // tp.world_size
    mine = whole.logits[..., tp.rank * width:(tp.rank + 1) * width]
    outputs = {"placements": blocks.output_placements, "local_shape": tuple(local.logits.shape),
               "logits_difference": (local.logits - mine).abs().max().item() if local.logits.shape == mine.shape
               else float("inf"), "loss_difference": abs(local.loss.item() - whole.loss.item())}
    saved = {"saved_plain": _saved_for_backward(tp, ids), "saved_blocks": _saved_for_backward(blocks, ids), **outputs}
    tp.zero_grad(set_to_none=True)
    grads = dict(blocks.named_parameters())
    difference = max((grads[name].grad - plain[name]).abs().max().item() / plain[name].abs().max().item()
                     for name in plain)
    checkpointed = [m.name for m in blocks.graph_module.modules() if type(m).__name__ == "CheckpointedBlock"]
    return {"block_difference": difference, "checkpointed": checkpointed, **saved}


def test_dcp_resume_and_activation_checkpointing(gloo, tmp_path) -> None:
    """tp=2, Llama: torch.utils.checkpoint around the call recomputes (collectives included) to the
    same gradients; so does activation_checkpointing="blocks" (each of the 2 layers checkpointed,
    under half the tensors saved for backward, gradients within 1e-6), compiled with outputs="local"
    (the loss whole, this rank's vocabulary block of the logits, S(2)); a DCP checkpoint of shards + AdamW state resumes to the same next two losses
    (the second depends on the optimizer state)."""
    results = gloo.run(2, _resume_and_checkpoint, str(tmp_path / "step2"))
    for rank, r in enumerate(results):
        assert r["recomputed"] == 0.0, f"rank {rank}: checkpointed gradients differ by {r['recomputed']}"
        assert r["checkpointed"] == ["model.layers.0", "model.layers.1"], (
            f"rank {rank}: checkpointed blocks {r['checkpointed']}, expected model.layers.0 and model.layers.1")
        assert r["block_difference"] <= 1e-6, (
            f"rank {rank}: per-block checkpointed gradients differ by {r['block_difference']:.3g} relative, "
            "expected <= 1e-6")
        assert r["placements"] == ("R", "S(2)"), f"rank {rank}: outputs='local' placements {r['placements']}"
        assert r["local_shape"] == (2, 8, 48), f"rank {rank}: local logits {r['local_shape']}, expected (2, 8, 48)"
        assert r["logits_difference"] <= 1e-5 and r["loss_difference"] <= 1e-6, (
            f"rank {rank}: local logits differ from the rank's block of the whole ones by {r['logits_difference']}, "
            f"loss by {r['loss_difference']}")
        assert r["saved_blocks"] < r["saved_plain"] // 2, (
            f"rank {rank}: {r['saved_blocks']} tensors saved for backward with checkpointed blocks, expected fewer "
            f"than half of the {r['saved_plain']} saved without")
        assert r["resumed"] == r["after"], f"rank {rank}: losses after resuming {r['resumed']}, expected {r['after']}"


def _fsdp_over_tp(rank: int, world_size: int, steps: int) -> dict:
    """dp=2 x tp=2: autotp over the mesh's tp axis, FSDP2's fully_shard over its dp axis; each dp
    rank trains on its row of the batch. Returns the losses (averaged over dp) and the single
    process's on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    row = mesh.get_local_rank("dp")
    config = {**_LLAMA, "layers": 1}
    model, (ids,), _ = models.tiny_llama(batch=2, **config)
    reference = models.tiny_llama(batch=2, **config)[0].train()
    mine = ids[row:row + 1]  # (1, seq): this dp rank's data, the same on both tp ranks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model.train(), example_inputs=(mine,), example_kwargs={"labels": mine}, options=autotp.PlanOptions(training=True),
                            group=mesh["tp"].get_group())
    fully_shard(tp, mesh=mesh["dp"])  # the tp shards, sharded again over dp
    optimizer = torch.optim.AdamW(tp.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, expected = [], []
    for _ in range(steps):
        loss = tp(mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        both = loss.detach().clone()
        torch.distributed.all_reduce(both, group=mesh["dp"].get_group())
        losses.append(both.item() / 2)  # both rows have seq - 1 tokens: the mean of means is the batch mean
        loss = reference(ids, labels=ids).loss
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        expected.append(loss.item())
    return {"losses": losses, "expected": expected, "sharded": type(next(tp.parameters())).__name__}


def test_fsdp2_over_tensor_parallel(gloo) -> None:
    """dp=2 x tp=2 (a (dp, tp) DeviceMesh), Llama: fully_shard over dp composes with autotp over tp;
    3 AdamW steps give the single process's losses on the whole batch (<= 1e-5 relative)."""
    results = gloo.run(4, _fsdp_over_tp, 3)
    for rank, r in enumerate(results):
        assert r["sharded"] == "DTensor", f"rank {rank}: FSDP2 should hold the parameters as DTensors, got {r['sharded']}"
        for step, (got, want) in enumerate(zip(r["losses"], r["expected"])):
            assert abs(got - want) <= 1e-5 * abs(want), f"rank {rank} step {step}: loss {got}, single process {want}"


def _dropout_probes(tp: autotp.TensorParallelModule, ids: torch.Tensor) -> dict[str, list]:
    """One forward of ``tp`` in which every sampling node runs on a probe (dropout of ones; attention with
    uniform scores over values of ones), so its output shows its mask: ``{"split": [...], "replicated": [...]}``,
    and under ``"split attention"`` the names of the split nodes that are attention."""
    from torch.fx import Interpreter

    from autotp.capture.tracing import draws_random_numbers
    from autotp.passes.random_streams import RankStream

    probes: dict[str, list] = {"split": [], "replicated": [], "split attention": []}

    class Probe(Interpreter):
        def run_node(self, node: torch.fx.Node) -> object:
            split = isinstance(node.target, RankStream)
            if node.op != "call_function" or not (split or draws_random_numbers(node)):
                return super().run_node(node)
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            op = node.target.target if split else node.target
            if op is torch.ops.aten.scaled_dot_product_attention.default:
                args = (torch.zeros_like(args[0]), torch.zeros_like(args[1]), torch.ones_like(args[2]), *args[3:])
            else:
                args = (torch.ones_like(args[0]), *args[1:])
            out = node.target(*args, **kwargs)
            probes["split" if split else "replicated"].append(out.detach().clone())
            if split and op is torch.ops.aten.scaled_dot_product_attention.default:
                probes["split attention"].append(node.name)
            return out

    values = [tp._local[s.name] if s.kind == "parameter" else ids if s.kind == "user" else getattr(tp, s.name)
              for s in tp._slots]
    with torch.no_grad():
        Probe(tp.graph_module).run(*values)
    return probes


def _dropout_streams(rank: int, world_size: int) -> dict:
    """GPT-2 (dropout 0.1) compiled with dropout="split": its loss, its sampling nodes' masks after
    tp.manual_seed(7), twice, and how far the gradients of the same step with checkpointed blocks are."""
    model, (ids,), _ = models.tiny_gpt2(num_heads=4, hidden=48, layers=2, vocab_size=96, seq_len=8)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(model.train(), example_inputs=(ids,), example_kwargs={"labels": ids},
                            options=autotp.PlanOptions(training=True, dynamic=False, dropout="split"))
        blocks = autotp.compile(model, example_inputs=(ids,), example_kwargs={"labels": ids},
                                plan=tp.plan, options=autotp.PlanOptions(training=True, dynamic=False, dropout="split",
                                                                         activation_checkpointing="blocks"))
    losses = []
    for module in (tp, blocks):  # the recomputed blocks replay both streams: the same masks, the same gradients
        module.manual_seed(7)
        loss = module(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    plain, checkpointed = dict(tp.named_parameters()), dict(blocks.named_parameters())
    # relative to each tensor's largest gradient (a key bias under softmax has a zero gradient: absolute there)
    recomputed = max((checkpointed[k].grad - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1e-3)
                     for k, p in plain.items())
    tp.manual_seed(7)
    first = _dropout_probes(tp, ids)
    tp.manual_seed(7)
    return {"loss": losses[0], "first": first, "again": _dropout_probes(tp, ids), "recomputed": recomputed,
            "checkpointed_loss": losses[1], "gradients": all(p.grad is not None for p in tp.parameters())}


def test_dropout_streams_per_rank(gloo) -> None:
    """tp=2, GPT-2 with dropout 0.1, dropout="split": attention (split by heads, in both layers) draws its dropout
    from a per-rank stream, as does any dropout the plan splits, so their masks differ between the ranks; the
    replicated (and partial) dropouts draw from the shared stream, so their masks are equal on both ranks; after tp.manual_seed(7) both kinds
    repeat exactly; a training step runs and its loss is the same on both ranks; with
    activation_checkpointing="blocks" (same plan) the recomputed masks are the forward's: equal gradients."""
    results = gloo.run(2, _dropout_streams)
    for rank, r in enumerate(results):
        assert r["gradients"], f"rank {rank}: a parameter got no gradient"
        assert r["checkpointed_loss"] == r["loss"] and r["recomputed"] <= 1e-6, (
            f"rank {rank}: with checkpointed blocks, loss {r['checkpointed_loss']} (expected {r['loss']}) and "
            f"gradients {r['recomputed']:.3g} relative off (expected <= 1e-6): a recomputed mask differs")
        # both attentions run split by heads; the plan may split other dropouts too (the embeddings' when it
        # splits their hidden dim), which then draw from the rank's stream like them
        assert len(r["first"]["split attention"]) == 2, (
            f"rank {rank}: split attentions {r['first']['split attention']}, expected both layers'")
        assert r["first"]["replicated"], f"rank {rank}: no dropout on the shared stream"
        for kind in ("split", "replicated"):
            same = all(torch.equal(a, b) for a, b in zip(r["first"][kind], r["again"][kind], strict=True))
            assert same, f"rank {rank}: {kind} dropout masks differ after the same tp.manual_seed(7)"
    assert results[0]["loss"] == results[1]["loss"], f"losses differ between ranks: {results[0]['loss']} vs {results[1]['loss']}"
    for index, (a, b) in enumerate(zip(results[0]["first"]["replicated"], results[1]["first"]["replicated"], strict=True)):
        assert torch.equal(a, b), f"replicated dropout {index}: the ranks drew different masks"
    for index, (a, b) in enumerate(zip(results[0]["first"]["split"], results[1]["first"]["split"], strict=True)):
        assert a.shape == b.shape and not torch.equal(a, b), (
            f"split dropout {index}: the ranks drew the same mask (shapes {tuple(a.shape)}, {tuple(b.shape)})")


def _train_on_mesh(rank: int, world_size: int, steps: int) -> dict:
    """dp=2 x tp=2 through autotp.compile_mesh(..., training=True): every rank passes the whole batch, each
    replica trains on its row. Returns the replica's losses, the single process's on the whole batch, and
    the largest difference of the trained weights from the single process's."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = {**_LLAMA, "layers": 1}
    model, (ids,), _ = models.tiny_llama(batch=2, **config)
    reference = models.tiny_llama(batch=2, **config)[0].train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile_mesh(model.train(), mesh, example_inputs=(ids,), example_kwargs={"labels": ids},
                                 options=autotp.PlanOptions(training=True))
    optimizer = torch.optim.AdamW(tp.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, expected = [], []
    for _ in range(steps):
        for module, opt, out in ((tp, optimizer, losses), (reference, reference_optimizer, expected)):
            loss = module(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
    full, want = tp.full_state_dict(), reference.state_dict()
    weights = max((full[k] - want[k]).abs().max().item() / want[k].abs().max().item() for k in want)
    return {"losses": losses, "expected": expected, "weights": weights, "replica": tp.replica_index}


def test_training_over_a_dp_tp_mesh(gloo) -> None:
    """dp=2 x tp=2 (autotp.compile_mesh(..., training=True)), Llama: each replica returns its row's loss, and
    gradients averaged over dp make 3 AdamW steps equal the single process's on the whole batch: the mean
    of the two replicas' losses is its loss (<= 1e-5 relative), and the trained weights are its weights."""
    results = gloo.run(4, _train_on_mesh, 3)
    by_replica = {r["replica"]: r for r in results}
    assert sorted(by_replica) == [0, 1], f"replica indices {[r['replica'] for r in results]}"
    for step, want in enumerate(results[0]["expected"]):
        got = (by_replica[0]["losses"][step] + by_replica[1]["losses"][step]) / 2
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: mean of the replicas' losses {got}, single process {want}"
    for rank, r in enumerate(results):
        assert r["weights"] <= 1e-4, f"rank {rank}: trained weights differ from one process's by {r['weights']:.3g} relative"
