"""WLB-LLM's outlier delay as a data order of the training loader (`--outlier-delay`):
the shared definition, hand-computed batches, an independent queue model, the ledger,
exact resume mid-queue and the end-of-data flush."""

import json
from collections import defaultdict
from itertools import islice

import numpy as np
import pytest
from tests.training_reference import loader, round_robin

from ballonet.errors import InputError
from ballonet.outliers import outlier_level
from ballonet.planning.wlb_llm import outlier_steps
from ballonet.training.config import TrainConfig
from ballonet.training.data.corpus import from_lengths
from ballonet.training.data.loader import BalancedLoader, document_order


def test_outlier_level_hand_computed():
    # T = 100 tokens over G = 4 groups: a share of 25, outliers of 13..25 tokens;
    # levels (8, 16] -> 4 and (16, 32] -> 5.
    assert [outlier_level(n, 100, 4) for n in (1, 12, 13, 16, 17, 25, 26, 100)] == \
        [None, None, 4, 4, 5, 5, None, None]
    # T = 8, G = 2: (2, 4], level 2.
    assert [outlier_level(n, 8, 2) for n in (2, 3, 4, 5)] == [None, 2, 2, None]
    # T = 7, G = 2: (1.75, 3.5] -> 2 and 3.
    assert [outlier_level(n, 7, 2) for n in (1, 2, 3, 4)] == [None, 1, 2, None]


def test_outlier_steps_delays_the_same_documents():
    # 400 tokens, 4 groups: (50, 100]; 60 (level 6) and 100, 89 (level 7) wait, 50 and 101 not.
    assert outlier_steps([60, 100, 50, 101, 89], 4, []) == [
        (0.25, [50, 101]), (0.25, [60, 60, 60, 60, 50, 101]), (0.5, [100, 89, 100, 89])]


def hand_loader(lengths, global_tokens, groups, **kw):
    return loader(from_lengths(lengths, seed=1), global_tokens=global_tokens, outlier_delay=groups, shuffle=False,
                  max_epochs=1, **kw)


def spans(batches):
    return [[(p.doc, p.start, p.end) for p in b.pieces] for b in batches]


def test_outliers_are_released_g_at_a_time_hand_computed():
    # T = 40, G = 2: outliers are (10, 20] tokens: level 4 (11..16) and level 5 (17..20).
    lengths = [12, 5, 18, 14, 7, 19, 30, 3, 9, 25, 15]
    batches = list(hand_loader(lengths, 40, 2))
    assert spans(batches) == [
        [(1, 0, 5), (4, 0, 7), (6, 0, 28)],  # 12, 18, 14, 19 wait; level 4 filled first
        [(0, 0, 12), (3, 0, 14), (6, 28, 30), (7, 0, 3), (8, 0, 9)],  # level 4's two, then the stream
        [(2, 0, 18), (5, 0, 19), (9, 0, 3)],  # level 5's two; 25 is no outlier, cut at the budget
        [(9, 3, 25), (10, 0, 15)],  # 15 waits, then the data ends: it goes in
    ]
    assert [len(b.input_ids) for b in batches] == [40, 40, 40, 37]


def test_an_outlier_whose_level_is_full_goes_in_and_the_flush_cuts_at_the_budget():
    # T = 40, G = 2: 12 and 14 fill level 4, so 13 goes in as any other document.
    assert spans(hand_loader([12, 14, 13, 30], 40, 2)) == [
        [(2, 0, 13), (3, 0, 27)], [(0, 0, 12), (1, 0, 14), (3, 27, 30)]]
    # T = 60, G = 3: (10, 20]; no level reaches 3, so all four wait for the end, in the
    # order they came; the last is cut at the budget and its rest ends the data.
    assert spans(hand_loader([15, 17, 13, 19, 5], 60, 3)) == [
        [(4, 0, 5), (0, 0, 15), (1, 0, 17), (2, 0, 13), (3, 0, 10)], [(3, 10, 19)]]


