"""Training under torchrun: the loop and what it shares at this level (`loop.py`,
`preflight.py`, `evaluation.py`, `optim.py`, `logs.py`, `metrics.py`, `config.py`,
`config_file.py`), and one sub-package per concern: `data/` (corpora, the loader),
`parallelism/` (the model, FSDP2, tensor parallelism, the sharded build), `checkpoints/`
(DCP saves, safe loading, the Hugging Face export) and `jobs/` (launch, the rank's host
settings, the lease). Dependencies point one way: loop, preflight, then evaluation, logs
and optim, checkpoints, parallelism, data beside jobs, metrics, config (`.importlinter`)."""
