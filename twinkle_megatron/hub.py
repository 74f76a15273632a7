"""``model_id`` resolution for :class:`~twinkle_megatron.MegatronModel`, offline.

``hf://org/name[@revision]`` is looked up in the local Hugging Face hub cache and
``ms://org/name`` in the ModelScope cache; anything else is a local path. Nothing is downloaded
(fetch the model first with ``huggingface-cli download`` / ``modelscope download``). The
environment variables are read on every call:

- Hugging Face: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``$XDG_CACHE_HOME/huggingface/hub`` (default ``~/.cache``); layout
  ``models--org--name/snapshots/<commit>/`` with ``refs/<revision>`` naming the commit
  (``main`` unless ``@revision`` is given; a commit hash may be given directly).
- ModelScope: ``$MODELSCOPE_CACHE``, else ``~/.cache/modelscope/hub``; layouts
  ``<root>/models/org/name``, ``<root>/org/name`` (also with ``.`` in the name written ``___``,
  as ModelScope stores it).
"""
from __future__ import annotations

import os
from typing import List, Tuple


def resolve_model_id(model_id) -> str:
    """A local directory for ``model_id`` (a path, ``hf://org/name[@rev]`` or ``ms://org/name``).
    Raises FileNotFoundError naming the id and every path tried."""
    text = os.fspath(model_id)
    if text.startswith("hf://"):
        candidates = _hf_candidates(text[len("hf://"):])
    elif text.startswith("ms://"):
        candidates = _ms_candidates(text[len("ms://"):])
    else:
        return text
    for path in candidates:
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
    tried = "\n  ".join(candidates) or "(no cache directory)"
    raise FileNotFoundError(f"model_id={text!r}: not found in the local cache (offline: nothing is "
                            f"downloaded). Tried:\n  {tried}")


def _split(repo: str) -> Tuple[str, str]:
    name, _, revision = repo.partition("@")
    if name.count("/") != 1 or not all(name.split("/")):
        raise ValueError(f"model_id must be 'org/name' after the scheme, got {repo!r}")
    return name, revision


def _hf_candidates(repo: str) -> List[str]:
    name, revision = _split(repo)
    if os.environ.get("HF_HUB_CACHE"):
        root = os.environ["HF_HUB_CACHE"]
    elif os.environ.get("HF_HOME"):
        root = os.path.join(os.environ["HF_HOME"], "hub")
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "huggingface", "hub")
    base = os.path.join(root, "models--" + name.replace("/", "--"))
    snapshots = os.path.join(base, "snapshots")
    ref = os.path.join(base, "refs", revision or "main")
    out = []
    if os.path.isfile(ref):
        with open(ref) as f:
            out.append(os.path.join(snapshots, f.read().strip()))
    else:
        out.append(ref + " (missing)")
    if revision:
        out.append(os.path.join(snapshots, revision))   # a commit hash given directly
    elif os.path.isdir(snapshots):
        # no refs/main (e.g. a copied cache): the most recent snapshot
        found = sorted(os.listdir(snapshots), key=lambda d: os.path.getmtime(os.path.join(snapshots, d)))
        out.extend(os.path.join(snapshots, d) for d in reversed(found))
    else:
        out.append(snapshots + " (missing)")
    return out


def _ms_candidates(repo: str) -> List[str]:
    name, _ = _split(repo)
    root = os.environ.get("MODELSCOPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                               "modelscope", "hub")
    org, model = name.split("/")
    out = []
    for m in dict.fromkeys((model, model.replace(".", "___"))):
        out += [os.path.join(root, "models", org, m), os.path.join(root, org, m)]
    return out
