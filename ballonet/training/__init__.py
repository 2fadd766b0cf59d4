"""Training: the Llama-style model on the plan's two layouts (`model.py`), corpora
(`corpus.py`), the planned, resumable loader (`loader.py`), checkpoints, the run
configuration (`config.py`) and the loop under torchrun (`loop.py`, `launch.py`)."""
