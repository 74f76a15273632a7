"""twinkle_kernels.patching: the one swap-and-undo mechanism every patcher records in."""
import sys
import types

import pytest

from twinkle_kernels.patching import Patcher, aliases


def _fn():
    return "original"


def _new():
    return "new"


@pytest.fixture
def modules(monkeypatch):
    """A defining module, a user that imported the function by name and one that renamed it."""
    home = types.ModuleType("tw_patching_home")
    user = types.ModuleType("tw_patching_home.user")
    renamed = types.ModuleType("tw_patching_other")
    home.f, user.f, renamed.g = _fn, _fn, _fn
    for m in (home, user, renamed):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    return home, user, renamed


def test_aliases_by_name_by_identity_and_by_package(modules):
    home, user, renamed = modules
    assert aliases(_fn, name="f", home=home) == [(home, "f"), (user, "f")]
    assert set(aliases(_fn)) >= {(home, "f"), (user, "f"), (renamed, "g")}
    assert set(aliases(_fn, package="tw_patching_home")) == {(home, "f"), (user, "f")}
    assert aliases(_new, name="f") == []


def test_replace_everywhere_then_undo_restores_late_aliases_too(modules):
    home, user, renamed = modules
    p = Patcher()
    found = p.replace_everywhere(_fn, _new, name="f", home=home)
    assert found == [(home, "f"), (user, "f")]
    assert home.f is _new and user.f is _new and renamed.g is _fn   # another name: left alone
    late = types.ModuleType("tw_patching_late")
    late.f = home.f                      # imported while patched
    sys.modules[late.__name__] = late
    try:
        assert p and len(p) == 2
        p.undo()
        assert home.f is _fn and user.f is _fn and late.f is _fn
        assert not p
        p.undo()                         # nothing left: a no-op
    finally:
        del sys.modules[late.__name__]


def test_undo_removes_attributes_and_keys_that_did_not_exist():
    owner = types.SimpleNamespace(a=1)
    registry = {"sdpa": "theirs"}
    p = Patcher()
    p.setattr(owner, "a", 2)
    p.setattr(owner, "b", 3)
    p.setitem(registry, "sdpa", "ours")
    p.setitem(registry, "twinkle", "ours")
    assert (owner.a, owner.b, registry) == (2, 3, {"sdpa": "ours", "twinkle": "ours"})
    p.undo()
    assert vars(owner) == {"a": 1} and registry == {"sdpa": "theirs"}


def test_inherited_attribute_is_deleted_not_copied_onto_the_subclass():
    class Base:
        def forward(self):
            return "base"

    class Child(Base):
        pass

    p = Patcher()
    p.setattr(Child, "forward", lambda self: "patched")
    assert Child().forward() == "patched"
    p.undo()
    assert "forward" not in vars(Child) and Child().forward() == "base"


def test_undo_in_reverse_order_and_only_if_unchanged(modules):
    home, user, _ = modules
    p = Patcher()
    p.setattr(home, "f", _new)
    p.setattr(home, "f", lambda: "second")
    p.undo()
    assert home.f is _fn                 # newest first: back to the very first value

    q = Patcher()
    q.replace_everywhere(_fn, _new, name="f", home=home)
    other = lambda: "another library"    # noqa: E731
    home.f = other                       # patched on top of ours
    q.undo(only_if_unchanged=True)
    assert home.f is other and user.f is _fn


def _imports(path):
    import ast
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add("." * node.level + node.module)
        elif isinstance(node, ast.ImportFrom):  # from . import x
            out.update("." * node.level + a.name for a in node.names)
    return out


def test_the_patching_core_and_the_backend_probes_are_leaves():
    """Every layer imports these two, so they import nothing of the project (the probes load a
    backend's own package, and the C++ extension loader, only when asked)."""
    import os
    import twinkle_kernels
    root = os.path.dirname(twinkle_kernels.__file__)
    assert _imports(os.path.join(root, "patching.py")) <= {"__future__", "sys", "dataclasses", "types", "typing"}
    assert _imports(os.path.join(root, "_backends.py")) <= {"__future__", "importlib.util", "os", "typing", "torch",
                                                           "torch_npu", "triton", "._cpu_ext"}
