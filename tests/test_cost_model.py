import csv
import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest

import ballonet
from ballonet import calibration, specs
from ballonet.cost import hardware, profiles
from ballonet.cost.bounds import batch_lower_bound, batch_recomputation
from ballonet.cost.flops import (
    attention_flops,
    block_flops,
    hidden_bytes,
    kv_bytes,
    kv_grad_bytes,
    linear_flops_per_token,
    mlp_flops_per_token,
    remap_bytes,
    zigzag_flops,
)
from ballonet.cost.memory import (
    BELOW,
    RECOMPUTE_MODES,
    activation_bytes,
    activation_bytes_per_token,
    memory_cap,
    recompute_layer_count,
)
from ballonet.cost.recompute import (
    cheapest_mode,
    cheapest_per_rank,
    layers_per_rank,
    recompute_elementwise_bytes_per_token,
    recompute_flops_per_token,
)
from ballonet.cost.seconds import (
    attention_seconds,
    breakeven_chunk_tokens,
    collective_time,
    grad_allreduce_time,
    p2p_time,
    sequence_cost,
)
from ballonet.plan.recompute import heaviest
from ballonet.specs import ModelSpec

LLAMA7B = ballonet.model("llama-7b")
LLAMA3 = ballonet.model("llama3-8b")


def test_flops_by_hand():
    # Causal attention, 32 heads x 128: 2 matmuls * 2 FLOPs * 4096 * (1024 * 1025 / 2) pairs.
    assert attention_flops(LLAMA7B, 1024) == 2 * 2 * 4096 * 1024 * 1025 / 2
    # One full 100 x 300 block: 2 matmuls * 2 FLOPs * 4096 * 30000.
    assert block_flops(LLAMA7B, 100, 300) == 4 * 4096 * 30000
    # Per token: QKV 4096*(4096+2*4096), O 4096^2, SwiGLU 3*4096*11008; 2 FLOPs per weight.
    assert linear_flops_per_token(LLAMA7B) == 404_750_336
    # GQA: K and V are 8 heads of 128, so QKV is 4096*(4096+2048).
    assert linear_flops_per_token(LLAMA3) == 2 * (4096 * 6144 + 4096**2 + 3 * 4096 * 14336)


