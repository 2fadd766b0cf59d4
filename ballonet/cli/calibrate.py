"""`ballonet calibrate`: measure this machine's kernels and links into a calibration profile
(the work is `ballonet.calibration.calibrate.command`), or compare a profile with the
built-in one (`--compare`, `ballonet.calibration.compare`)."""

from __future__ import annotations

import json

from ballonet.cli.common import positive_int, refuse_unused, stdout_console, subparser
from ballonet.errors import InputError


def register(sub) -> None:
    p = subparser(sub, "calibrate", cmd_calibrate,
                  help="measure this machine's kernels and links; write a calibration profile",
                  description="Time attention (forward and backward), the linear layers and, under torchrun, "
                              "point-to-point, all-to-all and all-reduce, with the runtime's own kernels and "
                              "collectives; write the profile that --calibration FILE reads.")
    p.add_argument("--out", help="write the profile (JSON) to this file")
    p.add_argument("--json", action="store_true", help="print the profile and the raw measurements as JSON")
    p.add_argument("--plot", help="plot measured points and fitted curves to this image file")
    p.add_argument("--quick", action="store_true", help="a few seconds: short lengths, few sizes")
    p.add_argument("--max-length", type=positive_int, default=None, help="longest document timed (tokens)")
    p.add_argument("--gpu", default=None, help="GPU type the profile is for (default: detected; 'cpu' on a CPU)")
    p.add_argument("--model", default=None, help="model whose head shape and layers are timed "
                                                 "(default: tiny on CPU, llama-7b on a GPU)")
    p.add_argument("--cluster", default="cpu", help="cluster preset giving the nominal NIC rate (default: cpu)")
    p.add_argument("--compare", metavar="PROFILE", default=None,
                   help="measure nothing: print PROFILE's figures against the built-in profile of its GPU type "
                        "(a Markdown table)")


def cmd_calibrate(args) -> int:
    if args.compare:
        refuse_unused(args, "--compare", ("out", "json", "plot", "quick", "max_length", "gpu", "model", "cluster"),
                      "measures nothing, it prints a table")
        from ballonet.calibration import load
        from ballonet.calibration.compare import compare

        print("\n".join(compare(load(args.compare))[0]))
        return 0
    from ballonet.calibration import calibrate

    if args.gpu is not None:
        _check_gpu_type(args.gpu)
    measured = calibrate.command(args)
    if measured is None:  # a rank other than 0
        return 0
    profile, raw = measured
    if args.json:
        print(json.dumps({"profile": profile.to_dict(), "measurements": raw}, indent=1, allow_nan=False))
    else:
        _print_summary(profile, args.out, args.plot)
    return 0


def _check_gpu_type(gpu: str) -> None:
    """--gpu names what this machine measures: a GPU type on a GPU, cpu on a CPU (a CPU's
    timings as an h200's profile would price every h200 at a CPU's speed)."""
    import torch

    from ballonet.cost import hardware

    hardware.gpu(gpu)  # an unknown type fails here
    if torch.cuda.is_available() and gpu == "cpu":
        raise InputError("--gpu cpu: this machine measures its GPU; leave --gpu out on a GPU machine, or name its "
                         "GPU type")
    if not torch.cuda.is_available() and gpu != "cpu":
        raise InputError(f"--gpu {gpu}: this machine has no GPU, so it measures its CPU (a profile of 'cpu'); "
                         f"run calibrate on that GPU to profile it")


def _summary(profile) -> list[list[str]]:
    rows = [[f"attention L={int(t)}", f"{f:.4f}", f"{b:.4f}"] for t, f, b in
            zip(profile.attention_forward.tokens, profile.attention_forward.efficiency,
                profile.attention_backward.efficiency)]
    rows += [[f"linear T={int(t)}", f"{e:.4f}", ""] for t, e in zip(profile.linear.tokens, profile.linear.efficiency)]
    rows.append(["p2p latency / efficiency", f"{profile.p2p_latency_s * 1e6:.1f} us", f"{profile.p2p_efficiency:.3f}"])
    return rows


def _print_summary(profile, out: str | None, plot: str | None) -> None:
    try:
        from rich.table import Table
    except ImportError:  # a bare GPU machine
        for row in _summary(profile):
            print(*row, sep="\t")
        return
    table = Table(title=f"calibration of {profile.gpu}: fraction of peak", title_justify="left")
    for col in ("what", "forward", "backward"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for row in _summary(profile):
        table.add_row(*row)
    console = stdout_console()
    console.print(table)
    if out:
        console.print(f"wrote {out}")
    if plot:
        console.print(f"wrote the plot: {plot}")
