"""`ballonet prepare` and prepared corpora.

Reference: the `tokenizers` library encoding each document on its own (`Tokenizer.encode`),
and Python's own UTF-8 bytes; the tokenizer is a small BPE trained here on a few of the
Python standard library's modules (nothing downloaded).
"""

import dataclasses
import json

import numpy as np
import pytest

from ballonet.cli import main
from ballonet.errors import InputError
from ballonet.plan import Plan, Ring, Segment
from ballonet.training.data.corpus import from_prepared, load_corpus
from ballonet.training.data.loader import CONTENT_SAMPLE, IGNORE_INDEX, BalancedLoader
from ballonet.training.data.prepare import PrepareConfig, prepare

tokenizers = pytest.importorskip("tokenizers")
from tests.text_sources import texts, train_tokenizer, write_sources  # noqa: E402 - after the skip: needs tokenizers


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def folder_order(docs: list[str]) -> list[str]:
    """Document order of the folder source: sorted by relative path, empty files skipped."""
    named = sorted((f"sub{i % 2}/{i:03d}.txt", t) for i, t in enumerate(docs))
    return [t for _, t in named]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "folder"])
def test_prepared_tokens_match_the_tokenizer_document_by_document(tmp_path, tokenizer_dir, kind):
    source = write_sources(tmp_path)[kind]
    out = tmp_path / "out"
    prepare(PrepareConfig(data=str(source), out=str(out), tokenizer=str(tokenizer_dir), text_column="body",
                          batch_size=4, shard_tokens=3000))
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    docs = folder_order(texts()) if kind == "folder" else texts()
    expected = [tok.encode(t).ids for t in docs if t]
    corpus = load_corpus(str(out))
    assert corpus.num_docs == len(expected) and corpus.vocab_size == 600
    assert [corpus.tokens(d).tolist() for d in range(corpus.num_docs)] == expected
    assert corpus.lengths.tolist() == [len(e) for e in expected]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) > 1 and manifest["dtype"] == "uint16"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "index.npy", "tokenizer.json"] + [s["file"] for s in manifest["shards"]])
    name = {"jsonl": "docs.jsonl:1", "parquet": "docs.parquet:0", "folder": "sub0/000.txt"}[kind]  # line, row, file
    assert corpus.names[0].endswith(name)


def test_byte_tokenizer_is_the_default_and_ranges_read_slices(tmp_path):
    source = write_sources(tmp_path)["jsonl"]
    prepare(PrepareConfig(data=str(source), out=str(tmp_path / "out"), text_column="body"))
    corpus = from_prepared(tmp_path / "out")
    expected = [list(t.encode()) for t in texts() if t]
    assert [corpus.tokens(d).tolist() for d in range(corpus.num_docs)] == expected
    assert corpus.tokens_range(2, 5, 17).tolist() == expected[2][5:17] and corpus.vocab_size == 256
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["dtype"] == "uint8"


def counting(corpus):
    """The corpus with its whole-document reads forbidden and its range reads counted."""
    counts = {"tokens": 0}

    def read_range(doc, start, end):
        counts["tokens"] += end - start
        return corpus.read_range(doc, start, end)

    def read(doc):
        raise AssertionError("the loader read a whole document")

    return dataclasses.replace(corpus, read=read, read_range=read_range), counts


def split_first_plan(lengths):
    """Document 0 zig-zag over both ranks, the others alternately whole."""
    ring = Ring(doc=0, kind="intra", ranks=(0, 1), bounds=tuple(round(lengths[0] * i / 4) for i in range(5)))
    rest = [[], []]
    for d in range(1, len(lengths)):
        rest[d % 2].append(Segment(d, 0, lengths[d]))
    return Plan(planner="hand", lengths=lengths, node_of_rank=(0, 0), nic_of_rank=(0, 1),
                attention=(ring.chunks_of(0) + tuple(rest[0]), ring.chunks_of(1) + tuple(rest[1])),
                rings=(ring,)).validate()


def test_each_rank_reads_only_its_own_tokens(tmp_path, tokenizer_dir):
    """Its own tokens, the one token after each run (its last label), and the data check's
    sample of its successor's share (`loader.CONTENT_SAMPLE` tokens), nothing else."""
    source = write_sources(tmp_path)["jsonl"]
    prepare(PrepareConfig(data=str(source), out=str(tmp_path / "out"), tokenizer=str(tokenizer_dir),
                          text_column="body", shard_tokens=2000))
    corpus = from_prepared(tmp_path / "out")
    whole = [corpus.tokens(d).tolist() for d in range(corpus.num_docs)]
    for layout in ("attention", "linear"):
        seen = []
        for rank in (0, 1):
            counted, counts = counting(corpus)
            loader = BalancedLoader(counted, global_tokens=1500, plan_fn=split_first_plan, rank=rank, world_size=2,
                                    max_doc_tokens=700, seed=3, max_epochs=1, layout=layout)
            batches = list(loader)
            expected_reads = 0
            for view in batches:
                held, piece = view.token_index.tolist(), view.doc_ids.tolist()
                expected_reads += len(held)
                batch_ids, batch_labels = [], []
                for _, doc, start, end in view.pieces:
                    ids = whole[doc]
                    batch_ids += ids[start:end]
                    batch_labels += ids[start + 1: end + 1] + ([IGNORE_INDEX] if end == len(ids) else [])
                assert view.input_ids.tolist() == [batch_ids[i] for i in held]
                assert view.labels.tolist() == [batch_labels[i] for i in held]
                # one token past each run of held tokens of a piece, for its last label, unless the document ends
                runs_ends = [i for n, i in enumerate(held)
                             if n + 1 == len(held) or held[n + 1] != i + 1 or piece[n + 1] != piece[n]]
                expected_reads += sum(batch_labels[i] != IGNORE_INDEX for i in runs_ends)
                # and the data check's sample of the successor's share (`loader.sample_offsets`)
                successor = (view.plan.attention_token_counts if layout == "attention"
                             else view.plan.linear_token_counts)[1 - rank]
                expected_reads += min(CONTENT_SAMPLE, successor)
            assert counts["tokens"] == expected_reads, (layout, rank)
            seen.append(counts["tokens"])
        assert sum(seen) < 1.05 * corpus.num_tokens + 2 * CONTENT_SAMPLE * len(batches)


