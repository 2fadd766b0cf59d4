"""Adapters that run other libraries' models on Ballonet plans (optional extras).

`ballonet.integrations.hf`: Hugging Face transformers models (`pip install ballonet[hf]`).
"""
