"""The same file is read the same way by every command that takes it (issue 16): a lengths
file gives the same lengths to `plan --lengths`, `--workload` and `train --corpus`, and a
JSON Lines file of documents gives the same lengths as a corpus and as a lengths file."""

import json

import numpy as np
import pytest

from ballonet import cli, workloads
from ballonet.errors import InputError
from ballonet.training.data.corpus import ByteTokenizer, load_corpus

LENGTHS = [17, 5, 300, 42, 1, 64]


def _write(path, kind: str) -> str:
    if kind == "txt":
        path.write_text("\n".join(map(str, LENGTHS)) + "\n\n")
    elif kind == "json":
        path.write_text(json.dumps(LENGTHS))
    elif kind == "npy":
        np.save(path, np.asarray(LENGTHS, dtype=np.int32))
    else:
        path.write_text("".join(json.dumps({"length": n}) + "\n" for n in LENGTHS))
    return str(path)


@pytest.mark.parametrize("kind", ["txt", "json", "npy", "jsonl"])
def test_a_lengths_file_is_the_same_batch_everywhere(tmp_path, kind, capsys):
    path = _write(tmp_path / f"lens.{kind}", kind)
    assert workloads.load_lengths(path) == LENGTHS
    assert sorted(workloads.get(path).lengths) == sorted(LENGTHS)
    corpus = load_corpus(path, seed=3)
    assert corpus.lengths.tolist() == LENGTHS
    assert [len(corpus.tokens(d)) for d in range(corpus.num_docs)] == LENGTHS
    assert cli.main(["plan", "--lengths", path, "--cluster", "cpu", "--model", "tiny", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_documents"] == len(LENGTHS) and plan["num_tokens"] == sum(LENGTHS)


def test_a_jsonl_corpus_has_the_lengths_plan_reads(tmp_path):
    texts = ["héllo wörld", "x" * 40, "", "naïve café"]
    rows = [{"text": t} for t in texts] + [{"input_ids": [1, 2, 3]}, {"length": 9}]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = load_corpus(str(path))
    expected = [len(t.encode("utf-8")) for t in texts if t] + [3, 9]
    assert corpus.lengths.tolist() == expected
    assert ByteTokenizer().decode(corpus.tokens(0)) == texts[0]
    assert corpus.tokens(3).tolist() == [1, 2, 3]
    assert len(corpus.tokens(4)) == 9 and 0 <= corpus.tokens(4).min() and corpus.tokens(4).max() < 256
    with pytest.raises(InputError, match=r"docs.jsonl:3: length must be a positive integer, got 0"):
        workloads.load_lengths(str(path))  # a lengths file has no empty documents; a corpus skips them
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r != {"text": ""}))
    assert workloads.load_lengths(str(path)) == expected


def test_train_takes_a_text_lengths_file(tmp_path, monkeypatch, capsys):
    path = _write(tmp_path / "lens.txt", "txt")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--corpus", path, "--steps", "1", "--global-tokens", "256"]) == 0
    assert "step 1/1  elapsed" in capsys.readouterr().out


def test_a_text_file_of_prose_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("12\nOnce upon a time\n")
    with pytest.raises(InputError, match=r"notes.txt:2: length must be a positive integer, got 'Once upon a time'"):
        load_corpus(str(path))
