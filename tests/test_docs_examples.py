"""Every Python example of README.md and docs/*.md runs here, or its page says why it cannot.

A page's ```` ```python ```` blocks run in order in one namespace, as a reader would type them into one
script. The namespace starts with what the prose around the examples speaks of (:data:`SETUP`): ``torch``,
``torch.distributed as dist``, ``autotp``, a tiny random-weight Llama as ``model`` (seeded, so every rank
holds the same weights) and token ids ``ids`` (2 rows of 16); a block that defines its own replaces them.
Files the examples write (``plan.html``, ``plan.json``...) land in a temporary folder.

A page whose examples start processes' work (``autotp.compile``, ``from_pretrained``, ``load``, a
``torch.compile`` backend, ``dist.``) runs on :data:`WORLD_SIZE` real gloo ranks from tests/distributed.py's
pool (marker ``distributed``); there the pool's process group stands for the launcher's, so an example's
``dist.init_process_group()`` finds it ready. Any other page runs in this process (the fast tier).

An example that cannot run on the CPU test machine (a GPU, a checkpoint or config file of the reader's, many
ranks, a download) carries an HTML comment on the line before its fence that names the reason, which the page
shows to nobody and this test honours::

    <!-- not run: needs a GPU and 16 ranks (tests/test_mesh_runtime.py runs compile_mesh on gloo) -->

``<!-- needs: dot -->`` runs a block only where that program is installed (Graphviz's ``dot`` is installed by
``.ci/run`` when it can be).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs  # a tier of its own beside the docs build (.ci/run); its in-process pages are fast too

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
"""The pages whose examples run: the README and every page of the docs site's top folder (the benchmark
pages hold tables and commands, no Python)."""

WORLD_SIZE = 2
"""Ranks a page whose examples need a process group runs on."""

SETUP = """\
import torch
import torch.distributed as dist
import autotp
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)                     # the same weights on every rank
config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 1000, (2, 16))    # (batch, seq) token ids
"""
"""What a page's examples start from: the ``model`` and ``ids`` the prose speaks of, small enough for the CPU."""

_MARKER = re.compile(r"^<!--\s*(not run|needs):\s*(.*?)\s*-->$")
_ON_RANKS = re.compile(r"autotp\.(compile|compile_mesh|from_pretrained|load|backend)\(|\bdist\.|torch\.compile\(")


@dataclasses.dataclass(frozen=True)
class Example:
    """One ```` ```python ```` block: where it is, its code, and the marker on the line before its fence."""

    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None = None  # the reason given, when the page says it cannot run
    needs: str | None = None  # a program the block runs only with

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs_here(self) -> bool:
        return self.not_run is None and (self.needs is None or shutil.which(self.needs) is not None)


def page_examples(path: Path) -> list[Example]:
    """The Python blocks of one Markdown page, in order, with their markers."""
    lines = path.read_text().splitlines()
    found: list[Example] = []
    index = 0
    while index < len(lines):
        if lines[index].strip() != "```python":
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        previous = lines[index - 1].strip() if index else ""
        marker = _MARKER.match(previous)
        kind, text = (marker.group(1), marker.group(2)) if marker else (None, None)
        found.append(Example(page=str(path.relative_to(ROOT)), line=index + 1, code="\n".join(lines[index + 1:end]),
                             not_run=text if kind == "not run" else None, needs=text if kind == "needs" else None))
        index = end + 1
    return found


ALL_EXAMPLES = [example for page in PAGES for example in page_examples(page)]


def _runs_on_ranks(examples: list[Example]) -> bool:
    return any(_ON_RANKS.search(example.code) for example in examples)


SLOW_PAGES = {"docs/mesh.md": "three searches of a 16-rank mesh: about 20 s alone, a minute on a busy machine"}
"""Pages whose examples run in the ``slow`` tier rather than the fast one, with why."""


