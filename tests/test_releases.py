"""The transformers release installed is one autotp supports, and there it computes what HF computes.

Tier (c), real gloo processes, tp 2 and 3. CI runs this file on every transformers release it tests: the
main suite on the newest, ``.ci/release_tiers`` on the oldest of each range in
:mod:`autotp.adapters.hf_transformers` (the generation range's oldest tier runs the generation tests only):

- a plain forward of every Hugging Face family (``autotp.compile(model, example_inputs=(ids,))``, then
  ``tp(ids)``, the config's ``use_cache`` left True as HF sets it): logits within 1e-4 of the model's, as
  ``tests/test_equivalence.py`` checks every model at the other world sizes;
- greedy generation: the tokens equal HF's ``model.generate`` exactly, for several families of four layers
  (the first rank traces three and stamps the fourth, :mod:`autotp.capture.stamping`; the others rebuild them); on a
  release below the generation range, compiling for generation raises ``UnsupportedReleaseError``
  naming the range (it never runs on with a cache the model ignores). The families that
  ``tests/test_generate.py`` also generates with at the same world size (:data:`GENERATED_ELSEWHERE`) are a case
  of their own marked ``zoo``: the main suite (``-m "not zoo"``) leaves them to the wide-zoo tier, which runs them on
  the same release, and the release tiers (no marker filter) run every case.

Each test is one call on the worker pool that loops over the families inside the ranks, so a release
costs a few pool calls, not one per family.
"""

from __future__ import annotations

import functools
import logging
import re
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from generation_models import tiny_deepseek_v3, tiny_gemma, tiny_gpt_neox, tiny_phi, tiny_recurrent, tiny_starcoder2
from models import tiny_bert, tiny_gpt2, tiny_llama, tiny_mistral, tiny_mixtral, tiny_qwen2

import autotp
from autotp.adapters import hf_transformers, torch_internals
from autotp.adapters import torchao as torchao_adapter

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4
SHARE_SLACK = 0.12
"""How far above 1 / world size the largest rank's share of the weights may be (norms and biases kept whole,
heads that do not divide)."""
NEW_TOKENS = 6
PROMPT = 6
RELEASE = hf_transformers.installed_release()
GENERATES = hf_transformers.GENERATION_RELEASES.admits(RELEASE)

FORWARD_FAMILIES = {"llama": tiny_llama, "gpt2": tiny_gpt2, "bert": tiny_bert, "mistral": tiny_mistral,
                    "qwen2": tiny_qwen2, "mixtral": tiny_mixtral, "gemma": tiny_gemma, "phi": tiny_phi,
                    "gpt_neox": tiny_gpt_neox, "starcoder2": tiny_starcoder2}
# the families checked at tp 3 too (uneven heads, kv heads and experts), then at tp 2 the rest
FORWARD_AT_TP3 = ["llama", "gpt2", "qwen2", "mixtral", "starcoder2"]
GENERATION_LAYERS = 4
GENERATION_GRAPHS = 3
"""Decode, a prompt's first chunk and its later chunks (a prompt of PROMPT tokens may take two chunks of
max_cache_len PROMPT + NEW_TOKENS)."""
GENERATION_FAMILIES = {2: ["llama", "gpt2", "gpt_neox", "starcoder2", "gemma", "phi", "mixtral", "deepseek_v3"],
                       3: ["llama", "gpt2", "gpt_neox", "starcoder2"]}
GENERATED_ELSEWHERE = {2: ["llama", "gpt2", "gemma", "phi", "mixtral", "deepseek_v3"], 3: ["llama"]}
"""The families of GENERATION_FAMILIES that ``tests/test_generate.py`` generates with at the same world size (greedy
tokens equal HF's, in the main suite): their case here is marked ``zoo``, so on the main suite's release it runs in
the wide-zoo tier instead of twice in the main suite (a two-minute test on 2 cores); the release tiers run it as
before. :func:`test_the_families_left_to_the_zoo_tier_generate_in_the_main_suite` keeps this list true."""
GENERATION_BUILDERS = {**FORWARD_FAMILIES, "deepseek_v3": functools.partial(tiny_deepseek_v3, dense_layers=0)}
"""Builders of the generation families. DeepSeek-V3's cache differs by release (keys and values per head of
different sizes on 5.10, the latent on 5.24), so each end of the generation range checks its own; every layer
MoE, so that its four layers are alike and stamped."""


