import json
import sysconfig
import threading
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from ballonet.errors import InputError
from ballonet.plan import Plan, Ring, Segment
from ballonet.training.data.corpus import (
    ByteTokenizer,
    from_jsonl,
    from_lengths,
    from_text_dir,
    load_corpus,
)
from ballonet.training.data.loader import IGNORE_INDEX, BalancedLoader, Piece
from tests.training_reference import loader, round_robin


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def ids_corpus(tmp_path, docs):
    return from_jsonl(write_jsonl(tmp_path / "c.jsonl", [{"input_ids": d} for d in docs]))


def reference_stream(corpus, pieces):
    """Tokens and next-token labels of the pieces, from the corpus documents directly."""
    tokens, labels = [], []
    for _, doc, start, end in pieces:
        ids = corpus.read(doc).tolist()
        for i in range(start, end):
            tokens.append(ids[i])
            labels.append(ids[i + 1] if i + 1 < len(ids) else IGNORE_INDEX)
    return tokens, labels


# ---- tokenizer and sources -----------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("aé✓")
    assert ids.tolist() == [97, 0xC3, 0xA9, 0xE2, 0x9C, 0x93] and tok.vocab_size == 256
    assert tok.decode(ids) == "aé✓"
    with pytest.raises(ValueError):
        tok.decode([256])


def test_jsonl_text_and_input_ids(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "hi"}\n\n{"input_ids": [7, 300, 2]}\n{"text": ""}\n{"text": "é"}\n')
    corpus = from_jsonl(path)
    assert corpus.num_docs == 3 and corpus.lengths.tolist() == [2, 3, 2]
    assert [corpus.read(d).tolist() for d in range(3)] == [[104, 105], [7, 300, 2], [0xC3, 0xA9]]
    assert corpus.names == (f"{path}:1", f"{path}:3", f"{path}:5")
    assert corpus.vocab_size == 301


def test_text_dir_sorted_bytes(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"xyz")
    (tmp_path / "a.txt").write_text("ab")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".hidden").write_text("no")
    corpus = from_text_dir(tmp_path)
    assert corpus.names == ("a.txt", "b/z.txt")
    assert [corpus.read(d).tolist() for d in range(2)] == [[97, 98], [120, 121, 122]]


def test_synthetic_lengths_are_seeded():
    a, b, c = from_lengths([5, 1, 300], seed=1), from_lengths([5, 1, 300], seed=1), from_lengths([5, 1, 300], seed=2)
    assert a.lengths.tolist() == [5, 1, 300]
    assert all(np.array_equal(a.read(d), b.read(d)) for d in range(3))
    assert not np.array_equal(a.read(2), c.read(2))
    assert 0 <= a.read(2).min() and a.read(2).max() < 256


def test_load_corpus_dispatch(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "f.txt").write_text("hello")
    (tmp_path / "lengths.json").write_text("[3, 4]")
    write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}])
    assert load_corpus(str(tmp_path / "dir")).lengths.tolist() == [5]
    assert load_corpus(str(tmp_path / "lengths.json")).lengths.tolist() == [3, 4]
    assert load_corpus(str(tmp_path / "d.jsonl")).read(0).tolist() == [97, 98, 99]


def test_stdlib_corpus_is_real_and_long_tailed():
    corpus = load_corpus("stdlib")
    lengths = corpus.lengths
    assert corpus.num_docs > 200 and lengths.max() > 20 * np.median(lengths)
    assert list(corpus.names) == sorted(corpus.names) and all(n.endswith(".py") for n in corpus.names)
    doc = corpus.names.index("os.py")
    expected = (Path(sysconfig.get_paths()["stdlib"]) / "os.py").read_text(encoding="utf-8")
    assert ByteTokenizer().decode(corpus.tokens(doc)) == expected


