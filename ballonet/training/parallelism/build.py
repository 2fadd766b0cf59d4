"""The model a run trains, built on the meta device, split (tensor parallelism, then FSDP2)
and only then given memory: each rank materialises its own shards, never the whole model.

    meta model -> tensor_parallel (tp > 1) -> parallel.parallelize (FSDP2) -> to_empty ->
    the built-in model: `Transformer.reset_parameters` (each parameter drawn whole, one at
    a time, this rank's shard kept: the weights of the model built whole, seed for seed);
    a Hugging Face model with weights: `hf_model.load_shards` (each shard read alone from
    the safetensors files).

A rank's memory while setting up is its shards plus one whole parameter (the largest: the
embedding or the head), not the model (tests/test_meta_init.py measures it). A Hugging
Face folder without weights is built whole from the seed, as `from_config` draws it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ballonet.integrations import hf_model
from ballonet.specs import ModelSpec
from ballonet.training.parallelism import parallel, tensor_parallel
from ballonet.training.config import TrainConfig
from ballonet.training.parallelism.model import build_model

META = torch.device("meta")


def build_sharded_model(config: TrainConfig, spec: ModelSpec, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """`config.model` built on the meta device, split over `mesh` (tensor parallelism when
    `config.tp` > 1, then FSDP2 in `config.dtype`) and materialised shard by shard on
    `device`: the weights those of the model built whole from `config.seed` (or read from
    its Hugging Face folder)."""
    hf = hf_model.is_hf(config.model)
    if hf and not hf_model.has_weights(config.model):  # drawn whole by transformers' own init
        model = hf_model.build_model(config.model, config.seed, device, config.recompute, config.recompute_layers)
        return _split(model, config, mesh, hf)
    if hf:
        model = hf_model.build_model(config.model, config.seed, META, config.recompute, config.recompute_layers)
    else:
        model = build_model(config, spec, META)
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # real: only parameters are on meta
    _split(model, config, mesh, hf)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    if hf:
        hf_model.load_shards(model, config.model)
    else:
        model.reset_parameters(config.seed)
    return model


def _split(model: nn.Module, config: TrainConfig, mesh: DeviceMesh, hf: bool) -> nn.Module:
    if config.tp > 1:
        (tensor_parallel.parallelize_hf if hf else tensor_parallel.parallelize_transformer)(model, mesh["tp"])
    return parallel.parallelize(model, mesh, config.dtype)
