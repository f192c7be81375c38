"""print(plan): the per-layer text summary (unit tier, no process group).

Tiny Llama (hidden 256, 8 heads, 4 kv heads, 2 layers) over tp=4, planned on the meta device.
"""

from __future__ import annotations

from inspect_helpers import tiny_plan

from autotp.planning.plan import WIDTH


def test_summary_is_a_per_layer_table_that_fits() -> None:
    """tp=4: one row per block, the two identical decoder layers folded, weights and collectives listed,
    every line within 100 columns."""
    plan = tiny_plan()
    text = str(plan)
    assert text == plan.summary()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH, max(lines, key=len)
    header = next(i for i, line in enumerate(lines) if line.startswith("block"))
    rows = [line.split()[0] for line in lines[header + 1:] if line and not line.startswith("(")][:6]
    assert rows == ["model.embed_tokens", "model", "model.rotary_emb", "model.layers.0-1", "model.norm", "lm_head"], rows
    layer = next(line for line in lines if line.startswith("model.layers.0-1"))
    assert layer.split()[1] == "2", layer
    in_layer = [c for c in plan.collectives if c.module.startswith("model.layers.0")]
    if in_layer:
        assert "  model.layers.0-1 (each of 2):" in lines, text
    for c in in_layer:
        kind = "+".join(s for s in c.steps if s not in ("slice", "zero")) or "+".join(c.steps)
        relative = c.module.removeprefix("model.layers.0").lstrip(".")
        assert any(line.split()[:2] == [kind, c.producer] and line.endswith(relative) for line in lines), (c, text)
    assert f"mlp.down_proj.weight {plan.parameters['model.layers.0.mlp.down_proj.weight']}" in text
    assert "predicted forward: " in lines[1] and "tp=4 on h100-sxm" in lines[0]


def test_summary_max_rows_cuts_tables() -> None:
    """max_rows bounds the tables: one block row shown, the rest counted."""
    text = tiny_plan().summary(max_rows=1)
    assert "... 5 more blocks" in text, text
