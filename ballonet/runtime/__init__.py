"""The runtime: a plan executed on torch.distributed. Depends on `ballonet.plan` only.

`engine.py` runs distributed variable-length attention (ring queues per split document,
`ring.py`; documents that split their heads, `heads.py`; routed inter-node hops, `routing.py`; transfers posted in rounds, `comm.py`;
kernels, `kernels.py`); `remapping.py` moves tokens between the attention and the
token-balanced linear layout; `step.py` builds what the layers need once per step and
`staging.py` moves it to the device in one copy; `plan_check.py` checks that the ranks
agree before a step's first exchange; `schedule.py` records every rank's transfers and
`replay.py` replays them under NCCL's rules (`ballonet plan --check-schedule`).
"""

from ballonet.runtime.comm import ByteCounter
from ballonet.runtime.engine import attention
from ballonet.runtime.layout import doc_ids, position_ids, token_index
from ballonet.runtime.plan_check import check_plan, content_digest
from ballonet.runtime.remapping import remap
from ballonet.runtime.staging import stage, to_device
from ballonet.runtime.step import StepMeta, step_meta

__all__ = ["attention", "check_plan", "content_digest", "ByteCounter", "token_index", "position_ids", "doc_ids",
           "remap", "stage", "to_device", "StepMeta", "step_meta"]
