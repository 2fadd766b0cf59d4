"""The runtime: a plan executed on torch.distributed. Depends on `ballonet.plan` only."""

from ballonet.runtime.layout import doc_ids, position_ids, token_index

__all__ = ["token_index", "position_ids", "doc_ids"]
