"""twinkle_megatron.versions: the megatron-core releases the facade supports and how each API
difference is handled, checked against the installed release (the README's venv runs 0.16.1, the
second lane, .ci/mcore_latest, the newest 0.19.x)."""
import ast
import functools
import os

import pytest

from twinkle_megatron import versions

from conftest import ROOT

# Test files that import megatron-core or the facade but are not in the second lane, and why.
NOT_IN_LANE = {
    "tests/repo/test_structure.py": "reads the source with ast; nothing of megatron-core runs",
    "tests/benchmarks/test_benchmarks.py": "the benchmark harness; its one megatron case compares config dicts",
    "tests/benchmarks/test_gpu_check.py": "the GPU script's dry run, whose megatron step needs a GPU",
    "tests/repo/test_readme.py": "the README's two commands and the kernels' self-check",
    "tests/repo/test_docs.py": "runs the README's and the docs' blocks, which the README's venv (0.16.1) serves",
    "tests/npu/test_npu_platform_emulated.py": "the NPU start-up order (mindspeed, then hccl) on a simulated NPU; "
                                               "init_process_group is stubbed, so megatron-core's state is never built",
}


def test_every_change_names_what_the_installed_release_has():
    """Each change's names (the new form from its release on, the old form before) exist in the
    installed megatron-core: a shim pointed at a wrong or moved name fails here."""
    assert versions.missing() == []


def test_a_shim_pointed_at_a_wrong_name_fails():
    """Break the results-queue entry (the name the CPU mode patches) for the installed release:
    the canary reports it and the CPU mode refuses to patch, instead of a silent no-op setattr."""
    import dataclasses
    from twinkle_megatron.parallel import cpu_compat
    change = versions.CHANGES["write_results_queue"]
    field = "new" if change.active else "old"
    wrong = "megatron.core.dist_checkpointing.strategies.filesystem_async:no_such_queue"
    was_applied = cpu_compat.is_applied()
    cpu_compat.revert()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(versions.CHANGES, "write_results_queue", dataclasses.replace(change, **{field: (wrong,)}))
            assert ("write_results_queue", wrong) in versions.missing()
            assert "megatron.core.dist_checkpointing.strategies.filesystem_async.no_such_queue" in \
                cpu_compat.patched_symbols()
            with pytest.raises(AttributeError, match="no_such_queue"):
                cpu_compat.apply()
            assert not cpu_compat.is_applied()
        assert versions.missing() == []
    finally:
        if was_applied:
            cpu_compat.apply()


def test_release_order():
    assert versions._parse("0.19.2") == (0, 19, 2)
    assert versions._parse("0.18.0rc1") == (0, 18, 0)
    assert versions._parse("0.17.1+dev") == (0, 17, 1)
    assert versions.at_least("0.17", "0.17.0") and versions.at_least("0.17", "0.19.2")
    assert not versions.at_least("0.18", "0.17.1") and not versions.at_least("0.17", "0.16.1")
    assert versions.at_least(versions.OLDEST)
    assert not versions.at_least("0." + str(int(versions.NEWEST_MINOR.split(".")[1]) + 1))


def test_installed_release_is_admitted_by_the_extra():
    import tomllib
    from packaging.requirements import Requirement
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["megatron"]
    spec = Requirement(extra[0]).specifier
    assert versions.installed() in spec
    for v in (versions.OLDEST, versions.NEWEST_MINOR + ".0", versions.NEWEST_MINOR + ".2"):
        assert v in spec, (v, spec)


def test_spec_entries_in_either_form():
    """built_class / with_class / submodules_of read and rewrite a ModuleSpec, a partial of a class
    and a partial of a classmethod (megatron-core 0.18's MLP.as_mlp_submodule) alike."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    class Base:
        @classmethod
        def build(cls, submodules, **kw):
            return cls, submodules, kw

    class Sub(Base):
        pass

    marker = object()
    spec = ModuleSpec(module=Base, submodules=marker, params={"a": 1})
    out = versions.with_class(spec, Sub)
    assert versions.built_class(spec) is Base and versions.built_class(out) is Sub
    assert out.submodules is marker and out.params == {"a": 1} and spec.module is Base
    builder = functools.partial(Base.build, submodules=marker)
    out = versions.with_class(builder, Sub)
    assert versions.built_class(builder) is Base and versions.built_class(out) is Sub
    assert out(x=2) == (Sub, marker, {"x": 2}) and versions.submodules_of(out) is marker
    out = versions.with_class(functools.partial(Base, submodules=marker), Sub)
    assert out.func is Sub and versions.submodules_of(out) is marker
    assert versions.built_class(len) is None


def test_twinkle_spec_builds_twinkle_modules_on_this_release():
    """The local provider's experts entry and the dense MLP come out in the installed release's
    form, with the twinkle classes in them."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP
    from twinkle_megatron import spec
    from twinkle_megatron.layers import mlp
    local, twinkle = spec.LocalSpecProvider(), spec.TwinkleSpecProvider()
    experts = local.grouped_mlp_modules(False)
    if versions.CHANGES["experts_builder"].active:
        assert isinstance(experts, functools.partial)
        assert versions.built_class(experts) is SequentialMLP
        assert versions.built_class(twinkle.grouped_mlp_modules(False)) is mlp.grouped_mlp_class()
    else:
        assert experts[0] is SequentialMLP
        assert twinkle.grouped_mlp_modules(False, False)[0] is mlp.grouped_mlp_class()
    layer = spec.attention_layer_spec(twinkle, qk_norm=True)
    assert versions.built_class(layer.submodules.mlp) is mlp.mlp_class()
    assert issubclass(mlp.mlp_class(), MLP)
    assert isinstance(layer.submodules.mlp, functools.partial) == versions.CHANGES["mlp_builder"].active


def _imports_megatron(path: str) -> bool:
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        if any(n.split(".")[0] in ("megatron", "twinkle_megatron") for n in names):
            return True
    return False


def test_second_lane_runs_every_megatron_test():
    with open(os.path.join(ROOT, ".ci", "megatron_tests")) as f:
        listed = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    for path in listed:
        assert os.path.isfile(os.path.join(ROOT, path)), f".ci/megatron_tests names a missing file {path}"
    assert not listed & set(NOT_IN_LANE)
    unlisted = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "tests")):   # tests/<package>/test_*.py
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, name), ROOT).replace(os.sep, "/")
            if name.startswith("test_") and name.endswith(".py") and rel not in listed and rel not in NOT_IN_LANE \
                    and _imports_megatron(os.path.join(ROOT, rel)):
                unlisted.append(rel)
    assert not unlisted, f"these tests touch megatron-core but are not in .ci/megatron_tests: {unlisted}"
