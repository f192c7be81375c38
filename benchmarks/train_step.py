"""Training step time and peak memory: autotp against DTensor ``parallelize_module`` (torchtitan's recipe).

    python benchmarks/train_step.py [--world-sizes 2 4] [--steps 10] [--layers 2] [--hidden 256]

For each world size, ``N`` gloo processes (the shared pool of ``tests/distributed.py``) train the
same tiny Llama (``transformers.LlamaForCausalLM`` from a config, random weights, fixed token
ids, AdamW, lr 1e-4) two ways, side by side in the same processes:

- **DTensor**: ``parallelize_module`` with the Megatron plan torchtitan applies to Llama
  (``ColwiseParallel`` on q/k/v/gate/up, ``RowwiseParallel`` on o/down, the embedding
  ``RowwiseParallel`` with a replicated output, ``lm_head`` ``ColwiseParallel`` with a
  ``Shard(-1)`` DTensor output) and ``loss_parallel`` for the cross-entropy; sequence
  parallelism off on both sides, so the two compare like with like;
- **autotp**: ``autotp.compile(model, ..., training=True)``, the loss computed inside the model
  (``labels=``), as a user writes it. The model also returns its logits, which autotp returns
  whole on every rank (the default ``outputs="replicated"``), so they are all-gathered
  (``batch x seq x vocab`` values);
- **autotp-local**: the same with ``outputs="local"``: the loss whole, the logits as each rank
  computes them (its vocabulary block, ``tp.output_placements`` ``S(2)``), like the DTensor
  side's ``Shard(-1)`` logits: this is the like-for-like comparison;
- **autotp-loss**: the same, compiling a wrapper whose forward returns only the loss (what the
  DTensor side computes): nothing needs the logits whole, so the cross-entropy runs
  vocabulary-parallel on the lm_head's split output (``passes/rules/losses.py``).

Both compute the same loss (the next token of each position, mean over ``batch * (seq - 1)``
tokens); the first step's losses are printed as a check. Step time: median of ``--steps``
timed steps (forward, backward, ``optimizer.step()``, ``zero_grad``) after two warm-up steps,
the two sides alternating step by step so that a shared machine's noise hits both alike
(wall-clock: read the ratio). Peak memory: the largest sum of live tensor bytes during one
step, tracked by ``torch.distributed._tools.mem_tracker.MemTracker`` (a torch dispatch-mode
hook that counts every tensor storage as it is allocated and freed: parameters, gradients,
optimizer state, activations, temporaries), on rank 0, in a step run apart from the timed
ones. Not the process's RSS: the allocator's cache and the other side's memory would blur it.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from distributed import run_on_ranks, shutdown_all  # noqa: E402


def _llama(layers: int, hidden: int, vocab: int, seq: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq,
                         attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).train()


def _dtensor_side(model: Any, world_size: int) -> tuple[Any, Any]:
    """torchtitan's Llama TP plan, without sequence parallelism; returns (model, step function)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    model = parallelize_module(model, mesh, plan)

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden)  # DTensor, Shard(-1): each rank holds its slice of the vocabulary
        with loss_parallel():
            return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    def backward(loss: torch.Tensor) -> None:
        with loss_parallel():
            loss.backward()

    return model, (loss_of, backward)


def _loss_only(model: Any) -> Any:
    """``model`` wrapped so that its forward returns only the loss (its logits are no output)."""
    import torch

    class LossOnly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.model(ids, labels=labels).loss

    return LossOnly()


def _autotp_side(model: Any, ids: Any, *, loss_only: bool = False,
                 outputs: str = "replicated") -> tuple[Any, Any] | str:
    """``autotp.compile(training=True, outputs=outputs)`` (of the loss-only wrapper with ``loss_only``), or why
    it is not available."""
    import inspect

    import autotp

    if "training" not in inspect.signature(autotp.compile).parameters:
        return "autotp.compile(training=True) is not on this branch yet"
    if outputs != "replicated" and "outputs" not in inspect.signature(autotp.compile).parameters:
        return "autotp.compile(outputs=) is not on this branch yet"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autotp.compile(_loss_only(model) if loss_only else model, example_inputs=(ids,),
                            example_kwargs={"labels": ids}, options=autotp.PlanOptions(training=True),
                            **({"outputs": outputs} if outputs != "replicated" else {}))

    def loss_of(batch: Any) -> Any:
        out = tp(batch, labels=batch)
        return out if loss_only else out.loss

    def backward(loss: Any) -> None:
        loss.backward()

    return tp, (loss_of, backward)