# ---- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize("content, where", [
    ("", "empty corpus"),
    ('{"text": ""}\n', "empty corpus"),
    ('{"text": "ok"}\nhello world\n', ":2: not JSON Lines"),
    ('["text"]\n', ':1: expected an object with "text"'),
    ('{"input_ids": [1, -2]}\n', ":1: input_ids must be"),
])
def test_bad_jsonl_is_one_line_naming_the_line(tmp_path, content, where):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(InputError) as err:
        load_corpus(str(path))
    assert where in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_other_bad_input(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "zero.json").write_text("[3, 0]")
    for spec in (tmp_path / "empty", tmp_path / "missing.jsonl", tmp_path / "zero.json"):
        with pytest.raises(InputError):
            load_corpus(str(spec))
    with pytest.raises(InputError, match="smaller than one token per rank"):
        loader(from_lengths([10]), world_size=4, global_tokens=3)


# ---- batches and labels --------------------------------------------------------------


def test_labels_and_positions_hand_computed(tmp_path):
    corpus = ids_corpus(tmp_path, [[10, 11, 12], [20, 21], [30, 31, 32, 33]])
    batches = list(loader(corpus, global_tokens=4, shuffle=False, max_epochs=1))
    assert [b.pieces for b in batches] == [
        (Piece(0, 0, 0, 3), Piece(0, 1, 0, 1)), (Piece(0, 1, 1, 2), Piece(0, 2, 0, 3)), (Piece(0, 2, 3, 4),)]
    assert [b.input_ids.tolist() for b in batches] == [[10, 11, 12, 20], [21, 30, 31, 32], [33]]
    # the split document's label runs on into the next batch; a document's last token has none
    assert [b.labels.tolist() for b in batches] == [[11, 12, -100, 21], [-100, 31, 32, 33], [-100]]
    assert [b.position_ids.tolist() for b in batches] == [[0, 1, 2, 0], [0, 0, 1, 2], [0]]
    assert [b.num_valid_tokens_global for b in batches] == [3, 3, 0]
    assert batches[1].loss_mask.tolist() == [False, True, True, True]


def test_context_window_cuts(tmp_path):
    corpus = ids_corpus(tmp_path, [list(range(10))])
    batches = list(loader(corpus, global_tokens=6, max_doc_tokens=4, max_epochs=1))
    assert [[(p.start, p.end) for p in b.pieces] for b in batches] == [[(0, 4), (4, 6)], [(6, 8), (8, 10)]]
    # without a context window, only the budget cuts a document
    uncut = list(loader(ids_corpus(tmp_path, [[1, 2], list(range(10))]), global_tokens=4, shuffle=False, max_epochs=1))
    assert [[(p.doc, p.start, p.end) for p in b.pieces] for b in uncut] == [[(0, 0, 2), (1, 0, 2)], [(1, 2, 6)],
                                                                            [(1, 6, 10)]]
    assert batches[0].labels.tolist() == [1, 2, 3, 4, 5, 6]
    assert batches[1].position_ids.tolist() == [0, 1, 0, 1]


def test_labels_of_a_document_split_over_two_ranks(tmp_path):
    corpus = ids_corpus(tmp_path, [list(range(100, 108)), [200, 201]])
    ring = Ring(doc=0, kind="intra", ranks=(0, 1), bounds=(0, 2, 4, 6, 8))

    def plan_fn(lengths):
        assert lengths == (8, 2)
        attention = (ring.chunks_of(0), ring.chunks_of(1) + (Segment(1, 0, 2),))
        return Plan(planner="hand", lengths=lengths, node_of_rank=(0, 0), nic_of_rank=(0, 1),
                    attention=attention, rings=(ring,)).validate()

    r0, r1 = (next(iter(BalancedLoader(corpus, global_tokens=10, plan_fn=plan_fn, rank=r, world_size=2,
                                       shuffle=False))) for r in (0, 1))
    assert r0.input_ids.tolist() == [100, 101, 106, 107] and r0.labels.tolist() == [101, 102, 107, -100]
    assert r0.position_ids.tolist() == [0, 1, 6, 7] and r0.token_index.tolist() == [0, 1, 6, 7]
    assert r1.input_ids.tolist() == [102, 103, 104, 105, 200, 201]
    assert r1.labels.tolist() == [103, 104, 105, 106, 201, -100] and r1.doc_ids.tolist() == [0, 0, 0, 0, 1, 1]
    assert r0.num_valid_tokens_global == r1.num_valid_tokens_global == 8


