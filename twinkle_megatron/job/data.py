"""Data for the training job: a byte-level tokenizer and a procedurally generated task.

Nothing is downloaded and no third-party text ships with the repo. The default data set
is generated from a seed: lines of integer addition (``"417+96=513"``), list sorting
(``"sort 5 1 4>1 4 5"``) and bracket completion (``"([{<>}]"`` → its closing tail). A small
model learns the formats within a few dozen steps, so the loss visibly falls. Users can
pass a JSONL file (one ``{"text": ...}`` object per line) or a plain text file instead.

Token ids: bytes 0..255, then ``PAD=256``, ``BOS=257``, ``EOS=258``; ``VOCAB_SIZE = 259``.
"""
from __future__ import annotations

import json
import random
from typing import Dict, Iterator, List, Optional

import torch

PAD, BOS, EOS = 256, 257, 258
VOCAB_SIZE = 259


class ByteTokenizer:
    """UTF-8 bytes as token ids, with PAD/BOS/EOS above 255."""

    pad_token_id, bos_token_id, eos_token_id = PAD, BOS, EOS
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_special: bool = True) -> List[int]:
        ids = list(text.encode("utf-8"))
        return [BOS] + ids + [EOS] if add_special else ids

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


_BRACKETS = {"(": ")", "[": "]", "{": "}", "<": ">"}


def _addition(rng: random.Random) -> str:
    a, b = rng.randrange(1000), rng.randrange(1000)
    return f"{a}+{b}={a + b}"


def _sorting(rng: random.Random) -> str:
    xs = [rng.randrange(10) for _ in range(rng.randrange(3, 8))]
    return "sort " + " ".join(map(str, xs)) + ">" + " ".join(map(str, sorted(xs)))


def _brackets(rng: random.Random) -> str:
    stack, s = [], []
    for _ in range(rng.randrange(2, 9)):
        if stack and rng.random() < 0.4:
            s.append(_BRACKETS[stack.pop()])
        else:
            o = rng.choice(list(_BRACKETS))
            stack.append(o)
            s.append(o)
    return "".join(s) + "|" + "".join(_BRACKETS[o] for o in reversed(stack))


TASKS = {"addition": _addition, "sorting": _sorting, "brackets": _brackets}


def synthetic_texts(n: int, seed: int = 0, tasks=("addition", "sorting", "brackets")) -> List[str]:
    """``n`` task lines, deterministic in ``seed``."""
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; expected one of {sorted(TASKS)}")
    rng = random.Random(seed)
    return [TASKS[rng.choice(tasks)](rng) for _ in range(n)]


def read_texts(path: str) -> List[str]:
    """Lines of a .jsonl file (``{"text": ...}`` per line) or of a plain text file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                obj = json.loads(line)
                if "text" not in obj:
                    raise ValueError(f"{path}:{i + 1}: a JSONL line needs a 'text' field")
                out.append(str(obj["text"]))
            else:
                out.append(line)
    if not out:
        raise ValueError(f"{path} holds no text")
    return out


def pack(texts: List[str], seq_len: int, tokenizer: Optional[ByteTokenizer] = None) -> torch.Tensor:
    """Concatenate tokenised texts and cut into rows of ``seq_len`` tokens: ``[N, seq_len]`` int64."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    tok = tokenizer or ByteTokenizer()
    ids: List[int] = []
    for t in texts:
        ids.extend(tok.encode(t))
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"{len(ids)} tokens do not fill one row of seq_len={seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def batches(rows: torch.Tensor, batch_size: int, seed: int = 0) -> Iterator[Dict[str, torch.Tensor]]:
    """Endless shuffled batches ``{'input_ids', 'labels'}`` (labels = input_ids, HF convention:
    the model shifts them; PAD positions are -100)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(rows.shape[0], generator=g)
        for i in range(0, rows.shape[0] - batch_size + 1, batch_size):
            x = rows[perm[i:i + batch_size]]
            labels = x.clone()
            labels[x == PAD] = -100
            yield {"input_ids": x, "labels": labels}


def counting_batches(num_steps: int, global_batch: int, seq_len: int, vocab: int, dp_rank: int, dp_size: int,
                     seed: int = 0) -> Iterator[Dict[str, torch.Tensor]]:
    """This rank's share ``[global_batch // dp_size, seq_len]`` of each global batch of sequences that
    count upwards modulo ``vocab`` from a random start (learnable at once; the examples' smoke data)."""
    g = torch.Generator().manual_seed(seed)
    rows = global_batch // dp_size
    for _ in range(num_steps):
        start = torch.randint(0, vocab, (global_batch, 1), generator=g)
        ids = (start + torch.arange(seq_len)) % vocab
        mine = ids[dp_rank * rows:(dp_rank + 1) * rows]
        yield {"input_ids": mine, "labels": mine.clone()}
