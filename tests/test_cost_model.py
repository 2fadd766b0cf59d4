import csv

import pytest

import ballonet
from ballonet import cost_model as cm
from ballonet import hardware
from ballonet.specs import ModelSpec

LLAMA7B = ballonet.model("llama-7b")
LLAMA3 = ballonet.model("llama3-8b")


def test_flops_by_hand():
    # Causal attention, 32 heads x 128: 2 matmuls * 2 FLOPs * 4096 * (1024 * 1025 / 2) pairs.
    assert cm.attention_flops(LLAMA7B, 1024) == 2 * 2 * 4096 * 1024 * 1025 / 2
    # One full 100 x 300 block: 2 matmuls * 2 FLOPs * 4096 * 30000.
    assert cm.block_flops(LLAMA7B, 100, 300) == 4 * 4096 * 30000
    # Per token: QKV 4096*(4096+2*4096), O 4096^2, SwiGLU 3*4096*11008; 2 FLOPs per weight.
    assert cm.linear_flops_per_token(LLAMA7B) == 404_750_336
    # GQA: K and V are 8 heads of 128, so QKV is 4096*(4096+2048).
    assert cm.linear_flops_per_token(LLAMA3) == 2 * (4096 * 6144 + 4096**2 + 3 * 4096 * 14336)


def test_zigzag_chunks_add_up_to_the_whole_causal_document():
    L, g = 1000, 4
    bounds = tuple(L * j // (2 * g) for j in range(2 * g + 1))
    total = sum(cm.zigzag_rank_flops(LLAMA7B, bounds, i) for i in range(g))
    assert total == cm.attention_flops(LLAMA7B, L)
    # Zig-zag balances causal work: every position within 2% of the mean.
    shares = [cm.zigzag_rank_flops(LLAMA7B, bounds, i) for i in range(g)]
    assert max(shares) / min(shares) < 1.02


def test_bytes_by_hand():
    assert cm.kv_bytes(LLAMA3, 100) == 2 * 100 * 1024 * 2
    assert cm.kv_bytes(ballonet.model("llama-13b", tp=2), 10) == 2 * 10 * 5120 * 2 / 2
    assert cm.hidden_bytes(LLAMA7B, 10) == 10 * 4096 * 2
    assert cm.activation_bytes_per_token(LLAMA7B) == 32 * 4096 * 2 + 34 * 4096


def _calibration_model():
    # The shape in h100_attention_latency.csv: 64 query heads, 4 KV heads, head dim 128.
    return ModelSpec(name="calib", num_layers=1, hidden=64 * 128, num_heads=64, num_kv_heads=4,
                     ffn_hidden=1, vocab_size=1)


def test_attention_latency_within_25_percent_of_h100_measurements(shared_data):
    model, h100 = _calibration_model(), hardware.gpu("h100")
    with open(shared_data / "calibration" / "h100_attention_latency.csv") as f:
        rows = [r for r in csv.DictReader(f) if int(r["seq_len"]) >= 512]
    assert len(rows) >= 6
    for r in rows:
        L, measured = int(r["seq_len"]), float(r["latency(ms)"]) * 1e-3
        predicted = cm.attention_time(model, h100, cm.attention_flops(model, L), L)
        assert abs(predicted / measured - 1) <= 0.25, (L, predicted, measured)


def test_nccl_within_25_percent_at_64mb_and_above(shared_data):
    bw = hardware.gpu("h100").intra_link_bw
    checked = 0
    with open(shared_data / "calibration" / "h100_nccl_perf.csv") as f:
        for r in csv.DictReader(f):
            size = int(r["size_bytes"])
            if size < 64 * 2**20:
                continue
            predicted = cm.collective_time(r["op"], size, int(r["ngpu"]), bw)
            for col in ("t_us_out", "t_us_in"):
                measured = float(r[col]) * 1e-6
                assert abs(predicted / measured - 1) <= 0.25, (r["op"], r["ngpu"], size, predicted, measured)
                checked += 1
    assert checked >= 40


def test_linear_time_matches_megatron_projection(shared_data):
    # h100_megatron_layer_ops.tsv, TP=1 CP=1: output projection of 32K tokens, hidden 4096.
    with open(shared_data / "calibration" / "h100_megatron_layer_ops.tsv") as f:
        row = next(r for r in csv.DictReader(f, delimiter="\t") if r["tp"] == "1" and r["cp"] == "1")
    measured = float(row["megatron.core.transformer.attention.forward.linear_proj_1"]) * 1e-3
    flops = 2 * 32768 * 4096 * 4096
    predicted = flops / (989e12 * hardware.linear_efficiency(32768))
    assert abs(predicted / measured - 1) < 0.05


def test_breakeven_follows_the_closed_form():
    # c* ~ F * h_kv * bytes / (2 * h * BW): a NIC (25 GB/s) needs far longer chunks than NVLink,
    # and GQA (4x fewer KV bytes per token) needs shorter ones than MHA.
    a800 = hardware.gpu("a800")
    nvlink = cm.breakeven_chunk_tokens(LLAMA7B, a800, a800.intra_link_bw)
    nic = cm.breakeven_chunk_tokens(LLAMA7B, a800, 25e9, nic=True)
    gqa = cm.breakeven_chunk_tokens(LLAMA3, a800, 25e9, nic=True)
    assert nic > 5 * nvlink
    assert gqa < nic / 2
    # At the crossover, compute and transfer of one step agree within a few percent.
    c = nic
    compute = cm.attention_time(LLAMA7B, a800, cm.block_flops(LLAMA7B, c, c), c)
    transfer = cm.p2p_time(cm.kv_bytes(LLAMA7B, c), 25e9, nic=True)
    assert compute == pytest.approx(transfer, rel=0.05)


def test_shared_nic_slows_the_gradient_allreduce():
    one_nic_each = ballonet.cluster("h800-8nic", num_nodes=2)
    shared = ballonet.cluster("h800-8nic", num_nodes=2, nics_per_node=4)
    assert cm.grad_allreduce_time(LLAMA7B, shared) > cm.grad_allreduce_time(LLAMA7B, one_nic_each)
    single_node = ballonet.cluster("h800-8nic", num_nodes=1)
    assert cm.grad_allreduce_time(LLAMA7B, single_node) < cm.grad_allreduce_time(LLAMA7B, one_nic_each)
