"""A remap across node groups (a mixed cluster's memory pooled through the remap,
docs/design.md section 5) priced in closed form: hand formulas from the NICs' rates,
never the simulator's own figures."""

import dataclasses

import pytest
from tests.closed_forms import EFF_F, HD, MODEL, PEAK, cluster_plan, lin, nic

from ballonet.plan import Transfer
from ballonet.simulation.simulator import simulate
from ballonet.specs import ClusterSpec, NodeGroup

pytestmark = pytest.mark.usefixtures("flat_profile")  # conftest.py: the closed forms' calibration profile


@pytest.mark.parametrize("slow_side", [0, 1])
def test_remap_across_groups_runs_at_the_slower_nic(slow_side):
    # Two one-GPU nodes in two groups, one with a 400 Gb/s NIC, the other 100 Gb/s. Rank 0
    # holds two 4000-token documents; the remap moves the second's tokens to rank 1 for the
    # linear layers: o over after attention, q, k and v back before the next layer's; each
    # at the slower NIC's rate, whichever end it is on.
    gbps = [400.0, 400.0]
    gbps[slow_side] = 100.0
    C = ClusterSpec(name="t", groups=tuple(
        NodeGroup(gpu="h100", num_nodes=1, gpus_per_node=1, nics_per_node=1, nic_gbps=g) for g in gbps))
    plan = dataclasses.replace(cluster_plan(C, local={0: [4000, 4000]}),
                               remap=(Transfer(src=0, dst=1, start=4000, end=8000),)).validate()
    att0 = 2 * 2 * HD * 4000 * 4001 / (PEAK * EFF_F)
    slow = 100e9 / 8
    o = nic(4000 * MODEL.hidden * 2, slow)
    qkv = nic(4000 * (MODEL.hidden + 2 * MODEL.kv_dim) * 2, slow)
    res = simulate(plan, C, MODEL, overlap_grad_allreduce=False)
    assert res.layer_forward_s == pytest.approx(att0 + o + lin(4000) + qkv, rel=1e-9)
    assert res.bytes_sent["forward"]["remap", 0, 1] == 4000 * MODEL.hidden * 2
