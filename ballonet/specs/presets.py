"""The cluster and model presets `specs.cluster` and `specs.model` know by name."""

from __future__ import annotations

from ballonet.specs.cluster_spec import ClusterSpec, NodeGroup
from ballonet.specs.model_spec import ModelSpec

def _group(gpu, **kw) -> NodeGroup:
    return NodeGroup(gpu=gpu, **kw)


CLUSTERS: dict[str, ClusterSpec] = {
    c.name: c
    for c in [
        # Zeppelin cluster A: A800, 8 GPUs and 4x200 Gb/s RoCE NICs per node.
        ClusterSpec(name="a800-4nic", groups=(_group("a800", num_nodes=2, nics_per_node=4, nic_gbps=200),)),
        # Cluster B: H800, 8 NICs per node (400 Gb/s each).
        ClusterSpec(name="h800-8nic", groups=(_group("h800", num_nodes=2, nics_per_node=8, nic_gbps=400),)),
        # Cluster C: H200, 8x400 Gb/s NICs per node.
        ClusterSpec(name="h200-8nic", groups=(_group("h200", num_nodes=2, nics_per_node=8, nic_gbps=400),)),
        # Training nodes plus inference nodes loaned at off-peak hours (issue: heterogeneous
        # clusters). Inference nodes typically carry fewer, slower NICs.
        ClusterSpec(name="h800+h20", groups=(_group("h800", num_nodes=2, nics_per_node=8, nic_gbps=400),
                                             _group("h20", num_nodes=2, nics_per_node=4, nic_gbps=200, loaned=True))),
        ClusterSpec(name="a800+l40s", groups=(_group("a800", num_nodes=2, nics_per_node=4, nic_gbps=200),
                                              _group("l40s", num_nodes=2, nics_per_node=2, nic_gbps=200,
                                                     loaned=True))),
        # Emulated runs on CPU processes (gloo): small nodes, one "NIC" per GPU.
        ClusterSpec(name="cpu", groups=(_group("cpu", num_nodes=2, gpus_per_node=2, nics_per_node=2, nic_gbps=10),)),
    ]
}

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        # LLaMA-1 shapes (Touvron et al. 2023); 3B as OpenLLaMA-3B.
        ModelSpec(name="llama-3b", num_layers=26, hidden=3200, num_heads=32, num_kv_heads=32,
                  ffn_hidden=8640, vocab_size=32000),
        ModelSpec(name="llama-7b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=32,
                  ffn_hidden=11008, vocab_size=32000),
        ModelSpec(name="llama-13b", num_layers=40, hidden=5120, num_heads=40, num_kv_heads=40,
                  ffn_hidden=13824, vocab_size=32000),
        ModelSpec(name="llama-30b", num_layers=60, hidden=6656, num_heads=52, num_kv_heads=52,
                  ffn_hidden=17920, vocab_size=32000),
        ModelSpec(name="llama3-8b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
                  ffn_hidden=14336, vocab_size=128256),
        # Trains on CPU in seconds; byte-level vocabulary.
        ModelSpec(name="tiny", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                  ffn_hidden=176, vocab_size=256, dtype_bytes=4),
        # Llama-3.2-1B shapes (untied head): the one-GPU training check.
        ModelSpec(name="llama3-1b", num_layers=16, hidden=2048, num_heads=32, num_kv_heads=8,
                  ffn_hidden=8192, vocab_size=128256),
    ]
}