AUTOTP_SIDES = (("autotp", False, "replicated"), ("autotp-local", False, "local"), ("autotp-loss", True, "replicated"))
"""(name, compile the loss-only wrapper, ``outputs=``) of each autotp side."""


def _predicted_bytes(module: Any) -> int:
    """The plan's training memory per rank (weights + gradients + optimizer state + saved activations)."""
    plan = getattr(module, "plan", None)
    if plan is None:
        return 0
    return (plan.parameter_bytes_per_rank + plan.gradient_bytes_per_rank + plan.optimizer_bytes_per_rank
            + plan.activation_bytes_per_rank)


def _peak_bytes(module: Any, optimizer: Any, step: Any) -> int:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _measure(rank: int, world_size: int, layers: int, hidden: int, vocab: int, batch: int, seq: int,
             steps: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))  # (batch, seq)
    base = _llama(layers, hidden, vocab, seq)
    with torch.no_grad():
        reference = float(base(ids, labels=ids).loss)  # one process, HF's own loss: what both sides must give
    sides: dict[str, Any] = {}
    notes: dict[str, str] = {}
    dtensor_model, dtensor_fns = _dtensor_side(copy.deepcopy(base), world_size)
    sides["DTensor"] = (dtensor_model, dtensor_fns)
    for name, loss_only, outputs in AUTOTP_SIDES:
        autotp_side = _autotp_side(copy.deepcopy(base), ids, loss_only=loss_only, outputs=outputs)
        if isinstance(autotp_side, str):
            notes[name] = autotp_side
        else:
            sides[name] = autotp_side
    optimizers = {name: torch.optim.AdamW(module.parameters(), lr=1e-4) for name, (module, _) in sides.items()}

    def step(name: str) -> float:
        _, (loss_of, backward) = sides[name]
        loss = loss_of(ids)
        backward(loss)
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    first_loss = {name: step(name) for name in sides}
    for name in sides:
        step(name)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(steps):
        for name in sides:
            torch.distributed.barrier()
            started = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - started)
    peaks = {name: _peak_bytes(sides[name][0], optimizers[name], lambda name=name: step(name)) for name in sides}
    torch.distributed.barrier()
    return {"time_s": {name: statistics.median(t) for name, t in times.items()}, "peak_bytes": peaks,
            "predicted_bytes": {name: _predicted_bytes(sides[name][0]) for name in sides},
            "first_loss": first_loss, "reference_loss": reference, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    print(f"Llama: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch}, seq {args.seq}; "
          f"AdamW; gloo on CPU; median of {args.steps} steps (rank 0); peak = MemTracker live tensor bytes, one step")
    try:
        for world_size in args.world_sizes:
            first = run_on_ranks(world_size, _measure, args.layers, args.hidden, args.vocab, args.batch, args.seq,
                                 args.steps, timeout_s=1800)[0]
            for name in first["time_s"]:
                predicted = first["predicted_bytes"][name]
                print(f"  tp={world_size} {name:<12} step {first['time_s'][name] * 1e3:9.2f} ms   peak "
                      f"{first['peak_bytes'][name] / 2**20:8.2f} MiB   first loss {first['first_loss'][name]:.6f}"
                      + (f"   plan's training memory {predicted / 2**20:.2f} MiB" if predicted else ""))
            print(f"  tp={world_size} one process (reference) first loss {first['reference_loss']:.6f}")
            for name, note in first["notes"].items():
                print(f"  tp={world_size} {name:<11} not measured: {note}")
            for name, _, _ in AUTOTP_SIDES:
                if name in first["time_s"]:
                    time_ratio = first["time_s"][name] / first["time_s"]["DTensor"]
                    memory_ratio = first["peak_bytes"][name] / first["peak_bytes"]["DTensor"]
                    print(f"  tp={world_size} {name} / DTensor: step time {time_ratio:.3f}x (goal <= 0.8x), "
                          f"peak memory {memory_ratio:.3f}x (goal <= 1x)")
    finally:
        shutdown_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
