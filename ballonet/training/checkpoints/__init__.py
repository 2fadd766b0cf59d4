"""Checkpoints: DCP saves, loading them safely, and the export to Hugging Face."""
