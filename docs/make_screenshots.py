"""Re-make docs/plan-llama.png: the HTML plan view of a tiny Llama, as headless Chromium shows it.

    python docs/make_screenshots.py

Plans the tiny-llama preset (2 layers, hidden 256, 8 heads, 4 kv heads, vocab 1000) for tp=4 on
h100-sxm, writes the page next to this script and screenshots its top with the weight of the
row-parallel MLP down projection selected (its alternatives in the side panel). Needs Chromium
(``apt-get install chromium``).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the headless-Chromium helper the tests use

import chromium  # noqa: E402

import autotp  # noqa: E402
from autotp.cli.plan import load_spec  # noqa: E402


def main() -> None:
    model, args, kwargs = load_spec("tiny-llama").build(2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, args, kwargs, world_size=4, hardware="h100-sxm")
    page = HERE / "plan-llama.html"
    autotp.to_html(plan, page, title="tiny Llama, tp=4 on h100-sxm")
    png = HERE / "plan-llama.png"
    run = chromium.screenshot(page, png, "select=model.layers.0.mlp.down_proj.weight&noscroll=1", window=(1600, 1150))
    if run.console_errors() or not png.exists():
        raise SystemExit(f"screenshot failed: {run.console_errors()}\n{run.stderr[-2000:]}")
    page.unlink()
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
