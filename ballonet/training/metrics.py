"""What a training step reports beyond its loss: model FLOPs and MFU, memory high-water
mark, exposed communication; and the budgets a run is checked against before any batch
is built.

MFU = model FLOPs of the step (forward and backward, recomputation not counted, as in
PaLM's definition) / (step seconds x the ranks' summed peak FLOP/s). FLOPs come from the
cost model: linear layers and attention per layer (`cost.flops.linear_flops_per_token`,
`cost.flops.attention_flops`, backward `cost.flops.LINEAR_BACKWARD_FACTOR` times forward)
plus the LM head, the same closed form the simulator uses for its MFU. The peak is the
calibration profile's (`--calibration`) or the datasheet figure (`cost.hardware`).
"""

from __future__ import annotations

import math
import resource
import sys

import torch

from ballonet import calibration
from ballonet.cost import hardware
from ballonet.cost.flops import LINEAR_BACKWARD_FACTOR, attention_flops, linear_flops_per_token
from ballonet.cost.memory import activation_bytes_per_token
from ballonet.errors import InputError
from ballonet.specs import ClusterSpec, ModelSpec

LOGIT_COPIES = 3
"""fp32 logits, their log-softmax and its gradient: held at once around the loss."""


def step_flops(model: ModelSpec, lengths) -> float:
    """Forward + backward model FLOPs of one global batch of documents of `lengths`."""
    num_tokens = sum(lengths)
    forward = (model.num_layers * (linear_flops_per_token(model) * num_tokens
                                   + sum(attention_flops(model, n) for n in lengths))
               + 2.0 * model.vocab_size * model.hidden * num_tokens)
    return (1 + LINEAR_BACKWARD_FACTOR) * forward


def peak_flops(cluster: ClusterSpec, profile_path: str | None = None) -> float:
    """Summed datasheet peak FLOP/s of the cluster's ranks. A calibration profile
    (`ballonet.calibration`, `--calibration`) names the GPU type actually measured: its
    peak then counts for every rank (MFU stays relative to the datasheet peak, the usual
    definition; the profile's efficiencies are what the cost model prices with)."""
    gpus = [g.gpu for g in cluster.groups for _ in range(g.num_nodes * g.gpus_per_node)]
    if profile_path is not None:
        gpus = [calibration.load(profile_path).gpu] * len(gpus)
    return sum(hardware.gpu(name).peak_flops for name in gpus)


def plan_profile(cluster: ClusterSpec, profile_path: str | None):
    """The profile the run plans with (`--calibration`), None without one. Its GPU type
    must be one of the cluster's: its efficiencies are fractions of that GPU's peak."""
    if profile_path is None:
        return None
    profile = calibration.load(profile_path)
    types = sorted({g.gpu for g in cluster.groups})
    if profile.gpu not in types:
        raise InputError(f"--calibration {profile_path}: measures a {profile.gpu} GPU, the cluster has "
                         f"{', '.join(types)}; plan on a cluster of the GPU measured (--cluster)")
    return profile


def memory_high_water(device: torch.device) -> int:
    """Peak bytes: allocated by the CUDA caching allocator, or the process's peak RSS on CPU
    (with the heap a CPU rank warms before its first step, `host.warm_heap`)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


# ---- budgets ---------------------------------------------------------------------------


def training_bytes_per_token(model: ModelSpec) -> float:
    """Activation bytes a GPU holds per token of its plan rank's share: the cost model's,
    under the spec's recomputation, dtype and tensor parallelism
    (`cost.memory.activation_bytes_per_token`), plus the fp32 logits around the loss (its
    1/tp of the vocabulary with tensor parallelism)."""
    return activation_bytes_per_token(model) + LOGIT_COPIES * 4 * model.vocab_size / model.tp


def check_budget(model: ModelSpec, cluster: ClusterSpec, global_tokens: int, world_size: int, shard: str) -> None:
    """Refuse, before any batch is built, a global batch whose even share per plan rank
    cannot fit the smallest device's memory (fp32 weights, gradients and Adam states
    included, sharded or not, split over a plan rank's `model.tp` ranks): a lower bound, as
    a plan's busiest rank holds more."""
    tokens_per_rank = math.ceil(global_tokens / (world_size // model.tp))
    weights = model.num_params * (4 + 4 + 8) / (world_size if shard == "full" else model.tp)
    need = tokens_per_rank * training_bytes_per_token(model) + weights
    have = min(g.gpu_type.memory_bytes for g in cluster.groups)
    if need > have:
        raise InputError(f"--global-tokens {global_tokens}: {tokens_per_rank} tokens per rank need at least "
                         f"{need / 2**30:.3g} GiB on each of {world_size} ranks, over the {have / 2**30:.3g} GiB "
                         f"of a {cluster.groups[0].gpu} (fewer tokens, more ranks, or --recompute full)")
