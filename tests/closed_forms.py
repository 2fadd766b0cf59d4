"""The simulator's closed forms, for the tests that write a simulated step out by hand
(test_simulator, test_remap_pricing, test_group_remap): a small model, H100 clusters, plans
by hand, and FLAT, the calibration profile they run under (conftest.py's `flat_profile`),
with its seconds by hand."""

from __future__ import annotations

import dataclasses
import math

from ballonet import specs
from ballonet.calibration import Curve
from ballonet.cost import hardware
from ballonet.plan import Plan, Ring, Segment, chunk_bounds

MODEL = specs.ModelSpec(name="m", num_layers=2, hidden=1024, num_heads=8, num_kv_heads=8, ffn_hidden=2816,
                        vocab_size=1000)
"""The closed forms' model."""
HD = MODEL.num_heads * MODEL.head_dim
GB = 1e9


def cluster(nodes=1, gpus=1, nics=1, nic_gbps=400.0, intra=None):
    """One group of H100 nodes."""
    return specs.ClusterSpec(name="t", groups=(specs.NodeGroup(
        gpu="h100", num_nodes=nodes, gpus_per_node=gpus, nics_per_node=nics, nic_gbps=nic_gbps,
        intra_link_bw=intra),))


def cluster_plan(c, local=None, split=(), routes=(), planner="test"):
    """local: {rank: [lengths]}; split: [(length, ranks)] zig-zag over even chunks."""
    R = c.num_ranks
    lengths, att, rings = [], [[] for _ in range(R)], []
    for r, lens in (local or {}).items():
        for L in lens:
            att[r].append(Segment(len(lengths), 0, L))
            lengths.append(L)
    for L, ranks in split:
        doc, g = len(lengths), len(ranks)
        lengths.append(L)
        kind = "inter" if len({c.node_of(r) for r in ranks}) > 1 else "intra"
        ring = Ring(doc=doc, kind=kind, ranks=tuple(ranks), bounds=chunk_bounds(L, 2 * g))
        rings.append(ring)
        for i, r in enumerate(ranks):
            att[r].extend(ring.chunks_of(i))
    return Plan(planner=planner, lengths=tuple(lengths), node_of_rank=tuple(c.node_of(r) for r in range(R)),
                nic_of_rank=tuple(c.nic_of(r) for r in range(R)), attention=tuple(map(tuple, att)),
                rings=tuple(rings), routes=tuple(routes)).validate()


PEAK = hardware.gpu("h100").peak_flops
EFF_F, EFF_B, EFF_LIN = 0.4, 0.3, 0.6
FLAT = dataclasses.replace(
    hardware.profile("h100"), attention_forward=Curve(tokens=(1,), efficiency=(EFF_F,)),
    attention_backward=Curve(tokens=(1,), efficiency=(EFF_B,)), attention_launch_s=0.0,
    linear=Curve(tokens=(1,), efficiency=(EFF_LIN,)), overlap_slowdown=0.0,
    memory_bw=math.inf, framework_s_per_layer=0.0, optimizer_s_per_param=0.0)  # GEMMs and attention only
BWD = 2.5 * EFF_F / EFF_B
"""Backward attention seconds over forward seconds under FLAT."""


def lin(n):  # one layer's forward GEMMs on n tokens, by hand: 2 FLOPs per weight per token
    h = MODEL.hidden
    weights = 4 * h * h + 3 * h * MODEL.ffn_hidden
    return 2 * weights * n / (PEAK * EFF_LIN)


def head(n):
    return 6 * MODEL.vocab_size * MODEL.hidden * n / (PEAK * EFF_LIN)


def nvlink(nbytes, bw):
    return FLAT.p2p_latency_s + nbytes / (bw * FLAT.p2p_efficiency)


def nic(nbytes, bw):
    return FLAT.nic_latency_s + nbytes / (bw * FLAT.nic_efficiency)
