"""The runtime: a plan executed on torch.distributed. Depends on `ballonet.plan` only.

`engine.py` runs distributed variable-length attention (ring queues per split document,
`ring.py`; routed inter-node hops, `routing.py`; kernels, `kernels.py`); `remapping.py`
moves tokens between the attention and the token-balanced linear layout.
"""

from ballonet.runtime.comm import ByteCounter, check_plan
from ballonet.runtime.engine import attention
from ballonet.runtime.layout import doc_ids, position_ids, token_index
from ballonet.runtime.remapping import remap

__all__ = ["attention", "check_plan", "ByteCounter", "token_index", "position_ids", "doc_ids", "remap"]
