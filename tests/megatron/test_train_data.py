import json

import pytest
import torch

from twinkle_megatron.job import data as td


def test_tasks_are_correct_and_deterministic():
    texts = td.synthetic_texts(300, seed=3)
    assert texts == td.synthetic_texts(300, seed=3)
    assert texts != td.synthetic_texts(300, seed=4)
    for t in texts:
        if "+" in t:
            lhs, rhs = t.split("=")
            a, b = map(int, lhs.split("+"))
            assert a + b == int(rhs)
        elif t.startswith("sort "):
            xs, ys = t[5:].split(">")
            assert sorted(map(int, xs.split())) == list(map(int, ys.split()))
        else:
            s, tail = t.split("|")
            stack = []
            for c in s + tail:
                if c in td._BRACKETS:
                    stack.append(c)
                else:
                    assert td._BRACKETS[stack.pop()] == c
            assert not stack


def test_tokenizer_round_trip_and_specials():
    tok = td.ByteTokenizer()
    ids = tok.encode("héllo 1+2=3")
    assert ids[0] == td.BOS and ids[-1] == td.EOS and max(ids) < td.VOCAB_SIZE
    assert tok.decode(ids) == "héllo 1+2=3"


def test_pack_and_batches():
    rows = td.pack(td.synthetic_texts(100), 32)
    assert rows.dtype == torch.long and rows.shape[1] == 32
    b = next(td.batches(rows, 4))
    assert torch.equal(b["input_ids"], b["labels"])
    with pytest.raises(ValueError, match="seq_len"):
        td.pack(["a"], 1)


def test_read_jsonl_and_text(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"line {i}"}) for i in range(3)))
    assert td.read_texts(str(p)) == ["line 0", "line 1", "line 2"]
    q = tmp_path / "d.txt"
    q.write_text("a\n\nb\n")
    assert td.read_texts(str(q)) == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "x"}))
    with pytest.raises(ValueError, match="'text'"):
        td.read_texts(str(bad))
