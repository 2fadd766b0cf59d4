"""The runtime: a plan executed on torch.distributed. Depends on `ballonet.plan` only."""

from ballonet.runtime.attention import attention
from ballonet.runtime.comm import ByteCounter, check_plan
from ballonet.runtime.layout import doc_ids, position_ids, token_index
from ballonet.runtime.remap import remap

__all__ = ["attention", "check_plan", "ByteCounter", "token_index", "position_ids", "doc_ids", "remap"]