def test_global_batches_do_not_depend_on_world_size():
    lengths = np.random.default_rng(0).lognormal(4, 1.2, 200).astype(int) + 1
    corpus = from_lengths(lengths, seed=5)
    seen = {}
    for world in (1, 2, 4):
        ranks = [list(islice(loader(corpus, world, r, global_tokens=997, seed=3), 6)) for r in range(world)]
        seen[world] = [b.pieces for b in ranks[0]]
        for step, pieces in enumerate(seen[world]):
            tokens, labels = reference_stream(corpus, pieces)
            assert sum(p.end - p.start for p in pieces) == 997
            got = {}
            for r in range(world):
                b = ranks[r][step]
                for i, t, y in zip(b.token_index.tolist(), b.input_ids.tolist(), b.labels.tolist()):
                    got[i] = (t, y)
            assert [got[i] for i in range(997)] == list(zip(tokens, labels))
    assert seen[1] == seen[2] == seen[4]


def test_one_epoch_each_token_once_then_reshuffled():
    corpus = from_lengths([7, 130, 1, 55, 300, 12, 90, 3], seed=1)
    batches = list(loader(corpus, global_tokens=37, max_doc_tokens=50, max_epochs=2, seed=9))
    sizes = [len(b.input_ids) for b in batches]
    assert sizes[:-1] == [37] * (len(sizes) - 1) and sum(sizes) == 2 * corpus.num_tokens
    ledger = [p for b in batches for p in b.pieces]
    assert all(p.end - p.start <= 50 for p in ledger)
    for epoch in (0, 1):
        for doc, length in enumerate(corpus.lengths.tolist()):
            spans = sorted((p.start, p.end) for p in ledger if (p.epoch, p.doc) == (epoch, doc))
            assert spans[0][0] == 0 and spans[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    orders = [[p.doc for p in ledger if p.epoch == e and p.start == 0] for e in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(8)) and orders[0] != orders[1]


def test_exact_resume_even_on_another_world_size():
    corpus = from_lengths(np.random.default_rng(1).integers(1, 400, 60), seed=2)
    straight = list(islice(loader(corpus, 2, 1, global_tokens=500, max_doc_tokens=128, seed=4), 10))
    first = loader(corpus, 2, 1, global_tokens=500, max_doc_tokens=128, seed=4)
    head = list(islice(first, 5))
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader(corpus, 4, 3, global_tokens=500, max_doc_tokens=128, seed=4, prefetch=False)
    resumed.load_state_dict(state)
    tail = list(islice(resumed, 5))
    assert [b.pieces for b in head + tail] == [b.pieces for b in straight]
    assert all(a.batch.tokens.equal(b.batch.tokens) and a.batch.labels.equal(b.batch.labels)
               for a, b in zip(head + tail, straight))
    ledger = [p for b in head + tail for p in b.pieces]
    assert len(set(ledger)) == len(ledger)
    with pytest.raises(InputError, match="seed"):
        loader(corpus, global_tokens=500, max_doc_tokens=128, seed=5).load_state_dict(state)


def test_next_batch_is_planned_in_the_background():
    planned, threads = threading.Event(), []

    def plan_fn(lengths):
        threads.append(threading.current_thread().name)
        if len(threads) == 2:
            planned.set()
        return round_robin(1)(lengths)

    batches = iter(BalancedLoader(from_lengths([50] * 10), global_tokens=100, plan_fn=plan_fn))
    first = next(batches)
    # A hang guard: planning 100 tokens takes milliseconds; 10 s only bounds a thread never started.
    assert planned.wait(timeout=10), "batch 1 was not planned while batch 0 was in use"
    assert first.batch.index == 0 and first.plan_ms >= 0
    assert all(name.startswith("ballonet-plan") for name in threads)


def test_plan_for_another_world_size_is_refused():
    with pytest.raises(ValueError, match="ranks"):
        next(iter(BalancedLoader(from_lengths([8]), global_tokens=4, plan_fn=round_robin(2))))