def run_cli(capsys, *argv):
    code = main(["prepare", *map(str, argv)])
    err = capsys.readouterr().err.strip()
    return code, err


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, tokenizer_dir, capsys):
    sources = write_sources(tmp_path)
    (tmp_path / "no_tokenizer").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    (tmp_path / "bad_tok.json").write_text('{"nope": 1}')
    (tmp_path / "exists").mkdir()
    cases = [
        (["--data", sources["jsonl"], "--tokenizer", tmp_path / "no_tokenizer"], "no_tokenizer: no tokenizer.json"),
        (["--data", sources["parquet"], "--tokenizer", tokenizer_dir], "docs.parquet: no column 'text'"),
        (["--data", tmp_path / "bad.jsonl"], "bad.jsonl:2: not JSON Lines"),
        (["--data", sources["jsonl"]], "docs.jsonl:1: expected an object with 'text'"),
        (["--data", sources["jsonl"], "--tokenizer", tmp_path / "bad_tok.json", "--text-column", "body"],
         "bad_tok.json: not a Hugging Face tokenizer"),
        (["--data", tmp_path / "missing.jsonl"], "missing.jsonl"),
        (["--data", sources["jsonl"], "--text-column", "body", "--out", tmp_path / "exists"], "already exists"),
        (["--data", sources["jsonl"], "--text-column", "body", "--out", tmp_path / "no" / "such" / "out"],
         "does not exist"),
    ]
    for argv, message in cases:
        if "--out" not in argv:
            argv = argv + ["--out", tmp_path / "out"]
        code, err = run_cli(capsys, *argv, "--json")
        assert code == 2 and message in err and "\n" not in err, (argv, err)
        assert not (tmp_path / "out").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary folder was left"


def test_parquet_row_group_over_the_limit_is_refused_before_it_is_read(tmp_path, capsys, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ballonet.training.data import prepare as module
    bomb = tmp_path / "bomb.parquet"  # 4 MB of text in a few KB
    pq.write_table(pa.table({"text": ["a" * (1 << 20)] * 4}), bomb, compression="zstd", use_dictionary=False)
    assert bomb.stat().st_size < 64 << 10
    monkeypatch.setattr(module, "MAX_ROW_GROUP", 2 << 20)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", lambda *a, **k: pytest.fail("read before the check"))
    code, err = run_cli(capsys, "--data", bomb, "--out", tmp_path / "out")
    assert code == 2 and "bomb.parquet: row group 0 holds 4 MiB of text uncompressed, over 2 MiB" in err and "smaller row groups" in err, err
    assert not (tmp_path / "out").exists()


def test_interrupted_prepare_leaves_nothing(tmp_path):
    source = write_sources(tmp_path)["folder"]

    def interrupt(nbytes):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareConfig(data=str(source), out=str(tmp_path / "out"), batch_size=2), progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "docs.parquet", "folder"]


def test_corrupt_prepared_corpus_is_refused(tmp_path):
    source = write_sources(tmp_path)["jsonl"]
    out = tmp_path / "out"
    prepare(PrepareConfig(data=str(source), out=str(out), text_column="body"))
    shard = out / "tokens-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(InputError, match="tokens-00000.bin: .* corrupt"):
        load_corpus(str(out))
    (out / "manifest.json").write_text('{"format": "something else"}')
    with pytest.raises(InputError, match="manifest.json: not a prepared corpus"):
        load_corpus(str(out))


def test_prepared_corpus_trains_from_the_cli(tmp_path, capsys):
    source = write_sources(tmp_path)["jsonl"]
    assert main(["prepare", "--data", str(source), "--text-column", "body", "--out", str(tmp_path / "out")]) == 0
    assert "documents" in capsys.readouterr().out
    assert main(["train", "--corpus", str(tmp_path / "out"), "--steps", "2", "--global-tokens", "512"]) == 0
    assert np.isfinite([float(x.split()[0]) for x in capsys.readouterr().out.split("loss ")[1:]]).all()
