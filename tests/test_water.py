"""`water.ordered_sum` adds as `np.sum` does, bit for bit (refinement relies on it for
plans identical to those of numpy's sums)."""

import numpy as np

from ballonet.planning.zeppelin.water import ordered_sum


def test_ordered_sum_is_numpys_sum_bit_for_bit():
    rng = np.random.default_rng(0)
    for n in list(range(0, 40)) + [63, 64, 65, 127, 128, 129, 200]:
        for scale in (1.0, 1e9):
            for _ in range(20):
                xs = (rng.uniform(-1, 1, n) * scale * 10.0 ** rng.integers(-6, 6, n)).tolist()
                assert ordered_sum(xs) == float(np.sum(xs)), (n, xs)
    xs = [1e16, 1.0] + [0.0] * 7 + [1.0] + [0.0] * 6  # in order 1e16; numpy's (and so ordered_sum's) 1e16 + 2
    assert ordered_sum(xs) == 1e16 + 2
