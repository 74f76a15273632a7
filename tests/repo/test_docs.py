"""The documentation stays true: every python block of the README and of docs/*.md runs, the
README's tastes are copies of the pages' blocks, the layout page matches the tree, and the family
table matches the registries.

A block runs in a fresh interpreter with the repository on ``PYTHONPATH``; a block whose text
appears more than once (the README's tastes are copies of blocks on the pages) runs once. A block
that cannot run alone (several processes, a GPU, the code around it) is a *fragment*: the line
before its fence is ``<!-- fragment: tests/<folder>/test_x.py ... -->``, naming the test that runs it.
"""
import ast
import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_BLOCK = re.compile(r"(<!-- fragment: ([^>]*?) -->\n)?```python\n(.*?)```", re.S)


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def blocks():
    """``[(page, index on the page, fragment test or None, text)]`` of every python block."""
    out = []
    for page in PAGES:
        for i, (_, fragment, text) in enumerate(_BLOCK.findall(_read(page))):
            out.append((page, i, fragment or None, text))
    return out


def runnable():
    """The distinct runnable blocks, each with the first place it appears."""
    seen = {}
    for page, i, fragment, text in blocks():
        if fragment is None and text not in seen:
            seen[text] = f"{page}#{i}"
    return [pytest.param(text, id=where) for text, where in seen.items()]


def test_every_page_has_its_blocks_found():
    """Every fence opening a python block is seen (a typo in the fence would hide a block)."""
    for page in PAGES:
        text = _read(page)
        assert text.count("```python\n") == len(_BLOCK.findall(text)), page
    assert any(p == "README.md" for p, *_ in blocks()) and len(runnable()) >= 10


@pytest.mark.parametrize("block", runnable())
def test_python_blocks_run(block):
    # A block runs as in a user's plain shell: no launcher variables left by earlier in-process tests
    # (a single-process initialize sets WORLD_SIZE=1, which DeviceMesh.from_sizes then checks against).
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("fragment", sorted({f for _, _, f, _ in blocks() if f}), ids=lambda f: f.split()[0])
def test_fragments_name_the_test_that_runs_them(fragment):
    """A fragment (not runnable alone) must say which test exercises it, and that test must exist."""
    path = fragment.split()[0]
    assert path.startswith("tests/") and os.path.isfile(os.path.join(ROOT, path)), fragment


def test_readme_tastes_are_copies_of_the_pages():
    """Each of the README's python blocks is a block of a docs page, so the manual holds every example."""
    pages = {text for page, _, _, text in blocks() if page != "README.md"}
    readme = [text for page, _, _, text in blocks() if page == "README.md"]
    assert len(readme) >= 5
    assert [t.splitlines()[0] for t in readme if t not in pages] == []


def test_readme_is_short():
    assert len(_read("README.md").splitlines()) <= 250


# ---- the layout page against the tree --------------------------------------------------------

_PACKAGE_ROOTS = ("twinkle_kernels", "twinkle_megatron", "patches")
_PATHLIKE = re.compile(r"^[A-Za-z0-9_.\-/]+$")


def _is_path(token):
    return bool(_PATHLIKE.match(token)) and (token.endswith("/") or re.search(r"\.(py|cpp|h|sh|md)$", token)
                                             is not None)


def layout_items(text):
    """``(path, [inline paths])`` of each bullet of the layout tree. A bullet that starts with a
    backticked path names that path, relative to its parent bullet's folder; the other backticked
    paths in its text are relative to its own folder (or to the repository root). Tokens holding a
    placeholder (``<op>/``) are skipped."""
    start = text.index("<!-- layout:")
    tree = text[start:text.index("<!-- /layout -->", start)].splitlines()[1:]
    items, stack = [], []   # stack: (indent, folder)
    current = None
    for line in tree:
        m = re.match(r"^( *)- (.*)$", line)
        if m:
            indent, body = len(m.group(1)), m.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            head = re.match(r"^`([^`]+)`", body)
            if head and _is_path(head.group(1)) or head and "<" in head.group(1):
                path = parent + head.group(1)
            else:
                path = parent
            folder = path if path.endswith("/") or path == "" else os.path.dirname(path) + "/"
            folder = "" if folder == "/" else folder
            current = [path, folder, body]
            items.append(current)
            stack.append((indent, folder))
        elif current is not None and line.strip():
            current[2] += " " + line.strip()
    out = []
    for path, folder, body in items:
        tokens = re.findall(r"`([^`]+)`", body)
        if tokens and body.startswith("`" + tokens[0] + "`"):
            tokens = tokens[1:]
        out.append((path, folder, [t for t in tokens if _is_path(t) and "<" not in t]))
    return out