def _release_excludes(family: str) -> str | None:
    """Why ``family`` cannot be traced on this release (a clear ``CaptureError`` is then expected), or None.

    Before 5.10, Mixtral's experts loop over the experts a batch hits (a data-dependent loop that
    torch.export cannot trace)."""
    if family == "mixtral" and not hf_transformers.ReleaseRange("5.10.0", "99.0", "transformers").admits(RELEASE):
        return "Mixtral's data-dependent experts loop"
    return None


def _forward_families(world_size: int) -> list[str]:
    return FORWARD_AT_TP3 if world_size == 3 else list(FORWARD_FAMILIES)


def _forward_rows(rank: int, world_size: int, families: list[str], trace_cache: str) -> dict[str, Any]:
    """Each family compiled through ``trace_cache`` (the tests' shared directory): the program traced at tp 2 is
    rebuilt at tp 3 (the same program: a trace depends on the model and inputs, not on the world size)."""
    rows: dict[str, Any] = {}
    for family in families:
        model, args, _ = FORWARD_FAMILIES[family]()
        model.config.use_cache = True  # HF's default, as from_pretrained gives it: the plain call must work
        with torch.no_grad():
            expected = model(*args, use_cache=False)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tp = autotp.compile(model, world_size=world_size, example_inputs=args,
                                    runtime=autotp.RuntimeOptions(trace_cache=trace_cache))
        except autotp.CaptureError as error:
            rows[family] = ("capture error", str(error).splitlines()[0])
            continue
        with torch.no_grad():
            got = tp(*args)
        logits = "last_hidden_state" if family == "bert" else "logits"
        rows[family] = ("ran", float((got[logits] - expected[logits]).abs().max()), {
            "first": got[logits].flatten()[:4].tolist(), "counts": tp.collective_counts(),
            "bytes": tp.parameter_bytes(), "fallback_ops": tp.plan.fallback_ops,
            "full_bytes": sum(p.numel() * p.element_size() for p in model.parameters())})
    return rows


class _Messages(logging.Handler):
    """The messages logged to it, as text."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())


def _generation_rows(rank: int, world_size: int, families: list[str]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    stamping = logging.getLogger("autotp.capture.stamping")
    for family in families:
        # four layers, as a real model's many: the first rank traces three, functionalized, and stamps the fourth
        model, (ids,), _ = GENERATION_BUILDERS[family](batch=2, seq_len=PROMPT, layers=GENERATION_LAYERS)
        model.generation_config.pad_token_id = 0
        messages = _Messages()
        stamping.addHandler(messages)
        stamping.setLevel(logging.DEBUG)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tp = autotp.compile(model, world_size=world_size, example_inputs=(ids,),
                                    max_cache_len=PROMPT + NEW_TOKENS)
        except (autotp.UnsupportedReleaseError, autotp.CaptureError) as error:
            rows[family] = (type(error).__name__, str(error).splitlines()[0])
            continue
        finally:
            stamping.removeHandler(messages)
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  do_sample=False)
        got = tp.generate(ids, max_new_tokens=NEW_TOKENS)
        rows[family] = ("ran", got.tolist(), expected.tolist(), tp.cache_bytes(), messages.texts)
    return rows


def _by_family(gloo: Any, world_size: int, rows_of: Any, families: list[str], *args: Any) -> list[dict[str, Any]]:
    """``rows_of``'s rows on every rank, the ranks called once per family: each call's timeout detects a hang, and
    all families in one call took 260-300 s of its 300 under CI's load."""
    by_rank: list[dict[str, Any]] = [{} for _ in range(world_size)]
    for family in families:
        for rows, more in zip(by_rank, gloo.run(world_size, rows_of, [family], *args), strict=True):
            rows.update(more)
    return by_rank


