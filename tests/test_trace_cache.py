"""The trace cache (autotp/capture/trace_cache.py): a second load of the same model reads the traced program
instead of calling torch.export, gives the same outputs, and never uses a stale or corrupt entry."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from models import tiny_llama
from transformers import AutoConfig

import autotp
from autotp.capture.trace_cache import TraceCache, open_trace_cache
from autotp.capture.tracing import capture

HIDDEN = 64


@pytest.fixture
def one_rank():
    """A fake process group of one rank (autotp.compile needs one; tp=1 runs no collective)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def export_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts calls of ``torch.export.export`` (it still runs: a spy, not a stand-in)."""
    calls: list[str] = []
    original = torch.export.export

    def counted(model, *args, **kwargs):
        calls.append(type(model).__name__)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


@pytest.fixture
def plan_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the plans made by the first rank (``plan_graph`` still runs)."""
    import autotp.runtime.agreement.group as group

    calls: list[int] = []
    original = group.plan_graph

    def counted(captured, options):
        calls.append(options.world_size)
        return original(captured, options)

    monkeypatch.setattr(group, "plan_graph", counted)
    return calls


def _checkpoint(directory: Path, **config: object) -> tuple[Path, torch.nn.Module, tuple]:
    model, args, _ = tiny_llama(layers=1, hidden=HIDDEN, intermediate=128)
    for name, value in config.items():
        setattr(model.config, name, value)
    model.save_pretrained(directory)
    return directory, model, args


def _logits(tp: torch.nn.Module, args: tuple) -> torch.Tensor:
    with torch.no_grad():
        return tp(*args, use_cache=False).logits


