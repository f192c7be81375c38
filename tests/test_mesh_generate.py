"""autotp.compile_mesh(model, mesh, max_cache_len=N).generate(...): generation over a dp x pp x tp mesh.

One pool call of 4 gloo processes runs dp2 x tp2 and pp2 x tp2 on tiny Llama (2 layers, hidden 64);
greedy tokens must equal HuggingFace's single-process ``model.generate`` on every rank, with an
eos that ends some rows early. A unit test checks the stage view without a process group.
"""

from __future__ import annotations

from typing import Any

import torch
from models import tiny_llama

TINY = {"num_heads": 4, "num_kv_heads": 2, "hidden": 64, "intermediate": 128, "seq_len": 8, "layers": 2}
PROMPT, NEW, CACHE = 5, 5, 12


def _prompts(batch: int) -> torch.Tensor:
    return torch.randint(0, 1000, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


def _reference(batch: int) -> tuple[int, torch.Tensor]:
    """An eos that the last row produces at its second new token (so it ends early), and HF's greedy
    tokens with that eos (finished rows padded with 0)."""
    model, _, _ = tiny_llama(**TINY)
    ids = _prompts(batch)
    options = {"max_new_tokens": NEW, "do_sample": False, "attention_mask": torch.ones_like(ids), "pad_token_id": 0}
    with torch.no_grad():
        eos = int(model.generate(ids, **options)[-1, PROMPT + 1])
        return eos, model.generate(ids, eos_token_id=eos, **options)


def _generate_on_meshes(rank: int, world_size: int, cases: list[tuple[tuple[int, ...], tuple[str, ...], int, int, int]]
                        ) -> list[Any]:
    """Each case: (dims, names, batch, example seq, eos): compile on the mesh, generate greedy with eos;
    on the pp mesh also sample with a seed (every rank must return the same tokens)."""
    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    results = []
    for dims, names, batch, seq, eos in cases:
        model, _, _ = tiny_llama(**TINY)
        ids = _prompts(batch)
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
        part = autotp.compile_mesh(model, mesh, example_inputs=(ids[:, :seq],), max_cache_len=CACHE)
        greedy = part.generate(ids, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
        sampled = part.generate(ids, max_new_tokens=3, do_sample=True, seed=7) if "pp" in names else None
        try:
            part(ids)
            called = "no error"
        except TypeError as exc:
            called = str(exc)
        results.append((greedy, sampled, part.cache_bytes(), called))
    return results


def test_generation_over_mesh_equals_hf_on_four_ranks(gloo: Any) -> None:
    """dp2 x tp2 (3 rows split 2 + 1; the 1-row replica ends early at eos and pads) and pp2 x tp2 (prefill
    chunks of 2 through both stages, hidden states sent stage to stage, tokens broadcast from the last):
    greedy tokens equal HF single-process generate on every rank; seeded sampling agrees across ranks; calling
    the module as the model raises a TypeError saying how to get logits."""
    cases = []
    expected = []
    for dims, names, batch, seq in [((2, 2), ("dp", "tp"), 3, 1), ((2, 2), ("pp", "tp"), 2, 2)]:
        eos, reference = _reference(batch)
        cases.append((dims, names, batch, seq, eos))
        expected.append(reference)
    results = gloo.run(4, _generate_on_meshes, cases)
    for rank, per_case in enumerate(results):
        for index, ((dims, names, *_), reference) in enumerate(zip(cases, expected)):
            setup = " x ".join(f"{n}{d}" for n, d in zip(names, dims))
            greedy, sampled, _, called = per_case[index]
            assert torch.equal(greedy, reference), \
                f"{setup} rank {rank}: expected HF's {reference.tolist()}, got {greedy.tolist()}"
            assert "generates: call .generate(" in called and "without max_cache_len" in called, (
                f"{setup} rank {rank}: calling the module gave {called!r}")
            first = results[0][index][1]
            assert sampled is None or torch.equal(sampled, first), \
                f"{setup} rank {rank}: sampled {sampled.tolist()}, rank 0 sampled {first.tolist()}"
    # pp2 x tp2: a rank holds its stage's one layer of cache (keys + values, 2 rows, 2 kv heads of 16, float32)
    one_layer = 2 * 2 * 2 * CACHE * 16 * 4
    held = [per_case[1][2] for per_case in results]
    assert all(0 < b <= one_layer for b in held), f"pp2 x tp2: expected at most {one_layer} B of cache per rank, got {held}"


def test_stage_view_keeps_only_its_blocks() -> None:
    """pp=2 over 2 blocks (no process group): stage 1's view drops block 0 and the embedding, stage 0's
    block 1 and the lm head; the user's model keeps all its modules."""
    from autotp.runtime.mesh.mesh_generate import stage_view

    model, _, _ = tiny_llama(**TINY, device="meta")
    first, _, tap = stage_view(model, 0, 1, last=False)
    second, inject, _ = stage_view(model, 1, 2, last=True)
    own = {name.split(".")[2] for name, _ in first.named_parameters() if name.startswith("model.layers.")}
    assert own == {"0"}, f"stage 0 should hold block 0's weights only, got blocks {own}"
    assert tap is not None and not any(n.startswith("lm_head") for n, _ in first.named_parameters()), "stage 0 keeps lm_head"
    names = [n for n, _ in second.named_parameters()]
    assert inject is not None and not any("embed_tokens" in n or ".layers.0." in n for n in names), f"stage 1 holds {names}"
    assert len(list(model.parameters())) == len(list(tiny_llama(**TINY, device="meta")[0].parameters())), \
        "stage_view changed the user's model"
