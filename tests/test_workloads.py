import json

import numpy as np
import pytest

from ballonet import workloads
from ballonet.errors import InputError
from ballonet.workloads import Workload


def _stats(lengths):
    x = np.asarray(lengths, dtype=np.float64)
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return p50, p90, p99, (x[x > 8192] ** 2).sum() / (x * x).sum()


def _assert_close(drawn, reference):
    *pct, share = _stats(drawn)
    *ref_pct, ref_share = _stats(reference)
    for got, want in zip(pct, ref_pct):
        assert abs(got - want) <= 0.10 * want, (pct, ref_pct)
    assert abs(share - ref_share) <= 0.05, (share, ref_share)


# ---- presets against their sources -------------------------------------------------------


@pytest.mark.parametrize("name", ["wlbllm", "prolong"])
def test_preset_matches_real_list(name, real_data):
    real = json.loads((real_data / "workloads" / f"{name}.json").read_text())
    drawn = workloads.get(name).sample_lengths(200_000, np.random.default_rng(7))
    _assert_close(drawn, real)
    assert f"{name}.json" in workloads.PRESETS[name].source
    assert max(drawn) <= max(real) and min(drawn) >= min(real)


def test_shortmix_matches_its_mixture_and_is_short_heavy():
    data = json.loads((workloads.PRESET_DIR / "shortmix.json").read_text())
    mix = data["mixture"]
    rng = np.random.default_rng(3)
    n = 200_000
    comp = rng.random(n) < mix["weights"][0]
    ref = np.where(comp, mix["medians"][0] * np.exp(mix["sigmas"][0] * rng.standard_normal(n)),
                   mix["medians"][1] * np.exp(mix["sigmas"][1] * rng.standard_normal(n)))
    ref = np.clip(np.rint(ref), mix["min"], mix["max"])
    drawn = workloads.get("shortmix").sample_lengths(n, np.random.default_rng(8))
    _assert_close(drawn, ref)
    wlb = workloads.get("wlbllm").sample_lengths(n, np.random.default_rng(8))
    assert np.median(drawn) < np.median(wlb) / 3
    assert data["source"].startswith("synthetic")


def test_unknown_preset_lists_valid_names():
    with pytest.raises(InputError, match="wlbllm, prolong, shortmix"):
        workloads.get("arxiv")
    assert sorted(workloads.PRESETS) == ["prolong", "shortmix", "wlbllm"]


# ---- sampling, hand-computed ---------------------------------------------------------------


def test_log_uniform_table_is_inverse_cdf():
    # Two knots: log-uniform on [100, 10000], so a draw is 100 * 100**u.
    w = Workload(name="lu", lengths=(100, 10_000), cdf=(0.0, 1.0))
    u = np.random.default_rng(5).random(1000)
    got = w.sample_lengths(1000, np.random.default_rng(5))
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.rint(100 * 100.0**u).astype(np.int64))
    # Three knots with a flat top half: u >= 0.5 gives exactly 100, u < 0.5 gives 100**(2u).
    w = Workload(name="flat", lengths=(1, 100, 100), cdf=(0.0, 0.5, 1.0))
    got = w.sample_lengths(1000, np.random.default_rng(5))
    np.testing.assert_array_equal(got, np.where(u >= 0.5, 100, np.maximum(np.rint(100.0 ** (2 * u)), 1)))


def test_empirical_sample_draws_uniformly():
    w = Workload(name="e", lengths=(3, 7, 7, 20))
    u = np.random.default_rng(2).random(500)
    got = w.sample_lengths(500, np.random.default_rng(2))
    np.testing.assert_array_equal(got, np.array([3, 7, 7, 20])[np.floor(u * 4).astype(int)])


def test_batch_hand_computed():
    w = Workload(name="five", lengths=(5,))
    assert w.sample_batch(12, seed=0) == [5, 5, 2]
    assert w.sample_batch(10, seed=0) == [5, 5]
    assert w.sample_batch(3, seed=0) == [3]
    assert w.sample_batch(12, seed=0, max_length=3) == [3, 3, 3, 3]
    assert w.sample_batch(11, seed=0, max_length=5) == [5, 5, 1]


