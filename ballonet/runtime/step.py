"""What one rank's layers need for one plan, built once per step.

`step_meta` builds, on the CPU, every tensor the layers read: the attention engine's
rows, index maps and cu_seqlens (`engine.rank_meta`), the remap's index maps
(`remapping.plan_move`) and the RoPE positions of the linear layout. The training
loader builds it in its prefetch thread and stages it (`staging.stage`) with the step's
tokens; one copy puts all of it on the device, and the layers take it from there
(`StepMeta` passed down), so a layer makes no host-device copy and no `.tolist()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ballonet.plan import Plan
from ballonet.runtime.engine import RankMeta, rank_meta
from ballonet.runtime.layout import position_ids
from ballonet.runtime.remapping import Move, plan_move

__all__ = ["StepMeta", "step_meta"]


@dataclass(frozen=True, kw_only=True)
class StepMeta:
    digest: str
    """The plan's digest (`Plan.digest`): the plan this was built for."""
    rank: int
    attention: RankMeta
    to_linear: Move
    """The remap from the attention layout to the linear one."""
    positions: torch.Tensor
    """[T_lin] each token's position within its document, linear layout (RoPE)."""

    @property
    def to_attention(self) -> Move:
        """The remap from the linear layout to the attention one."""
        return self.to_linear.reverse()

    def check(self, plan: Plan, rank: int) -> None:
        if (self.digest, self.rank) != (plan.digest, rank):
            raise ValueError(f"step metadata for rank {self.rank} of plan {self.digest[:12]} used for rank {rank} "
                             f"of plan {plan.digest[:12]}")


def step_meta(plan: Plan, rank: int) -> StepMeta:
    """`rank`'s metadata for `plan`, on the CPU."""
    return StepMeta(digest=plan.digest, rank=rank, attention=rank_meta(plan, rank), to_linear=plan_move(plan, rank),
                    positions=position_ids(plan, rank, "linear"))
