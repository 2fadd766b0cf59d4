"""Training end to end with "heads" documents (DeepSpeed-Ulysses inside a PCIe-only node,
issue 48): the trainer (the model's attention layers, FSDP2, AdamW) runs zeppelin's
plans on gloo ranks of one L40S node, and every step's loss and the parameters after the
last step equal the one-process reference on the same global batches
(`training_reference.reference_run`).

How heads gets into the plans: zeppelin alone decides, through the trainer's own
`--calibration` input. With the built-in L40S profile the tiny model's attention at a
few hundred to a thousand tokens costs microseconds, so zeppelin keeps every document
whole (it splits one only past 16K tokens, and then as a ring). The profile here is the
built-in one with its attention kernels at 1/1000 of their efficiency (its other
figures, PCIe p2p included, as they are): a 1K-token document then costs what a long
one does on a real L40S, zeppelin splits it, and the search's last variant
(`pcie_level.by_heads`) prices the split by heads shorter than the ring where the
members divide the K/V heads. On the global batches of `BASE` (documents of 1024, 278,
234 / 790, 746 / 278, 1024, 234 tokens):

* 2 ranks, the tiny model (2 K/V heads): steps 1 and 3 split their 1024-token document
  by heads over both ranks beside two whole documents; step 2 a ring.
* 4 ranks, the tiny model with 4 K/V heads (a model file; with 2, four members do not
  divide them and the 1024-token document runs as a ring): steps 1 and 3 split the
  1024-token document by heads over all four beside two whole documents; step 2 runs
  the 790-token document as a ring over 3 ranks (3 does not divide 4 K/V heads) beside
  the 746-token one split by heads over the other two.

Zeppelin moves no token between the layouts on a PCIe-only node, so these plans have no
remap (asserted): the remap is not what this file checks. The plans are the ones the run
used: each step's plan digest in the log equals that of the plan built here as the
trainer builds it (`preflight`, the profile, `plan_batch`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from distributed import run_ranks
from training_reference import BASE, reference_loader, reference_run

import ballonet
from ballonet import calibration
from ballonet.calibration.profile import Curve
from ballonet.cost import hardware
from ballonet.training.config import TrainConfig
from ballonet.training.loop import train_model
from ballonet.training.preflight import preflight

STEPS = 3
SLOWER_ATTENTION = 1e-3
"""The profile's attention efficiencies against the built-in L40S profile's."""


def _slow_attention(curve: Curve) -> Curve:
    return Curve(tokens=curve.tokens, efficiency=tuple(e * SLOWER_ATTENTION for e in curve.efficiency))


def _config(tmp_path, model: str) -> dict:
    """BASE on one node of L40S (the ranks it is launched with), with the profile."""
    cluster, profile = tmp_path / "l40s.toml", tmp_path / "l40s-profile.json"
    cluster.write_text('[[node_groups]]\ngpu = "l40s"\n')
    built_in = hardware.profile("l40s")
    assert hardware.gpu("l40s").intra_link == "pcie"
    profile.write_text(dataclasses.replace(built_in, attention_forward=_slow_attention(built_in.attention_forward),
                                           attention_backward=_slow_attention(built_in.attention_backward)).to_json())
    return dict(BASE, model=model, cluster=str(cluster), calibration=str(profile), planner="zeppelin")


def _plans(config: dict, world_size: int) -> list:
    """The plans of the first STEPS global batches, built as the trainer builds them."""
    cluster, spec, _ = preflight(TrainConfig(**config), world_size)
    with calibration.use(calibration.load(config["calibration"])):
        return [ballonet.plan_batch(list(b.plan.lengths), cluster=cluster, model=spec, planner="zeppelin")
                for _, b in zip(range(STEPS), reference_loader(**config))]


def _train(rank, world_size, config):
    records, model = train_model(TrainConfig(**config))
    # full_tensor is collective; numpy, as tensors would cross to the parent by file descriptor
    params = {n: p.full_tensor().detach().numpy() for n, p in model.named_parameters()}
    return [r["loss"] for r in records], [r["plan_digest"] for r in records], params


def _comms(plan) -> list:
    return sorted((r.comm, r.ranks) for r in plan.rings)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_training_with_heads_documents_matches_one_process(tmp_path, world_size):
    if world_size == 2:
        model = "tiny"
        heads = [("heads", (0, 1))]
        expected = [heads, [("ring", (0, 1))], heads]
    else:
        model = tmp_path / "tiny-mha.toml"
        model.write_text('base = "tiny"\nnum_kv_heads = 4\n')
        model = str(model)
        heads = [("heads", (0, 1, 2, 3))]
        expected = [heads, [("heads", (0, 3)), ("ring", (0, 1, 2))], heads]
    config = _config(tmp_path, model)
    plans = _plans(config, world_size)
    assert [_comms(p) for p in plans] == expected
    # beside whole documents: steps 1 and 3 hold three, of which the split one
    assert all(len(plans[i].lengths) == 3 and len(plans[i].rings) == 1 for i in (0, 2))
    assert not any(p.remap for p in plans)
    runs = run_ranks(world_size, _train, dict(config, steps=STEPS, log_every=STEPS), timeout=600)
    ref_losses, ref_params = reference_run(STEPS, **config)
    assert ref_losses[-1] < ref_losses[0]  # it learns
    for losses, digests, params in runs:
        assert digests == [p.digest for p in plans]  # the plans above are the ones the run used
        assert all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(losses, ref_losses, strict=True)), (losses, ref_losses)
        for name, p in ref_params.items():
            assert np.abs(params[name] - p.numpy()).max() <= 1e-4, name