@pytest.mark.parametrize("world_size", [2, 3])
def test_forward_equals_the_model_on_this_release(gloo, world_size: int, trace_cache: str) -> None:
    """tp=2 (every HF family) and 3 (five: 8/4, 2 kv heads and experts split unevenly), a plain forward:
    logits within 1e-4 and the same on every rank, the same collectives on every rank, no rank holding more than its
    share of the weights (and SHARE_SLACK), no op left without a rule (or, where the release cannot trace a family, a
    CaptureError on every rank). The families of tp 3 rebuild the programs traced at tp 2 (the session's trace
    cache), where the tp 2 test ran first in the same process."""
    by_rank = _by_family(gloo, world_size, _forward_rows, _forward_families(world_size), trace_cache)
    assert all(rows.keys() == by_rank[0].keys() for rows in by_rank), by_rank
    for family in _forward_families(world_size):
        outcomes = [rows[family] for rows in by_rank]
        excluded = _release_excludes(family)
        if excluded is not None:
            assert all(o[0] == "capture error" for o in outcomes), (
                f"transformers {RELEASE}, {family}: expected a CaptureError ({excluded}), got {outcomes}")
            continue
        assert all(o[0] == "ran" for o in outcomes), f"transformers {RELEASE}, {family}: {outcomes}"
        worst = max(o[1] for o in outcomes)
        where = f"transformers {RELEASE}, {family} at tp {world_size}"
        assert worst <= TOLERANCE, f"{where}: max |diff| {worst:.2e}"
        facts = [o[2] for o in outcomes]
        assert all(f["first"] == facts[0]["first"] for f in facts), f"{where}: the ranks return other logits: {facts}"
        assert all(f["counts"] == facts[0]["counts"] for f in facts), f"{where}: the ranks issue other collectives: {facts}"
        share = max(f["bytes"] for f in facts) / facts[0]["full_bytes"]
        assert share <= 1 / world_size + SHARE_SLACK, f"{where}: the largest rank holds {share:.2f} of the weights"
        assert facts[0]["fallback_ops"] == (), f"{where}: ops without a rule ran replicated: {facts[0]['fallback_ops']}"


GENERATION_CASES = [
    *[pytest.param(world_size, [f for f in families if f not in GENERATED_ELSEWHERE[world_size]], id=str(world_size))
      for world_size, families in GENERATION_FAMILIES.items()],
    *[pytest.param(world_size, [f for f in families if f in GENERATED_ELSEWHERE[world_size]],
                   id=f"{world_size}-generated-elsewhere", marks=pytest.mark.zoo)
      for world_size, families in GENERATION_FAMILIES.items()],
]
"""Every family of GENERATION_FAMILIES once at each world size: the main suite's cases, then those marked ``zoo``."""


@pytest.mark.parametrize("world_size,families", GENERATION_CASES)
def test_greedy_tokens_equal_hf_on_this_release(gloo, world_size: int, families: list[str]) -> None:
    """tp=2 (8 families, DeepSeek-V3 among them) and tp=3 (4 families), a 6-token prompt, 6 new tokens: on a release in the
    generation range, tokens equal HF's greedy ``generate`` on every rank and the cache holds bytes;
    below it, ``UnsupportedReleaseError`` naming the supported releases on every rank. The families are split in
    two cases per world size (:data:`GENERATION_CASES`): those of :data:`GENERATED_ELSEWHERE` are marked ``zoo``."""
    by_rank = _by_family(gloo, world_size, _generation_rows, families)
    for family in families:
        outcomes = [rows[family] for rows in by_rank]
        if not GENERATES:
            assert all(o[0] == "UnsupportedReleaseError" and str(hf_transformers.GENERATION_RELEASES) in o[1]
                       for o in outcomes), f"transformers {RELEASE} (below the generation range), {family}: {outcomes}"
            continue
        if _release_excludes(family) is not None:
            assert all(o[0] == "CaptureError" for o in outcomes), f"transformers {RELEASE}, {family}: {outcomes}"
            continue
        for rank, outcome in enumerate(outcomes):
            assert outcome[0] == "ran", f"transformers {RELEASE}, {family}, rank {rank}: {outcome}"
            _, got, expected, _, messages = outcome
            assert got == expected, (
                f"transformers {RELEASE}, {family} at tp {world_size}, rank {rank}: tokens {got} != HF's {expected}")
            stamped = [m for m in messages if f"traced with 3 of its {GENERATION_LAYERS} layers" in m]
            assert len(stamped) == (GENERATION_GRAPHS if rank == 0 else 0) and len(messages) == len(stamped), (
                f"transformers {RELEASE}, {family}, rank {rank}: expected the first rank to stamp its "
                f"{GENERATION_GRAPHS} generation graphs and the others to rebuild them, got {messages}")
        # a rank may hold no kv heads (2 over 3 ranks), but the group holds the cache
        held = [outcome[3] for outcome in outcomes]
        assert sum(held) > 0, f"transformers {RELEASE}, {family}: the KV cache holds no bytes on any rank ({held})"


