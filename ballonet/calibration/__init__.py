"""Calibration: how fast one GPU type runs the pieces of a training step.

    profile.py          the profile schema (`Profile`, `Curve`), its file format and `use`
    settings.py         what a calibration run measures (`Settings`)
    measure_compute.py  attention, GEMMs, elementwise work, the framework and the optimizer,
                        timed with the runtime's own kernels and modules
    measure_links.py    point-to-point, collectives and the overlap slowdown (torchrun)
    calibrate.py        `ballonet calibrate`: measure, build the profile, write it
    compare.py          `ballonet calibrate --compare`: a profile against the built-in one

The schema is part of the contract (the cost model prices with a `Profile`); measuring
sits above the runtime and training, whose kernels and modules it times. The names
re-exported here are the schema's, so `calibration.use(calibration.load(path))` reads as
it runs; importing this package imports no torch.
"""

from ballonet.calibration.profile import COLLECTIVES, SCHEMA_VERSION, Curve, Profile, from_dict, load, override, use

__all__ = ["COLLECTIVES", "SCHEMA_VERSION", "Curve", "Profile", "from_dict", "load", "override", "use"]