def test_batch_exact_budget_cut_and_determinism():
    w = workloads.get("prolong")
    for seed in range(5):
        batch = w.sample_batch(1_000_003, seed=seed, max_length=32_768)
        assert sum(batch) == 1_000_003 and all(1 <= x <= 32_768 for x in batch)
        assert batch == w.sample_batch(1_000_003, seed=seed, max_length=32_768)
        uncut = w.sample_batch(1_000_003, seed=seed)
        assert sum(uncut) == 1_000_003
    assert w.sample_batch(1_000_000, seed=1) != w.sample_batch(1_000_000, seed=2)
    # The cut is elementwise on the same draws: where no trim intervenes, cut == min(uncut, L).
    draws = w.sample_lengths(2000, np.random.default_rng(4))
    cut = w.sample_batch(int(np.minimum(draws, 4096)[:1000].sum()), seed=4, max_length=4096)
    assert cut == np.minimum(draws, 4096)[:1000].tolist()
    # A larger budget extends a smaller one: same documents, only the trimmed last differs.
    small, big = w.sample_batch(200_000, seed=9), w.sample_batch(5_000_000, seed=9)
    assert big[: len(small) - 1] == small[:-1] and big[len(small) - 1] >= small[-1]


def test_batches_derive_a_seed_per_step():
    w = workloads.get("wlbllm")
    steps = list(w.batches(100_000, seed=3, num_steps=3, max_length=8192))
    assert len(steps) == 3 and all(sum(b) == 100_000 for b in steps)
    assert steps[1] == w.sample_batch(100_000, seed=(3, 1), max_length=8192)
    assert steps[0] != steps[1] and steps == list(w.batches(100_000, 3, 3, max_length=8192))
    assert workloads.sample_batch("wlbllm", 50_000, seed=3) == w.sample_batch(50_000, seed=3)


def test_bad_sampling_arguments():
    w = workloads.get("wlbllm")
    with pytest.raises(InputError, match="num_tokens must be a positive integer, got 0"):
        w.sample_batch(0, seed=0)
    with pytest.raises(InputError, match="max_length"):
        w.sample_batch(10, seed=0, max_length=0)
    with pytest.raises(InputError, match="seed"):
        w.sample_batch(10, seed=-1)
    with pytest.raises(InputError, match="ascending"):
        Workload(name="x", lengths=(5, 3))
    with pytest.raises(InputError, match="cdf"):
        Workload(name="x", lengths=(3, 5), cdf=(0.0, 0.9))


# ---- length files --------------------------------------------------------------------------


def test_each_format_loads(tmp_path):
    (tmp_path / "a.txt").write_text("12\n\n4096\n  7 \n")
    (tmp_path / "a.json").write_text("[12, 4096, 7.0]")
    (tmp_path / "a.jsonl").write_text(
        '{"length": 12}\n\n{"input_ids": [1, 2, 3]}\n{"text": "h\u00e9llo"}\n')
    np.save(tmp_path / "a.npy", np.array([12, 4096, 7], dtype=np.int32))
    np.save(tmp_path / "f.npy", np.array([12.0, 3.0]))
    assert workloads.load_lengths(str(tmp_path / "a.txt")) == [12, 4096, 7]
    assert workloads.load_lengths(str(tmp_path / "a.json")) == [12, 4096, 7]
    assert workloads.load_lengths(str(tmp_path / "a.jsonl")) == [12, 3, 6]  # "héllo" is 6 UTF-8 bytes
    assert workloads.load_lengths(str(tmp_path / "a.npy")) == [12, 4096, 7]
    assert workloads.load_lengths(str(tmp_path / "f.npy")) == [12, 3]
    w = workloads.get(str(tmp_path / "a.txt"))
    assert w.lengths == (7, 12, 4096) and w.cdf is None
    assert set(w.sample_batch(100_000, seed=0)[:-1]) <= {7, 12, 4096}


