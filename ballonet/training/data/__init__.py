"""Training data: corpora, their preparation, and the planned, resumable loader."""
