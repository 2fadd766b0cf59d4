"""The cost model: what the pieces of a training step cost, in FLOPs, bytes and seconds.

    hardware.py   GPU types (datasheet figures) and the profile that prices each
    profiles.py   the built-in calibration profiles, with their sources
    flops.py      FLOPs and bytes: exact functions of the model shape
    memory.py     what a rank holds, by recomputation mode, and its cap
    recompute.py  which recomputation a plan takes, per rank, and what it reruns
    seconds.py    calibrated seconds of kernels and links; break-even chunks; one document's cost
    tensor_parallel.py  the tensor-parallel collectives of a step: bytes and seconds
    bounds.py     the batch lower bound no plan can beat

Closed forms first, calibration second (`ballonet.calibration` measures a profile). Pure
functions of specs and token counts; no module here imports planning or anything above it.
This file imports nothing: `specs` imports `hardware`, and the other modules import `specs`.
"""