def test_zigzag_chunks_add_up_to_the_whole_causal_document():
    L, g = 1000, 4
    bounds = tuple(L * j // (2 * g) for j in range(2 * g + 1))
    total = sum(float(zigzag_flops(LLAMA7B, bounds)[i]) for i in range(g))
    assert total == attention_flops(LLAMA7B, L)
    # Zig-zag balances causal work: every position within 2% of the mean.
    shares = [float(zigzag_flops(LLAMA7B, bounds)[i]) for i in range(g)]
    assert max(shares) / min(shares) < 1.02


def test_attention_efficiency_reads_the_pricing_profile():
    """`hardware.attention_efficiency` is the priced GPU's curve, forward or backward: its
    knots, log-linear between them (the geometric mean of two knots gets the mean of
    their efficiencies), flat past the ends; a profile installed by `calibration.use`
    prices its own GPU type only."""
    fwd, bwd = profiles.HOPPER_FORWARD, profiles.HOPPER_BACKWARD
    knots = np.array(fwd.tokens)
    assert hardware.attention_efficiency(knots, "h100") == pytest.approx(fwd.efficiency, rel=1e-12)
    assert hardware.attention_efficiency(knots, "h100", backward=True) == pytest.approx(bwd.efficiency, rel=1e-12)
    mid = np.sqrt(knots[:-1] * knots[1:])
    means = (np.array(fwd.efficiency[:-1]) + np.array(fwd.efficiency[1:])) / 2
    assert hardware.attention_efficiency(mid, "h100") == pytest.approx(means, rel=1e-12)
    assert hardware.attention_efficiency([1, 1e9], "h100").tolist() == [fwd.efficiency[0], fwd.efficiency[-1]]
    flat = dataclasses.replace(hardware.profile("h100"),
                               attention_forward=calibration.Curve(tokens=(1,), efficiency=(0.5,)))
    with calibration.use(flat):
        assert hardware.attention_efficiency([64, 65536], "h100").tolist() == [0.5, 0.5]
        assert hardware.attention_efficiency([64, 65536], "h100", backward=True).tolist() == [
            bwd.efficiency[0], float(bwd.at(65536))]
        assert float(hardware.attention_efficiency(4096, "h200")) == float(fwd.at(4096))


def test_bytes_by_hand():
    assert kv_bytes(LLAMA3, 100) == 2 * 100 * 1024 * 2
    assert kv_bytes(ballonet.model("llama-13b", tp=2), 10) == 2 * 10 * 5120 * 2 / 2
    assert hidden_bytes(LLAMA7B, 10) == 10 * 4096 * 2
    # The runtime's remap: q, k, v out (h + 2 kv_dim a token), o back (h).
    assert remap_bytes(LLAMA3, 10, True) == 10 * (4096 + 2 * 1024) * 2
    assert remap_bytes(LLAMA3, 10, False) == 10 * 4096 * 2
    assert kv_grad_bytes(LLAMA3, 100) == 2 * 100 * 1024 * 4  # fp32 dK/dV


def test_activation_memory_by_recompute_mode_by_hand():
    h, f, n = 4096, 11008, 32
    lin = 3 * h + 2 * h + 4 * f  # attention block input, normed, o; MLP input, normed, gate, up, silu, product
    att = 2 * h + 2 * h  # q, k, v (MHA: kv_dim = h) and the attention output, on the attention layout
    assert activation_bytes_per_token(LLAMA7B, "none") == n * (lin + att) * 2
    assert activation_bytes_per_token(LLAMA7B, "selective") == n * (lin + att - h - 4 * f) * 2
    assert activation_bytes_per_token(LLAMA7B, "full") == (n * h + lin + att) * 2
    assert activation_bytes_per_token(LLAMA7B) == activation_bytes_per_token(LLAMA7B, "full")
    # tokens held on one layout only: 100 linear-layout tokens and 300 attention-layout ones
    assert activation_bytes(LLAMA7B, 100, 300, "none") == n * (100 * lin + 300 * att) * 2
    assert activation_bytes(LLAMA7B, 100, 300, "full") == (n * h * 100 + 100 * lin + 300 * att) * 2
    assert recompute_flops_per_token(LLAMA7B, "none") == 0
    assert recompute_flops_per_token(LLAMA7B, "selective") == 2 * 3 * h * f
    assert recompute_flops_per_token(LLAMA7B, "full") == linear_flops_per_token(LLAMA7B)


def test_cheapest_recompute_is_the_first_mode_that_fits():
    gpu = hardware.gpu("h100")
    cap = memory_cap(LLAMA7B, gpu, 8)
    for mode in RECOMPUTE_MODES:
        tokens = int(cap // activation_bytes_per_token(LLAMA7B, mode))
        assert cheapest_mode(LLAMA7B, [tokens], [gpu], 8) == mode
    huge = int(cap // activation_bytes_per_token(LLAMA7B, "full")) + 1
    assert cheapest_mode(LLAMA7B, [huge], [gpu], 8) is None
    pinned = ballonet.model("llama-7b", recompute="full")
    assert cheapest_mode(pinned, [1], [gpu], 8) == "full"
    with pytest.raises(ballonet.InputError, match="recompute"):
        ballonet.model("llama-7b", recompute="some")


def _calibration_model():
    # The shape in h100_attention_latency.csv: 64 query heads, 4 KV heads, head dim 128.
    return ModelSpec(name="calib", num_layers=1, hidden=64 * 128, num_heads=64, num_kv_heads=4,
                     ffn_hidden=1, vocab_size=1)


ROOT = pathlib.Path(__file__).parent.parent
DATA = ROOT / "data"  # the calibration files ship with the repo (data/README.md)
GPU_RUN = ROOT / "bench" / "results" / "gpu_kernels.json"


def test_hopper_profile_reproduces_the_h200_run_forward_and_backward():
    # The measurement (bench/gpu_kernels.py on an H200: packs of max(1, 64K // L) documents),
    # timed forward and backward separately, against the built-in profile's prediction.
    run = json.loads(GPU_RUN.read_text())
    h200 = hardware.gpu("h200")
    checked = 0
    for row in run["attention"]:
        if row["length"] < 256:
            continue
        spec = ModelSpec(name="m", num_layers=1, hidden=row["heads"] * row["head_dim"], num_heads=row["heads"],
                         num_kv_heads=row["kv_heads"], ffn_hidden=1, vocab_size=1)
        flops = attention_flops(spec, row["length"]) * row["num_docs"]
        for backward, key in ((False, "forward_ms"), (True, "backward_ms")):
            predicted = attention_seconds(spec, h200, flops, row["length"], backward=backward, launch_floor=True)
            assert predicted == pytest.approx(row[key] * 1e-3, rel=0.10), (row["shape"], row["length"], key)
            checked += 1
    assert checked >= 30


def test_h100_files_read_as_forward_and_forward_plus_backward():
    # h100_flash_attention_forward.csv is forward: the profile's forward matches it from 8K
    # tokens (one document per call there, so shorter ones are launch-bound).
    model, h100 = _calibration_model(), hardware.gpu("h100")
    with open(DATA / "calibration" / "h100_flash_attention_forward.csv") as f:
        fwd = {int(r["L"]): float(r["duration_per_doc"]) * 1e-3 for r in csv.DictReader(f)
               if r["cp"] == "1" and r["tp"] == "1"}
    with open(DATA / "calibration" / "h100_attention_latency.csv") as f:
        both = {int(r["seq_len"]): float(r["latency(ms)"]) * 1e-3 for r in csv.DictReader(f)}
    for L in (8192, 16384, 32768):
        flops = attention_flops(model, L)
        forward = attention_seconds(model, h100, flops, L, launch_floor=True)
        backward = attention_seconds(model, h100, flops, L, backward=True, launch_floor=True)
        assert forward == pytest.approx(fwd[L], rel=0.15)
        # The "latency" file is far slower than any forward, and below our forward+backward
        # (a faster fused kernel): it holds forward+backward times.
        assert both[L] > 2.5 * forward and 0.6 < both[L] / (forward + backward) < 1.0


def test_backward_has_its_own_efficiency_and_ampere_its_own_fraction():
    h100, a100 = hardware.gpu("h100"), hardware.gpu("a100")
    run = json.loads(GPU_RUN.read_text())
    ratios = [r["backward_ms"] / r["forward_ms"] for r in run["attention"] if r["length"] >= 2048]
    model = LLAMA7B
    f = attention_flops(model, 32768)
    predicted = (attention_seconds(model, h100, f, 32768, backward=True, launch_floor=True)
                 / attention_seconds(model, h100, f, 32768, launch_floor=True))
    assert min(ratios) * 0.95 <= predicted <= max(ratios) * 1.05 and predicted != pytest.approx(2.5)
    # FlashAttention-2 reaches a larger fraction of A100 peak than of H100 peak.
    assert hardware.attention_efficiency(32768, a100) > 1.8 * hardware.attention_efficiency(32768, h100)
    assert "FlashAttention-2" in hardware.profile(a100).source
    for name in hardware.GPUS:
        p = hardware.profile(name)
        assert p.source and (name in ("h100", "h200", "h800") or p.assumptions), name


def test_nccl_within_25_percent_at_64mb_and_above():
    bw = hardware.gpu("h100").intra_link_bw
    checked = 0
    with open(DATA / "calibration" / "h100_nccl_perf.csv") as f:
        for r in csv.DictReader(f):
            size = int(r["size_bytes"])
            if size < 64 * 2**20:
                continue
            predicted = collective_time(r["op"], size, int(r["ngpu"]), bw)
            for col in ("t_us_out", "t_us_in"):
                measured = float(r[col]) * 1e-6
                assert abs(predicted / measured - 1) <= 0.25, (r["op"], r["ngpu"], size, predicted, measured)
                checked += 1
    assert checked >= 40


def test_linear_time_matches_megatron_projection():
    # h100_megatron_layer_ops.tsv, TP=1 CP=1: output projection of 32K tokens, hidden 4096.
    with open(DATA / "calibration" / "h100_megatron_layer_ops.tsv") as f:
        row = next(r for r in csv.DictReader(f, delimiter="\t") if r["tp"] == "1" and r["cp"] == "1")
    measured = float(row["megatron.core.transformer.attention.forward.linear_proj_1"]) * 1e-3
    flops = 2 * 32768 * 4096 * 4096
    predicted = flops / (989e12 * hardware.linear_efficiency(32768, "h100"))
    assert abs(predicted / measured - 1) < 0.15


def test_breakeven_follows_the_closed_form():
    # c* ~ F * h_kv * bytes / (2 * h * BW): a NIC (25 GB/s) needs far longer chunks than NVLink,
    # and GQA (4x fewer KV bytes per token) needs shorter ones than MHA.
    a800 = hardware.gpu("a800")
    nvlink = breakeven_chunk_tokens(LLAMA7B, a800, a800.intra_link_bw)
    nic = breakeven_chunk_tokens(LLAMA7B, a800, 25e9, nic=True)
    gqa = breakeven_chunk_tokens(LLAMA3, a800, 25e9, nic=True)
    assert nic > 5 * nvlink
    assert gqa < nic / 2
    # At the crossover, compute and transfer of one step agree within a few percent.
    c = nic
    compute = attention_seconds(LLAMA7B, a800, block_flops(LLAMA7B, c, c), c, launch_floor=True)
    transfer = p2p_time(kv_bytes(LLAMA7B, c), 25e9, nic=True, gpu=a800)
    assert compute == pytest.approx(transfer, rel=0.05)


def test_shared_nic_slows_the_gradient_allreduce():
    one_nic_each = ballonet.cluster("h800-8nic", num_nodes=2)
    shared = ballonet.cluster("h800-8nic", num_nodes=2, nics_per_node=4)
    assert grad_allreduce_time(LLAMA7B, shared) > grad_allreduce_time(LLAMA7B, one_nic_each)
    single_node = ballonet.cluster("h800-8nic", num_nodes=1)
    assert grad_allreduce_time(LLAMA7B, single_node) < grad_allreduce_time(LLAMA7B, one_nic_each)


# ---- selective recomputation of the first layers only ------------------------------------


def test_selective_on_some_layers_prices_between_none_and_every_layer():
    """k of L layers recomputing hold k/L of the way from "none" to "selective" in memory
    and rerun k/L of the MLP's FLOPs and bytes, the ends exactly the whole-model modes."""
    m, L = LLAMA7B, LLAMA7B.num_layers
    keep, drop = activation_bytes(m, 1000, 900, "none"), activation_bytes(m, 1000, 900, "selective")
    assert activation_bytes(m, 1000, 900, "selective", L) == drop
    for k in (1, 5, L - 1):
        assert activation_bytes(m, 1000, 900, "selective", k) == pytest.approx(keep - k / L * (keep - drop), rel=1e-12)
        assert recompute_flops_per_token(m, "selective", k) == pytest.approx(k / L * mlp_flops_per_token(m))
        assert 0 < recompute_elementwise_bytes_per_token(m, "selective", k) \
            < recompute_elementwise_bytes_per_token(m, "selective")
    spec = ballonet.model("llama-7b", recompute="selective", recompute_layers=5)
    assert recompute_layer_count(spec) == 5 and recompute_layer_count(spec, "selective") == L
    assert activation_bytes_per_token(spec) == activation_bytes_per_token(m, "selective", 5)
    assert recompute_layer_count(m, "none") == 0 and recompute_layer_count(m, "full") == L


def _selective_layers(model, tokens, gpus, num_dp):
    """The most layers any rank recomputes selectively under `layers_per_rank`, or None."""
    found = layers_per_rank(model, tokens, gpus, num_dp, mode="selective")
    return None if found is None else max(k for _, k in found)


def _cheapest(model, tokens, gpus, num_dp):
    """(mode, the most layers any rank recomputes under it) of `cheapest_per_rank`."""
    found = cheapest_per_rank(model, tokens, gpus, num_dp)
    return None if found is None else tuple(heaviest(found[1]))


def test_the_fewest_selective_layers_that_fit_are_chosen():
    """`layers_per_rank` under "selective" gives the least k under which every rank fits:
    k - 1 does not."""
    gpus = [hardware.gpu("h100")] * 2
    cap = memory_cap(LLAMA7B, gpus[0], 2)
    per_none = activation_bytes(LLAMA7B, 1, 1, "none")
    fits_none = int(cap / per_none)
    assert _selective_layers(LLAMA7B, [fits_none, 10], gpus, 2) == 0
    assert _cheapest(LLAMA7B, [fits_none, 10], gpus, 2) == ("none", 0)
    tokens = [int(fits_none * 1.2), 10]
    k = _selective_layers(LLAMA7B, tokens, gpus, 2)
    assert 1 <= k < LLAMA7B.num_layers
    assert activation_bytes(LLAMA7B, tokens[0], tokens[0], "selective", k) <= cap
    assert activation_bytes(LLAMA7B, tokens[0], tokens[0], "selective", k - 1) > cap
    assert _cheapest(LLAMA7B, tokens, gpus, 2) == ("selective", k)
    fixed = ballonet.model("llama-7b", recompute="selective")
    assert _cheapest(fixed, tokens, gpus, 2) == ("selective", LLAMA7B.num_layers)
    too_many = int(cap / activation_bytes(LLAMA7B, 1, 1, "selective")) + 10
    assert _selective_layers(LLAMA7B, [too_many], gpus[:1], 2) is None


def test_each_rank_recomputes_as_little_as_its_own_tokens_need():
    """`layers_per_rank`: a rank that holds its tokens as they are recomputes nothing;
    one over that, the fewest first layers selectively; one over what selective on every
    layer holds, the fewest first layers' linear work (the others selectively). The mode
    of the plan is the costliest any rank needs; a model that fixes its mode gets it on
    every rank and layer."""
    gpus = [hardware.gpu("h100")] * 3
    cap = memory_cap(LLAMA7B, gpus[0], 3)
    per_token = {m: activation_bytes(LLAMA7B, 1, 1, m) for m in ("none", "selective", "linear", "full")}
    assert per_token["none"] > per_token["selective"] > per_token["linear"] > per_token["full"]
    tokens = [int(cap / per_token["none"]), int(cap / per_token["none"] * 1.3), int(cap / per_token["selective"] * 1.2)]
    per_rank = layers_per_rank(LLAMA7B, tokens, gpus, 3)
    assert [m for m, _ in per_rank] == ["none", "selective", "linear"], per_rank
    for n, (m, k) in zip(tokens[1:], per_rank[1:]):
        assert 1 <= k < LLAMA7B.num_layers
        assert activation_bytes(LLAMA7B, n, n, m, k) <= cap < activation_bytes(LLAMA7B, n, n, m, k - 1)
    assert cheapest_per_rank(LLAMA7B, tokens, gpus, 3) == ("linear", tuple(per_rank))
    assert _cheapest(LLAMA7B, tokens, gpus, 3) == ("linear", per_rank[2][1])
    assert layers_per_rank(LLAMA7B, tokens, gpus, 3, mode="selective") is None
    fixed = ballonet.model("llama-7b", recompute="selective")
    assert cheapest_per_rank(fixed, tokens[:2], gpus[:2], 3) == ("selective", (("selective", 32),) * 2)


@pytest.mark.parametrize("name", sorted(specs.MODELS))
def test_each_recomputation_mode_frees_memory_dearer_than_the_one_below(name):
    """What makes the bound's recomputation a bound (`batch_recomputation`): per byte a
    layer frees, linear recomputation reruns more FLOPs than selective, and selective more
    than none, so the least any plan of mixed ranks recomputes climbs the modes in order."""
    m = ballonet.model(name)
    freed = {mode: activation_bytes_per_token(m, BELOW[mode]) - activation_bytes_per_token(m, mode)
             for mode in ("selective", "linear")}
    flops = {mode: recompute_flops_per_token(m, mode) - recompute_flops_per_token(m, BELOW[mode])
             for mode in ("selective", "linear")}
    assert all(freed[x] > 0 and flops[x] > 0 for x in freed)
    assert flops["selective"] / freed["selective"] < flops["linear"] / freed["linear"]


def test_the_batch_bound_assumes_the_fewest_layers_the_cluster_needs():
    """Under total capacity for `none` the bound recomputes nothing; a bit over it, a few
    selective layers (not all of them) as a mean over the tokens, not rounded up (ranks
    recompute on as few layers as their own tokens need), and the bound lies between."""
    cluster = ballonet.cluster("h800-8nic", num_nodes=1)
    gpus = [cluster.gpu_of(r) for r in range(cluster.num_ranks)]
    capacity = sum(memory_cap(LLAMA7B, g, cluster.num_ranks) for g in gpus)
    fits = int(capacity / activation_bytes_per_token(LLAMA7B, "none"))
    assert batch_recomputation([fits // 8] * 8, cluster, LLAMA7B) == ("none", 0)
    over = [int(fits * 1.1) // 8] * 8
    mode, k = batch_recomputation(over, cluster, LLAMA7B)
    assert mode == "selective" and 0 < k < LLAMA7B.num_layers and k != int(k)
    assert capacity / activation_bytes_per_token(LLAMA7B, "selective", k) == pytest.approx(sum(over), rel=1e-12)
    every = ballonet.model("llama-7b", recompute="selective")
    rounded = ballonet.model("llama-7b", recompute="selective", recompute_layers=math.ceil(k))
    assert batch_lower_bound(over, cluster, LLAMA7B) < batch_lower_bound(over, cluster, rounded) \
        < batch_lower_bound(over, cluster, every)


def test_one_document_costs_the_fewest_selective_layers_that_hold_it():
    """`ballonet cost`'s figures (`sequence_cost`): a document just over what one GPU holds
    without recomputation recomputes a few layers' MLP, and its activations then fit."""
    group = ballonet.cluster("a800-4nic", num_nodes=1).groups[0]
    cap = memory_cap(LLAMA7B, group.gpu_type, group.gpus_per_node)
    length = int(cap / activation_bytes_per_token(LLAMA7B, "none") * 1.05)
    cost = sequence_cost(LLAMA7B, group, length)
    assert cost.recompute == "selective" and 1 <= cost.recompute_layers < LLAMA7B.num_layers
    assert cost.activation_bytes <= cap < activation_bytes_per_token(LLAMA7B, "none") * length
    every = sequence_cost(ballonet.model("llama-7b", recompute="selective"), group, length)
    assert every.recompute_layers == LLAMA7B.num_layers and cost.step_time_s < every.step_time_s
