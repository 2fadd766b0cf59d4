"""Parallelism: the model and how it is split over ranks (FSDP2, tensor parallel, the build)."""
