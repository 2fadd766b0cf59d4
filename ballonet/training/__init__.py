"""Training: the Llama-style model on the plan's two layouts (`model.py`), corpora
(`corpus.py`), the planned, resumable loader (`loader.py`), FSDP2 sharding and mixed
precision (`parallel.py`), sharded checkpoints (`checkpoint.py`), step metrics and
budgets (`metrics.py`), the run configuration (`config.py`) and the loop under torchrun
(`loop.py`, `launch.py`)."""