def test_hit_skips_export_and_gives_the_same_outputs(tmp_path: Path, export_calls: list[str], plan_calls: list[int],
                                                     one_rank: None) -> None:
    """tp=1, tiny Llama from a checkpoint on meta: the second from_pretrained reads the cache (no export, no
    planning),
    outputs equal the first's bit for bit; another config (rms_norm_eps only, same shapes) misses;
    a corrupt entry is ignored with a warning, traced again and rewritten."""
    source, model, args = _checkpoint(tmp_path / "hf")
    listing = sorted(p.name for p in source.iterdir())
    cache = tmp_path / "cache"
    first = autotp.from_pretrained(source, world_size=1, example_inputs=args,
                                   runtime=autotp.RuntimeOptions(trace_cache=cache))
    assert len(export_calls) == 1, f"expected 1 export on an empty cache, got {export_calls}"
    entries = sorted((cache / "traces").glob("*.pt2c"))
    assert len(entries) == 1, f"expected one cache entry, found {entries}"
    second = autotp.from_pretrained(source, world_size=1, example_inputs=args,
                                    runtime=autotp.RuntimeOptions(trace_cache=cache))
    assert len(export_calls) == 1, f"the second load should not export, export calls: {export_calls}"
    assert plan_calls == [1], f"the second load should reuse the plan, plans made: {plan_calls}"
    assert second.plan.to_json() == first.plan.to_json(), "the cached plan differs from the one made"
    assert torch.equal(_logits(second, args), _logits(first, args)), "cached and traced programs give other outputs"
    difference = (_logits(second, args) - _logits(model, args)).abs().max().item()
    assert difference < 1e-4, f"max |tp - model| = {difference}, expected < 1e-4"
    assert sorted(p.name for p in source.iterdir()) == listing, "the checkpoint directory was written to"

    store = TraceCache(cache)
    config = AutoConfig.from_pretrained(source)
    config.use_cache = False
    with torch.device("meta"):  # as from_pretrained builds it
        meta = type(model)._from_config(config, dtype=torch.float32).eval()
    assert capture(meta, args, {"use_cache": False}, trace_cache=store).from_cache, "same model: expected a hit"
    config = copy.deepcopy(config)  # the meta model keeps its own
    config.rms_norm_eps = 1e-3
    with torch.device("meta"):
        other = type(model)._from_config(config, dtype=torch.float32).eval()
    assert not capture(other, args, {"use_cache": False}, trace_cache=store).from_cache, \
        "another rms_norm_eps (same shapes) must miss the cache"
    assert len(export_calls) == 2, f"expected 2 exports, got {export_calls}"

    data = bytearray(entries[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    entries[0].write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="ignoring the trace cache entry .*checksum"):
        again = capture(meta, args, {"use_cache": False}, trace_cache=store)
    assert not again.from_cache and len(export_calls) == 3, f"a corrupt entry must not be used: {export_calls}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten entry reads cleanly
        assert capture(meta, args, {"use_cache": False}, trace_cache=store).from_cache, "rewritten entry: expected a hit"


def test_cache_never_inside_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No process group: a cache directory inside the checkpoint directory is refused with a warning
    (the checkpoint is only read); $AUTOTP_CACHE=0 turns the default cache off, an explicit path stays on."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    with pytest.warns(UserWarning, match="inside the checkpoint directory"):
        assert open_trace_cache(checkpoint / "cache", checkpoint) is None
    assert list(checkpoint.iterdir()) == [], f"the checkpoint directory was written to: {list(checkpoint.iterdir())}"
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.setenv("AUTOTP_CACHE", "0")
    assert open_trace_cache(True, checkpoint) is None, "AUTOTP_CACHE=0 should turn the default cache off"
    explicit = open_trace_cache(tmp_path / "mine", checkpoint)
    assert explicit is not None and explicit.directory == tmp_path / "mine", f"got {explicit}"
    monkeypatch.setenv("AUTOTP_CACHE", "1")
    default = open_trace_cache(True, checkpoint)
    assert default is not None and default.directory == tmp_path / "env-cache", f"got {default}"


def test_put_writes_the_bytes_sent_to_the_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process (tp=1 view of rank 0's write): the bytes rank 0 made for its group are written as the
    cache entry without serializing the program again; bytes made for another key are not trusted."""
    import autotp.capture.trace_cache as trace_cache

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    exported = torch.export.export(model, (torch.randn(3, 4),))
    key, other = "a" * 64, "b" * 64
    sent = trace_cache.program_bytes(key, exported)
    serialized: list[str] = []
    original = trace_cache._entry
    monkeypatch.setattr(trace_cache, "_entry", lambda k, e: serialized.append(k) or original(k, e))
    cache = TraceCache(tmp_path)
    cache.put(key, exported, payload=sent)
    assert serialized == [], f"expected the sent bytes written as they are, but the program was serialized for {serialized}"
    assert cache.path(key).read_bytes().endswith(sent), "expected the cache file to end with the sent bytes"
    reread = cache.get(key, model, torch.device("cpu"))
    assert reread is not None, "expected the entry written from the sent bytes to read back"
    x = torch.randn(3, 4)
    torch.testing.assert_close(reread.module()(x), model(x), msg="expected the reread program to compute the model")
    cache.put(other, exported, payload=sent)  # bytes of another key: serialized again under its own key
    assert serialized == [other], f"expected one serialization for the other key, got {serialized}"
    assert cache.get(other, model, torch.device("cpu")) is not None, "expected the other key's entry to read back"


def test_an_untested_torch_turns_the_cache_and_the_shared_trace_off(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """No process group: the installed torch is one the private program form is tested on; with that list
    emptied of it (as on a newer torch), opening a cache warns and gives none, and a program cannot be made
    into bytes for a group (TypeError, which the shared trace answers by tracing on every rank)."""
    import autotp.capture.trace_cache as trace_cache
    from autotp.adapters import torch_internals

    assert trace_cache.serde_unsupported() is None, f"torch {torch.__version__}: {trace_cache.serde_unsupported()}"
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    exported = torch.export.export(model, (torch.randn(3, 4),))
    monkeypatch.setattr(torch_internals, "RELEASES", torch_internals.ReleaseRange("0.1.0", "0.1", "torch"))
    why = trace_cache.serde_unsupported()
    assert why is not None and f"torch {torch.__version__} is not one it is tested on (0.1.0 to 0.1)" in why, why
    with pytest.warns(UserWarning, match=r"tracing without the trace cache: torch .*install torch 0\.1\.0 to 0\.1 for the cache"):
        assert open_trace_cache(tmp_path / "cache") is None
    with pytest.raises(TypeError, match="cannot send a traced program: torch"):
        trace_cache.program_bytes("a" * 64, exported)
    assert not (tmp_path / "cache").exists(), "expected nothing written"


@pytest.mark.slow  # exports and plans both generation graphs: about 11 s on 2 cores
def test_generation_graphs_are_cached_too(tmp_path: Path, export_calls: list[str], plan_calls: list[int],
                                          one_rank: None) -> None:
    """tp=1, a four-layer tiny Llama from a checkpoint on meta, called as users call it (``from_pretrained``, then
    ``tp.generate``, which builds its graphs on the first call): the second load's ``generate`` traces and plans
    nothing (the phases' weighing reads each of its plans back), the cache holds one entry per graph (a prompt's
    first chunk and its later chunks have graphs, and keys, of their own), and both loads give HF's greedy tokens
    for a prompt long enough to need the later chunks' graph."""
    model, _, _ = tiny_llama(layers=4, hidden=HIDDEN, intermediate=128)
    model.save_pretrained(tmp_path / "hf")
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    cache = tmp_path / "cache"
    tokens, exports, plans, weighings = [], [], [], []
    for _ in range(2):
        before, planned = len(export_calls), len(plan_calls)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = autotp.from_pretrained(tmp_path / "hf", world_size=1, runtime=autotp.RuntimeOptions(trace_cache=cache))
            tokens.append(tp.generate(ids, max_new_tokens=4).tolist())
        exports.append(export_calls[before:])
        plans.append(plan_calls[planned:])
        weighings.append(str(tp.generation_on_demand.built.generation.weighting))
    assert len(exports[0]) == 4, f"the first load should trace the forward and three generation graphs: {exports[0]}"
    assert exports[1] == [], f"the second load should read every graph from the cache, it exported {exports[1]}"
    assert len(plans[0]) >= 4, f"the first load should plan the forward and the phases, it made {plans[0]}"
    assert plans[1] == [], f"the second load should read every plan from the cache, it made {plans[1]}"
    assert weighings[1] == weighings[0], f"the phases were weighed otherwise:\n{weighings[0]}\n{weighings[1]}"
    entries = sorted((cache / "traces").glob("*.pt2c"))
    assert len(entries) == len(exports[0]), f"expected one cache entry per traced graph ({exports[0]}), found {len(entries)}"
    assert tokens[0] == expected.tolist() and tokens[1] == expected.tolist(), (
        f"tokens differ from HF's greedy generate:\n expected {expected.tolist()}\n first load {tokens[0]}\n"
        f" second load {tokens[1]}")


def _narrow_nothing(graph):
    """A user's strategy filter: module-level, but outside autotp (the plan key cannot see its code)."""
    return graph


def test_plan_key_names_a_strategy_filter_only_by_autotp_code() -> None:
    """No process group: a plan is cached under options with autotp's own module-level filter (named, the same in
    every process, its code in the key), never under a user's function or a closure (no key: planned every time)."""
    from autotp.planning.options import PlanOptions
    from autotp.planning.phases import keep_whole
    from autotp.planning.plan_cache import plan_key

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    captured = capture(model, (torch.randn(3, 4),), dynamic=False)
    options = PlanOptions(world_size=2)
    plain, whole = plan_key(captured, options), plan_key(captured, dataclasses.replace(options, strategy_filter=keep_whole))
    assert plain is not None and whole is not None and plain != whole, f"expected two keys, got {plain} and {whole}"
    assert plan_key(captured, dataclasses.replace(options, strategy_filter=keep_whole)) == whole, "the key moved"
    assert plan_key(captured, dataclasses.replace(options, progress=True)) == plain, "progress changed the key"
    for narrow in (_narrow_nothing, lambda graph: graph):
        assert plan_key(captured, dataclasses.replace(options, strategy_filter=narrow)) is None, (
            f"a plan made under {narrow.__qualname__} must not be cached")


def test_plan_key_covers_the_rules_and_the_cost_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No process group: a plan's key changes with the code of ``autotp.passes`` (sharding rules, costing) and of
    ``autotp.cost_model`` (pricing), which a checkout keeps beside ``autotp/``, not inside it: a plan cached before
    a change to either is not read back after it."""
    import autotp.cost_model
    import autotp.passes
    from autotp.planning import plan_cache

    before = plan_cache._source_digest()
    for package in (autotp.passes, autotp.cost_model):
        folder = tmp_path / package.__name__
        folder.mkdir()
        (folder / "__init__.py").write_text("RULE = 1\n")
        monkeypatch.setattr(package, "__file__", str(folder / "__init__.py"))
        moved = plan_cache._source_digest()
        assert moved != before, f"{package.__name__}'s code is not in the plan key"
        (folder / "__init__.py").write_text("RULE = 2\n")
        assert plan_cache._source_digest() != moved, f"a change to {package.__name__} did not change the plan key"
        before = plan_cache._source_digest()


def test_a_sealed_plan_is_read_back_without_checking_it_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tp=2, no process group: a plan the cache stored is read back under its seal with the graph's nodes and
    fingerprint checked, not its strategies rebuilt; a plan edited in the cache (its seal no longer matches) or
    written unsealed is checked as a given ``plan=`` is, and an invalid one is refused and planned again."""
    import json

    from autotp.planning import checks
    from autotp.planning.options import PlanOptions
    from autotp.planning.plan_cache import cached_plan, plan_key, store_plan
    from autotp.planning.planner import plan_graph

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    captured = capture(model, (torch.randn(3, 4),), dynamic=False)
    options = PlanOptions(world_size=2, memory_budget=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_graph(captured, options)
    key, cache = plan_key(captured, options), TraceCache(tmp_path)
    store_plan(cache, key, plan)
    rebuilt = []
    real_build = checks.build_strategy_graph
    monkeypatch.setattr(checks, "build_strategy_graph", lambda *a, **k: rebuilt.append(1) or real_build(*a, **k))
    read = cached_plan(cache, key, captured, 2)
    assert read is not None and read.to_json() == plan.to_json() and rebuilt == [], (rebuilt, read)
    with pytest.raises(Exception, match="world_size"):  # the cheap check still runs
        read.check_matches(captured.graph_module, 4)
    assert cached_plan(cache, key, captured, 4) is None, "a sealed plan for another world size must not be used"
    stored = json.loads(cache.plan_path(key).read_text())
    edited = json.loads(stored["plan"])
    edited["nodes"][0]["output"] = "S(7)"  # a weight of two dims split on an eighth
    cache.plan_path(key).write_text(json.dumps({**stored, "plan": json.dumps(edited)}))
    with pytest.warns(UserWarning, match="ignoring the cached plan"):
        assert cached_plan(cache, key, captured, 2) is None
    assert rebuilt, "an edited plan is checked as a given plan= is"
    rebuilt.clear()
    cache.plan_path(key).write_text(plan.to_json())  # unsealed: a plan file written otherwise
    assert cached_plan(cache, key, captured, 2) is not None and rebuilt, "an unsealed plan is checked in full"
