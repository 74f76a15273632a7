"""The README's "Moving from upstream Twinkle" and docs/upstream.md say what the ports under
examples/upstream/ do: each import diff they show (```text blocks of ``-`` / ``+`` import lines),
applied name by name to upstream's cookbook files (the copies in tests/data/upstream_cookbook/),
binds every name the way the port binds it, and every ``+`` name exists here. The test files
docs/upstream.md names exist, and so do the tests it names (``file.py::test``)."""
import ast
import importlib
import os
import re

from conftest import ROOT

PORTS = {"tp.py": "megatron/tp.py", "tp_moe.py": "megatron/tp_moe.py", "dpo_multi_lora.py": "rl/dpo/dpo_multi_lora.py",
         "gkd_off_policy.py": "rl/gkd/gkd_off_policy.py", "grpo.py": "rl/grpo/grpo.py"}


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def bindings(source):
    """{name: {(module, attribute or None)}} of every import statement in ``source`` (nested too)."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                name = a.asname or a.name.split(".")[0]
                out.setdefault(name, set()).add((a.name if a.asname else a.name.split(".")[0], None))
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                out.setdefault(a.asname or a.name, set()).add((node.module, a.name))
    return out


def import_diffs(text):
    """``[(minus, plus)]``: the bindings of each ```text block whose lines are ``-``/``+`` imports."""
    out = []
    for block in re.findall(r"```text\n(.*?)```", text, re.S):
        lines = block.strip().splitlines()
        if not lines or not all(re.match(r"^[-+](import|from) ", ln) for ln in lines):
            continue
        minus = bindings("\n".join(ln[1:] for ln in lines if ln.startswith("-")))
        plus = bindings("\n".join(ln[1:] for ln in lines if ln.startswith("+")))
        out.append((minus, plus))
    return out


def _readme_section():
    text = _read("README.md")
    start = text.index("## Moving from upstream Twinkle")
    return text[start:text.index("\n## ", start + 1)]


def test_the_import_diffs_are_what_the_ports_do():
    diffs = {"README.md": import_diffs(_readme_section()), "docs/upstream.md": import_diffs(_read("docs/upstream.md"))}
    assert len(diffs["README.md"]) == 1 and len(diffs["docs/upstream.md"]) == 2, {k: len(v) for k, v in diffs.items()}
    applied = {}
    for page, page_diffs in diffs.items():
        for i, (minus, plus) in enumerate(page_diffs):
            for name, sources in minus.items():
                assert name in plus, f"{page} diff {i}: {name} is removed and not imported again"
            for port, original in PORTS.items():
                theirs = bindings(_read(f"tests/data/upstream_cookbook/{original}"))
                ours = bindings(_read(f"examples/upstream/{port}"))
                for name, sources in minus.items():
                    if not sources & theirs.get(name, set()):
                        continue      # upstream's file does not import it this way
                    assert ours.get(name) == plus[name], (page, i, port, name, ours.get(name), plus[name])
                    applied.setdefault((page, i), set()).add(port)
    # every diff is used by some port: the main one by all five, the sampler's by the two RL scripts
    assert applied[("README.md", 0)] == set(PORTS) and applied[("docs/upstream.md", 0)] == set(PORTS), applied
    assert applied[("docs/upstream.md", 1)] == {"gkd_off_policy.py", "grpo.py"}, applied


def test_every_name_the_diffs_import_exists():
    seen = 0
    for minus_plus in import_diffs(_readme_section()) + import_diffs(_read("docs/upstream.md")):
        for name, sources in minus_plus[1].items():
            for module, attribute in sources:
                if not module.startswith("twinkle_megatron"):
                    continue      # twinkle-kit's (get_logger): the upstream lane has it
                obj = importlib.import_module(module)
                if attribute is not None:
                    assert hasattr(obj, attribute), f"{module}.{attribute}"
                seen += 1
    assert seen >= 6


def test_the_tests_docs_upstream_names_exist():
    text = _read("docs/upstream.md")
    paths = set(re.findall(r"`?(tests/[\w/]+\.py)(?:::(\w+))?", text))
    assert len(paths) >= 8
    for path, test in paths:
        assert os.path.isfile(os.path.join(ROOT, path)), path
        if test:
            assert re.search(rf"^def {test}\(", _read(path), re.M), f"{path}::{test}"