def _package_dirs():
    found = set()
    for root in _PACKAGE_ROOTS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, root)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "/") + "/")
    return found


def family_table():
    """``[(model types, folder, patch families)]`` of docs/families.md's table."""
    text = _read("docs/families.md")
    start = text.index("<!-- families:")
    rows = [r for r in text[start:text.index("<!-- /families -->", start)].splitlines() if r.startswith("| ")][1:]
    out = []
    for r in rows:
        cells = r.split("|")
        out.append(tuple(re.findall(r"`([^`]+)`", cells[i]) for i in (2, 3, 4)))
    return out


def test_layout_names_only_what_exists():
    missing = []
    for path, folder, inline in layout_items(_read("docs/layout.md")):
        if "<" not in path and not os.path.exists(os.path.join(ROOT, path)):
            missing.append(path)
        # the files of the family folder placeholder are in every family folder
        folders = [folder.replace("<family>", f.rstrip("/")) for _, fs, _ in family_table() for f in fs] \
            if "<family>" in folder else [folder]
        for t in inline:
            if not all(os.path.exists(os.path.join(ROOT, f, t)) or os.path.exists(os.path.join(ROOT, t))
                       for f in folders):
                missing.append(f"{t} (under {path or 'the root'})")
    assert not missing, "docs/layout.md names paths that do not exist:\n" + "\n".join(missing)


def test_layout_describes_every_package_folder():
    described = {p for p, _, _ in layout_items(_read("docs/layout.md")) if p.endswith("/")}
    assert "twinkle_megatron/models/<family>/" in described
    families = {"twinkle_megatron/models/" + folder for _, folders, _ in family_table() for folder in folders}
    undescribed = sorted(_package_dirs() - described - families)
    assert not undescribed, ("package folders that docs/layout.md (or, for a model family, docs/families.md's "
                             "table) does not name:\n" + "\n".join(undescribed))


def test_layout_check_sees_a_missing_and_an_unlisted_folder():
    page = ("<!-- layout: x -->\n- `twinkle_kernels/` — ops\n    - `norm/` — `reference.py`, `no_such.py`\n"
            "    - `nope/` — gone\n<!-- /layout -->\n")
    items = layout_items(page)
    assert [p for p, _, _ in items] == ["twinkle_kernels/", "twinkle_kernels/norm/", "twinkle_kernels/nope/"]
    assert items[1][2] == ["reference.py", "no_such.py"]
    assert not os.path.exists(os.path.join(ROOT, "twinkle_kernels/nope/"))
    assert "twinkle_kernels/rope/" in _package_dirs() - {p for p, _, _ in items}


def test_family_table_matches_the_folders_and_the_patch_registry():
    """The table's folders are the family folders of twinkle_megatron/models/ and its patch column is
    twinkle_patches' family registry (read with ast: no transformers import); its model types are
    checked by tests/megatron/test_families.py."""
    rows = family_table()
    folders = sorted(f.rstrip("/") for _, fs, _ in rows for f in fs)
    base = os.path.join(ROOT, "twinkle_megatron", "models")
    assert folders == sorted(d for d in os.listdir(base) if os.path.isfile(os.path.join(base, d, "__init__.py")))
    tree = ast.parse(_read("patches/_specs.py"))
    registry = next(n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "FAMILIES")
    assert sorted(p for _, _, ps in rows for p in ps) == sorted(k.value for k in registry.value.keys)


def test_the_families_are_listed_in_one_place():
    """No other page (nor the README) enumerates the model types: they link to docs/families.md."""
    types = {t for ts, _, _ in family_table() for t in ts}
    for page in PAGES:
        if page == "docs/families.md":
            continue
        text = _read(page)
        named = {t for t in re.findall(r"`([a-z0-9_]+)`", text) if t in types}
        assert len(named) < len(types) // 2, f"{page} lists the families ({sorted(named)}); link docs/families.md"


def test_every_page_is_in_the_navigation():
    nav = _read("mkdocs.yml")
    for page in PAGES[1:]:
        name = page[len("docs/"):]
        assert re.search(rf":\s*{re.escape(name)}\s*$", nav, re.M), f"{page} is not in mkdocs.yml's nav"