def _greedy_cases_of_test_generate() -> set[tuple[str, int]]:
    """(family, world size) of every greedy-equals-HF case of ``tests/test_generate.py`` (its parametrize marks)."""
    import test_generate

    one_family = {"test_llama_greedy_matches_hf": "llama", "test_deepseek_v3_latent_cache_greedy_matches_hf": "deepseek_v3"}
    cases: set[tuple[str, int]] = set()
    for name in (*one_family, "test_family_greedy_matches_hf"):
        for mark in getattr(test_generate, name).pytestmark:
            if mark.name != "parametrize":
                continue
            for values in mark.args[1]:
                cases.add((one_family[name], values) if name in one_family else tuple(values))
    return cases


def test_the_families_left_to_the_zoo_tier_generate_in_the_main_suite() -> None:
    """No process group: every family the main suite leaves to the zoo tier here (:data:`GENERATED_ELSEWHERE`) is one
    of GENERATION_FAMILIES, and ``tests/test_generate.py`` (main suite) checks its greedy tokens against HF's at that
    world size; every family of GENERATION_FAMILIES is in exactly one case of :data:`GENERATION_CASES`."""
    elsewhere = _greedy_cases_of_test_generate()
    for world_size, families in GENERATED_ELSEWHERE.items():
        for family in families:
            assert family in GENERATION_FAMILIES[world_size], f"{family} at tp {world_size} is not generated here"
            assert (family, world_size) in elsewhere, (
                f"tests/test_generate.py no longer generates with {family} at tp {world_size}: take it out of "
                f"GENERATED_ELSEWHERE, so that the main suite runs it here again")
    for world_size, families in GENERATION_FAMILIES.items():
        cases = [case.values[1] for case in GENERATION_CASES if case.values[0] == world_size]
        assert sorted(f for listed in cases for f in listed) == sorted(families), (world_size, cases)
        assert all(cases), f"tp {world_size}: an empty case {cases}"


def test_the_installed_release_is_one_ci_tests() -> None:
    """No process group: the release this suite runs on is inside the forward range (pyproject's bound)."""
    assert hf_transformers.FORWARD_RELEASES.admits(RELEASE), (
        f"transformers {RELEASE} is outside {hf_transformers.FORWARD_RELEASES}; pyproject.toml's range and "
        "autotp.adapters.hf_transformers must say the same")


def _release_tiers() -> dict[str, dict[str, str]]:
    """``.ci/release_tiers`` as tier name -> {package: pinned release}."""
    tiers: dict[str, dict[str, str]] = {}
    for line in (ROOT / ".ci" / "release_tiers").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, requirements, _ = (part.strip() for part in line.split("|"))
        tiers[name] = dict(requirement.split("==") for requirement in requirements.split())
    return tiers