@pytest.mark.parametrize("name, content, message", [
    ("lengths.txt", "5\n7\n-4\n", "lengths.txt:3: length must be a positive integer, got '-4'"),
    ("lengths.txt", "5\n2.5\n", "lengths.txt:2: length must be a positive integer, got '2.5'"),
    ("lengths.txt", "0\n", "lengths.txt:1: length must be a positive integer, got '0'"),
    ("lengths.json", "[5, 0, 3]", r"lengths.json\[1\]: length must be a positive integer, got 0"),
    ("lengths.json", '[5, 3, "x"]', r"lengths.json\[2\]: length must be a positive integer, got 'x'"),
    ("lengths.json", "[5, 3, 2.5]", r"lengths.json\[2\]: length must be a positive integer, got 2.5"),
    ("lengths.json", "[5, true]", r"lengths.json\[1\]: length must be a positive integer, got True"),
    ("lengths.json", '{"a": 1}', "lengths.json: expected a JSON list of lengths, got a dict"),
    ("lengths.json", "[5,", "lengths.json:1: malformed JSON"),
    ("lengths.jsonl", '{"length": 4}\n{"length": -1}\n', "lengths.jsonl:2: length must be a positive integer, got -1"),
    ("lengths.jsonl", '{"length": 4}\n{"text": ""}\n', "lengths.jsonl:2: length must be a positive integer, got 0"),
    ("lengths.jsonl", '{"length": 4}\n{"tokens": [1]}\n', "lengths.jsonl:2: expected an object with a 'length'"),
    ("lengths.jsonl", '{"length": 4}\nnot json\n', "lengths.jsonl:2: not JSON Lines: malformed JSON"),
    ("empty.txt", "\n\n", "empty.txt: no lengths in file"),
])
def test_bad_files_name_file_and_line(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(InputError, match=message) as err:
        workloads.load_lengths(str(tmp_path / name))
    assert "\n" not in str(err.value)


def test_bad_npy_and_missing_files(tmp_path):
    np.save(tmp_path / "a.npy", np.array([5, 3, 0, 2]))
    with pytest.raises(InputError, match=r"a.npy\[2\]: length must be a positive integer, got 0"):
        workloads.load_lengths(str(tmp_path / "a.npy"))
    np.save(tmp_path / "b.npy", np.array([5.0, 1.5]))
    with pytest.raises(InputError, match=r"b.npy\[1\]: length must be a positive integer, got 1.5"):
        workloads.load_lengths(str(tmp_path / "b.npy"))
    np.save(tmp_path / "c.npy", np.ones((2, 2), dtype=np.int64))
    with pytest.raises(InputError, match="c.npy: expected a 1-D integer array"):
        workloads.load_lengths(str(tmp_path / "c.npy"))
    with pytest.raises(InputError, match="nope.txt: no such lengths file"):
        workloads.load_lengths(str(tmp_path / "nope.txt"))
    with pytest.raises(InputError, match="no such lengths file"):
        workloads.get(str(tmp_path / "nope.json"))


# ---- hardening (issue 16) --------------------------------------------------------------


@pytest.mark.parametrize("array, where", [
    (np.array([5, 2**63 + 5], dtype=np.uint64), "[1]: length 9223372036854775813 is above 2^63 - 1"),
    (np.array([5.0, 3.0, 1e30]), "[2]: length 1e+30 is above 2^63 - 1"),
])
def test_npy_lengths_beyond_int64_name_file_and_index(tmp_path, array, where):
    path = tmp_path / "big.npy"
    np.save(path, array)
    with pytest.raises(InputError) as err:
        workloads.load_lengths(str(path))
    assert str(err.value) == f"{path}{where}"


def test_npy_uint64_within_int64_is_read_exactly(tmp_path):
    path = tmp_path / "ok.npy"
    values = [1, 7, 2**40 + 3]
    np.save(path, np.array(values, dtype=np.uint64))
    assert workloads.load_lengths(str(path)) == values


def test_workload_preset_wins_over_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wlbllm").mkdir()
    assert workloads.get("wlbllm") is workloads.PRESETS["wlbllm"]
    with pytest.raises(InputError, match="not a file"):
        workloads.get("./wlbllm")


def test_read_jsonl_names_the_line_for_every_reader(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"length": 3}\n\n{"length": 4\n')
    with pytest.raises(InputError, match=r"x.jsonl:3: not JSON Lines: malformed JSON"):
        workloads.read_jsonl(path, lambda row, where: row)
    path.write_bytes(b'{"length": 3}\n\xff\n')
    with pytest.raises(InputError, match=r"x.jsonl: not JSON Lines \(not UTF-8 text\)"):
        workloads.read_jsonl(path, lambda row, where: row)
    path.write_text('{"a": 1}\n\n{"b": 2}\n')
    assert workloads.read_jsonl(path, lambda row, where: (where, row)) == [
        (f"{path}:1", {"a": 1}), (f"{path}:3", {"b": 2})]