def _pages(on_ranks: bool) -> list[str]:
    pages = []
    for page in PAGES:
        runnable = [example for example in page_examples(page) if example.runs_here]
        if runnable and _runs_on_ranks(runnable) == on_ranks:
            pages.append(str(page.relative_to(ROOT)))
    return pages


def _params(pages: list[str]) -> list[object]:
    return [pytest.param(page, marks=pytest.mark.slow) if page in SLOW_PAGES else page for page in pages]


def run_page(page: str, workdir: str) -> str:
    """Run the runnable examples of ``page`` after :data:`SETUP` in one namespace, in ``workdir``; returns what
    they printed. An example that raises fails with the page, the line and the block."""
    namespace: dict[str, object] = {"__name__": "__docs_example__"}
    printed = io.StringIO()
    here = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(SETUP, "<docs example setup>", "exec"), namespace)
            for example in page_examples(ROOT / page):
                if not example.runs_here:
                    continue
                # the fence's line first, so a traceback's line numbers are the page's own
                code = compile("\n" * example.line + example.code, str(ROOT / example.page), "exec")
                try:
                    exec(code, namespace)
                except Exception as error:
                    raise AssertionError(f"the example at {example.where} raised {type(error).__name__}: {error}\n"
                                         f"--- the example:\n{example.code}") from error
    finally:
        os.chdir(here)
    return printed.getvalue()


def _page_on_rank(rank: int, world_size: int, page: str) -> str:
    """One rank's run of a page; ``dist.init_process_group`` finds the pool's group ready (it stands for the
    launcher's), and each rank writes its files in a folder of its own."""
    import torch.distributed as dist

    def already_initialised(*args: object, **kwargs: object) -> None:
        if not dist.is_initialized():
            raise RuntimeError("the gloo pool's worker has no default process group")

    workdir = tempfile.mkdtemp(prefix=f"autotp-docs-rank{rank}-")
    original = dist.init_process_group
    dist.init_process_group = already_initialised
    try:
        return run_page(page, workdir)
    finally:
        dist.init_process_group = original
        shutil.rmtree(workdir, ignore_errors=True)


def test_every_example_runs_or_says_why_not() -> None:
    """Every Python block is run by a test below, or is marked with a reason (no markers without one)."""
    assert len(ALL_EXAMPLES) >= 20, f"expected the docs' Python examples (20 or more), found {len(ALL_EXAMPLES)}"
    unexplained = [example.where for example in ALL_EXAMPLES if example.not_run is not None and len(example.not_run) < 10]
    assert not unexplained, f"'<!-- not run: ... -->' must say why; these do not: {unexplained}"
    covered = {example.page for example in ALL_EXAMPLES if example.runs_here}
    assert covered <= set(_pages(on_ranks=False)) | set(_pages(on_ranks=True)), "a page with runnable examples has no test"
    ran = sum(example.runs_here for example in ALL_EXAMPLES)
    assert ran >= len(ALL_EXAMPLES) // 2, (f"expected most examples to run; {ran} of {len(ALL_EXAMPLES)} do, the others "
                                          f"say: {[(e.where, e.not_run) for e in ALL_EXAMPLES if e.not_run]}")


@pytest.mark.parametrize("page", _params(_pages(on_ranks=False)))
def test_page_examples_run(page: str, tmp_path: Path) -> None:
    """The examples of a page that needs no process group run in this process (planning, reports)."""
    run_page(page, str(tmp_path))


@pytest.mark.distributed
@pytest.mark.parametrize("page", _pages(on_ranks=True))
def test_page_examples_run_on_ranks(page: str, gloo) -> None:
    """tp=2 on real gloo ranks: the examples of a page that compiles run on every rank, as under torchrun."""
    printed = gloo.run(WORLD_SIZE, _page_on_rank, page, timeout_s=600)
    assert len(printed) == WORLD_SIZE, f"expected a result from each of {WORLD_SIZE} ranks, got {len(printed)}"