def reference_batches(lengths, order, epochs, T, window, G):
    """An independent model of the delay: the stream as whole context windows, a queue per
    level (the outlier test written out in floats), released at a batch's start in the
    order the levels filled while the stream goes on, and flushed in arrival order at the
    end. -> ([[(epoch, doc, start, end)]], the number of releases)"""
    stream = [(e, d, s, min(int(lengths[d]), s + window))
              for e in range(epochs) for d in order(e) for s in range(0, int(lengths[d]), window)]
    queues, filled, arrived = defaultdict(list), [], []
    batches, current, budget, releases = [], [], T, []

    def close(more):
        nonlocal current, budget
        batches.append(current)
        current, budget = [], T
        if more and filled:
            released = queues.pop(filled.pop(0))
            releases.append(released)
            for q in released:
                arrived.remove(q)
            current, budget = list(released), T - sum(q[3] - q[2] for q in released)
            if budget == 0:
                close(more)

    def place(e, d, s, t, stream_left):
        """`stream_left`: None in the flush, else whether stream pieces follow this one."""
        nonlocal budget
        while s < t:
            take = min(t - s, budget)
            current.append((e, d, s, s + take))
            budget, s = budget - take, s + take
            if budget == 0:
                close(stream_left is not None and (s < t or stream_left))

    for i, (e, d, s, t) in enumerate(stream):
        n = t - s
        level = (n - 1).bit_length() if T / (2 * G) < n <= T / G else None
        if level is not None and len(queues[level]) < G:
            queues[level].append((e, d, s, t))
            arrived.append((e, d, s, t))
            if len(queues[level]) == G:
                filled.append(level)
            continue
        place(e, d, s, t, i + 1 < len(stream))
    for e, d, s, t in list(arrived):
        place(e, d, s, t, None)
    return batches + ([current] if current else []), len(releases)