def _floors() -> dict[str, str]:
    """Every ``name>=release`` in pyproject.toml's dependencies and extras (the test tools aside)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *project["optional-dependencies"]["hf"],
             *project["optional-dependencies"]["viz"], *project["optional-dependencies"]["quant"]]
    floors = {}
    for spec in specs:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(,<[0-9.]+)?", spec)
        assert match, f"pyproject.toml: {spec!r} is not of the form name>=oldest[,<bound]"
        floors[match[1]] = match[2]
    return floors


def test_ci_runs_the_oldest_release_of_every_declared_range() -> None:
    """No process group: pyproject.toml's floors are what .ci/release_tiers' oldest tier installs (torch
    aside: the main suite runs its oldest release, .ci/torch_tier its newest, tests/test_torch_internals.py checks
    both), the transformers ranges of the adapter are pyproject's, and some tier runs the oldest release of each."""
    tiers = _release_tiers()
    floors = _floors()
    oldest = tiers["oldest"]
    for package, floor in floors.items():
        if package == "torch":
            assert floor == torch_internals.RELEASES.oldest, (
                f"pyproject.toml's torch floor {floor} is not the oldest release autotp.adapters.torch_internals "
                f"supports ({torch_internals.RELEASES.oldest}), which .ci/constraints.txt pins for the main suite")
            continue
        assert oldest.get(package) == floor, (
            f".ci/release_tiers' oldest tier installs {package}=={oldest.get(package)}, pyproject.toml's floor is {floor}")
    assert floors["transformers"] == hf_transformers.FORWARD_RELEASES.oldest, floors
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["hf"] == [hf_transformers.FORWARD_RELEASES.pip_spec()], (
        "pyproject.toml's transformers range differs from autotp.adapters.hf_transformers.FORWARD_RELEASES")
    assert project["optional-dependencies"]["quant"] == [torchao_adapter.PIP_SPEC], (
        f"pyproject.toml's torchao range differs from autotp.adapters.torchao.PIP_SPEC ({torchao_adapter.PIP_SPEC})")
    tested = {release for pins in tiers.values() for package, release in pins.items() if package == "transformers"}
    for releases in (hf_transformers.FORWARD_RELEASES, hf_transformers.GENERATION_RELEASES):
        assert releases.oldest in tested, (
            f"no tier of .ci/release_tiers runs transformers {releases.oldest} (tiers run {sorted(tested)})")


def _recurrent_rows(rank: int, world_size: int, family: str) -> tuple[Any, ...]:
    model, (ids,), _ = tiny_recurrent(family, batch=2, seq_len=PROMPT)
    model.generation_config.pad_token_id = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = autotp.compile(model, world_size=world_size, example_inputs=(ids,), max_cache_len=32)
    except autotp.UnsupportedReleaseError as error:
        return ("UnsupportedReleaseError", str(error).splitlines()[0])
    longer = torch.cat([ids, ids[:, :3]], dim=1)  # the prefill graph's 6 tokens, then 3 through decode
    got = [tp.generate(p, max_new_tokens=NEW_TOKENS).tolist() for p in (ids, longer)]
    expected = [model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=NEW_TOKENS,
                               do_sample=False).tolist() for p in (ids, longer)]
    return ("ran", got, expected, tp.cache_bytes())


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_recurrent_state_generates_on_this_release(gloo, family: str) -> None:
    """tp=2, tiny Mamba and Mamba2 (a convolution and an SSM state per layer, held as graph state; the cache layer
    holds them as one tensor each on 5.10, a dict on 5.24), prompts of 6 and 9 tokens, 6 new tokens: on a release in
    the generation range, tokens equal HF's greedy ``generate`` on every rank and the states hold bytes; below it,
    ``UnsupportedReleaseError`` on every rank."""
    outcomes = gloo.run(2, _recurrent_rows, family)
    for rank, outcome in enumerate(outcomes):
        if not GENERATES:
            assert outcome[0] == "UnsupportedReleaseError", f"transformers {RELEASE}, {family}, rank {rank}: {outcome}"
            continue
        assert outcome[0] == "ran", f"transformers {RELEASE}, {family}, rank {rank}: {outcome}"
        _, got, expected, cache_bytes = outcome
        assert got == expected, f"transformers {RELEASE}, {family}, rank {rank}: tokens {got} != HF's {expected}"
        assert cache_bytes > 0, f"transformers {RELEASE}, {family}, rank {rank}: no state held"
