"""What the links cost on this machine, under torchrun: point-to-point between ranks 0 and
1 (half a round trip), all-to-all and all-reduce over the world by message size, and the
overlap slowdown (compute lost while a collective runs beside it); then the profile's link
figures, latency and bandwidth from a least-squares line t = a + bytes / bw. All ranks of
one host: the NIC figures are these same transfers (the profile's assumptions say so)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from ballonet import specs
from ballonet.calibration.measure_compute import median_s, sync
from ballonet.calibration.settings import Settings
from ballonet.cost.hardware import GPUType


def _fit(sizes, seconds) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of t = a + n / bw, least squares, a >= 0."""
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    return max(float(intercept), 0.0), 1.0 / max(float(slope), 1e-15)


def measure_comm(s: Settings, device: torch.device, progress=None) -> dict:
    """p2p (ranks 0 and 1), all-to-all and all-reduce over the world, by message size."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {"p2p": [], "all_to_all": [], "all_reduce": []}
    for n in s.message_bytes:
        buf = torch.zeros(n // 4, device=device)

        def ping():
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        a2a_in = torch.zeros(world * max(1, n // (4 * world)), device=device)
        a2a_out = torch.empty_like(a2a_in)
        timed = {"p2p": lambda: ping(), "all_to_all": lambda: dist.all_to_all_single(a2a_out, a2a_in),
                 "all_reduce": lambda: dist.all_reduce(buf)}
        for op, fn in timed.items():
            dist.barrier()
            t = median_s(fn, device, s.repeats, wall=True)
            out[op].append({"bytes": n, "seconds": t / 2 if op == "p2p" else t})
        if progress:
            progress()
    out["overlap"] = measure_overlap(s, device)
    return out


def measure_overlap(s: Settings, device: torch.device) -> dict:
    """Compute slowed by communication beside it: wall seconds of a GEMM loop alone, of
    the largest all-reduce alone, and of the GEMM loop while that all-reduce runs."""
    size = 4096 if device.type == "cuda" else 256
    a = torch.randn(size, size, device=device)
    buf = torch.zeros(max(s.message_bytes) // 4, device=device)

    def gemms():
        for _ in range(8):
            a @ a

    def overlapped():
        work = dist.all_reduce(buf, async_op=True)
        gemms()
        sync(device)
        return work

    dist.barrier()
    alone = median_s(gemms, device, s.repeats, wall=True)
    dist.barrier()
    comm = median_s(lambda: dist.all_reduce(buf), device, s.repeats, wall=True)
    times = []
    for _ in range(s.repeats):
        dist.barrier()
        start = time.perf_counter()
        work = overlapped()
        times.append(time.perf_counter() - start)
        work.wait()
    return {"compute_alone_s": alone, "comm_alone_s": comm, "compute_with_comm_s": statistics.median(times)}


def link_figures(s: Settings, comm: dict, gpu: GPUType) -> tuple[dict, list[str]]:
    """The profile's link fields from `measure_comm`'s rows, and the notes that say how."""
    world = dist.get_world_size()
    lat, bw = _fit([r["bytes"] for r in comm["p2p"]], [r["seconds"] for r in comm["p2p"]])
    nic_bw = specs.cluster(s.cluster).groups[0].nic_bw
    coll = {}
    for op, factor in (("all_to_all", (world - 1) / world), ("all_reduce", 2 * (world - 1) / world)):
        c_lat, c_bw = _fit([r["bytes"] * factor for r in comm[op]], [r["seconds"] for r in comm[op]])
        coll[op] = min(1.0, c_bw / gpu.intra_link_bw)
    coll["all_gather"] = coll["reduce_scatter"] = coll["all_reduce"]
    fields = dict(p2p_latency_s=lat, p2p_efficiency=min(1.0, bw / gpu.intra_link_bw), nic_latency_s=lat,
                  nic_efficiency=min(1.0, bw / nic_bw), collective_latency_s=c_lat, collective_efficiency=coll)
    o = comm["overlap"]
    lost = max(0.0, o["compute_with_comm_s"] - o["compute_alone_s"])
    fields["overlap_slowdown"] = lost / max(min(o["comm_alone_s"], o["compute_with_comm_s"]), 1e-12)
    notes = [f"all ranks on one host: NIC figures are the measured point-to-point ones "
             f"({bw / 1e9:.2f} GB/s over the '{s.cluster}' preset's {nic_bw / 1e9:.2f} GB/s NIC)",
             "all_gather and reduce_scatter taken as all_reduce (not measured)",
             "overlap slowdown: GEMMs beside one all-reduce, compute seconds lost per second of overlap"]
    return fields, notes