@pytest.mark.parametrize("seed", range(6))
def test_batches_match_an_independent_queue_model_and_the_ledger_is_exact(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(4.5, 1.0, 120).astype(int) + 1
    T, G, window = int(rng.integers(300, 900)), int(rng.integers(2, 5)), [None, 200][seed % 2]
    corpus = from_lengths(lengths, seed=seed)
    batches = list(loader(corpus, global_tokens=T, max_doc_tokens=window, seed=seed, max_epochs=2,
                          outlier_delay=G, prefetch=False))
    got = [[tuple(p) for p in b.pieces] for b in batches]
    order = lambda e: document_order(len(lengths), e, seed, True)  # noqa: E731
    expected, releases = reference_batches(lengths, order, 2, T, window or int(lengths.max()), G)
    assert got == expected and releases >= 2
    sizes = [len(b.input_ids) for b in batches]
    assert sizes[:-1] == [T] * (len(sizes) - 1) and sum(sizes) == 2 * corpus.num_tokens
    ledger = [p for b in got for p in b]
    for epoch in (0, 1):  # every token exactly once per epoch
        for doc, length in enumerate(lengths.tolist()):
            parts = sorted((s, t) for e, d, s, t in ledger if (e, d) == (epoch, doc))
            assert parts[0][0] == 0 and parts[-1][1] == length and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


def test_composition_does_not_depend_on_world_size():
    corpus = from_lengths(np.random.default_rng(3).lognormal(4.5, 1.0, 150).astype(int) + 1, seed=3)
    seen = []
    for world in (1, 2, 4):
        batches = islice(loader(corpus, world, world - 1, global_tokens=600, seed=2, outlier_delay=3), 12)
        seen.append([b.pieces for b in batches])
    assert seen[0] == seen[1] == seen[2]


def test_resume_mid_queue_equals_the_uninterrupted_run():
    corpus = from_lengths(np.random.default_rng(4).lognormal(4.5, 1.0, 150).astype(int) + 1, seed=4)
    common = dict(global_tokens=600, max_doc_tokens=256, seed=8, outlier_delay=3, max_epochs=2)
    straight = [b.pieces for b in loader(corpus, 2, 0, **common)]
    for stop in range(1, 12):
        first = loader(corpus, 2, 0, **common)
        head = [b.pieces for b in islice(first, stop)]
        state = json.loads(json.dumps(first.state_dict()))
        if state["waiting"]:
            break
    assert state["waiting"], "no state with outliers waiting"
    resumed = loader(corpus, 4, 3, prefetch=False, **common)
    resumed.load_state_dict(state)
    assert head + [b.pieces for b in resumed] == straight
    for other in (None, 2):
        with pytest.raises(InputError, match=f"outlier_delay=3, this loader has {other}"):
            loader(corpus, **dict(common, outlier_delay=other)).load_state_dict(state)


def test_the_checkpoint_state_format_is_kept():
    # The hand-computed case above after its first batch, as a checkpoint holds it: 12 and
    # 14 (level 4) and 18 and 19 (level 5) waiting in the order they came, the stream at
    # token 28 of document 6. A state written in this format resumes to the same batches.
    lengths = [12, 5, 18, 14, 7, 19, 30, 3, 9, 25, 15]
    state = {"epoch": 0, "position": 6, "offset": 28, "batch": 1,
             "waiting": [[0, 0, 0, 12], [0, 2, 0, 18], [0, 3, 0, 14], [0, 5, 0, 19]],
             "num_docs": 11, "num_tokens": 157, "global_tokens": 40, "max_doc_tokens": None, "seed": 0,
             "shuffle": False, "outlier_delay": 2}
    first = hand_loader(lengths, 40, 2)
    next(iter(first))
    assert first.state_dict() == state
    resumed = hand_loader(lengths, 40, 2)
    resumed.load_state_dict(state)
    assert spans(resumed) == [[(0, 0, 12), (3, 0, 14), (6, 28, 30), (7, 0, 3), (8, 0, 9)],
                              [(2, 0, 18), (5, 0, 19), (9, 0, 3)], [(9, 3, 25), (10, 0, 15)]]


def test_bad_values_and_states_are_refused():
    corpus = from_lengths([10, 20, 30], seed=0)
    for bad in (0, 1, -2, 2.5, True):
        with pytest.raises(InputError, match="outlier delay must be an integer of at least 2"):
            BalancedLoader(corpus, global_tokens=8, plan_fn=round_robin(1), outlier_delay=bad)
    for bad in (1, 0, -3):
        with pytest.raises(InputError, match=f"--outlier-delay must be at least 2.*got {bad}$"):
            TrainConfig(outlier_delay=bad)
    state = loader(corpus, outlier_delay=2).state_dict()
    for waiting, message in (([[0, 5, 0, 4]], r"waiting\[0\]"), ([[0, 0, 3, 11]], r"waiting\[0\]"),
                             ([[1, 0, 0, 4]], "epoch up to 0"), ([[0, 0, 0]], "4 integers"), ("x", "must be a list")):
        with pytest.raises(InputError, match=message):
            loader(corpus, outlier_delay=2).load_state_dict(dict(state, waiting=waiting))
    plain = loader(corpus).state_dict()
    with pytest.raises(InputError, match="empty without an outlier delay"):
        loader(corpus).load_state_dict(dict(plain, waiting=[[0, 0, 0, 4]]))
    loader(corpus).load_state_dict({k: v for k, v in plain.items() if k not in ("waiting", "outlier_delay")})


# ---- the option in training -----------------------------------------------------------


def test_flag_config_key_and_help(tmp_path):
    import argparse

    from ballonet.training import config as train_config

    p = argparse.ArgumentParser()
    train_config.add_arguments(p)
    assert "--outlier-delay" in p.format_help() and "WLB-LLM" in p.format_help()
    assert train_config.config_from_args(p.parse_args(["--outlier-delay", "4"])).outlier_delay == 4
    toml = tmp_path / "run.toml"
    toml.write_text("outlier_delay = 3\n")
    assert train_config.config_from_args(p.parse_args(["--config", str(toml)])).outlier_delay == 3
    toml.write_text("outlier_delay = 1\n")
    with pytest.raises(InputError, match=r"run.toml: outlier_delay must be at least 2 \(.*got 1$"):
        train_config.config_from_args(p.parse_args(["--config", str(toml)]))


def test_cli_refuses_a_bad_delay_with_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ballonet", "train", "--outlier-delay", "1"], check=False,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "ballonet train: error: --outlier-delay must be at least 2 (groups that each get one outlier), got 1"], r.stderr


def test_training_runs_the_delayed_order_and_resume_keeps_it(tmp_path):
    from training_reference import BASE, whole_docs

    from ballonet.training.data.corpus import load_corpus
    from ballonet.training.loop import train

    ckpt = str(tmp_path / "ckpt")
    common = dict(BASE, checkpoint_dir=ckpt, outlier_delay=3)  # the first batch already holds one back
    first = train(TrainConfig(**common, steps=3, checkpoint_every=3))
    with pytest.raises(InputError, match="saved with outlier_delay=3, this loader has 2"):
        train(TrainConfig(**dict(common, outlier_delay=2), steps=6, resume=True))
    second = train(TrainConfig(**common, steps=6, resume=True))
    ledger = [r["ledger"] for r in first + second]
    corpus = load_corpus(BASE["corpus"], seed=BASE["seed"])

    def reference(delay):
        batches = BalancedLoader(corpus, global_tokens=BASE["global_tokens"], plan_fn=whole_docs, seed=BASE["seed"],
                                 max_doc_tokens=BASE["max_doc_tokens"], prefetch=False, outlier_delay=delay)
        return [[list(p) for p in b.pieces] for b in islice(batches, 6)]

    assert ledger == reference(3) != reference(None)
