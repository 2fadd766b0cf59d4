"""Per-step metadata: everything the layers read is built once per step (by the loader's
prefetch thread), staged with the tokens and moved to the device in one copy, and the
layer path (every layer's remaps, rings, relays and kernels, forward and backward) makes
no host-device copy and reads nothing back from the device.

On the CPU there is no device to copy to, so the layer path's copies are counted at the
Python and dispatcher level: `torch.tensor`/`as_tensor`/`from_numpy`, `Tensor.to` with a
device, `.cpu()`, `.cuda()`, `.tolist()`, `.item()` (aten `_local_scalar_dense`) and
`nonzero` (a data-dependent shape: a sync on a GPU). On a GPU, scripts/gpu_check.sh runs a
training step under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter

import pytest
import torch
from distributed import run_ranks
from plans_by_hand import remap_plan
from tiny_model import SPEC
from torch.utils._python_dispatch import TorchDispatchMode

import ballonet
from ballonet import runtime
from ballonet.runtime import engine, remapping, step
from ballonet.runtime.staging import _leaves, stage
from ballonet.training.data import loader as loader_module
from ballonet.training.data.corpus import load_corpus
from ballonet.training.data.loader import BalancedLoader
from ballonet.training.parallelism.model import Transformer


def test_a_tree_moves_in_one_copy():
    tree = (runtime.step_meta(remap_plan(), 0), torch.arange(7) * 3, torch.ones(3, dtype=torch.bool))
    staged = stage(tree)
    copies = []
    to = torch.Tensor.to
    torch.Tensor.to = lambda self, *a, **k: copies.append(a) or to(self, *a, **k)
    try:
        on_meta = staged.to("meta")
    finally:
        torch.Tensor.to = to
    assert len(copies) == 1
    leaves = []
    _leaves(on_meta, leaves)
    originals = []
    _leaves(tree, originals)
    assert len(leaves) == len(originals) > 10 and all(t.device.type == "meta" for t in leaves)
    assert [(t.dtype, t.shape) for t in leaves] == [(t.dtype, t.shape) for t in originals]
    # From a copy of the buffer: the same values, as views of that one copy.
    copy = staged.buffer.clone()
    again = []
    _leaves(staged.from_buffer(copy), again)
    assert all(torch.equal(a, b) for a, b in zip(again, originals))
    assert all(t.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr() for t in again if t.numel())
    assert staged.to("cpu") is staged.tree


class _Counter(TorchDispatchMode):
    """Counts, on the thread that made it and while `on`, every call that copies between
    host and device or reads a device value back."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.thread = threading.get_ident()
        self.on = False

    def count(self, what: str) -> None:
        if self.on and threading.get_ident() == self.thread:
            self.calls[what] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in ("_local_scalar_dense", "nonzero", "lift_fresh", "lift_fresh_copy"):
            self.count(f"aten.{name}")
        return func(*args, **(kwargs or {}))


def _moves_device(args, kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


@contextlib.contextmanager
def counting(counter: _Counter):
    """Count the calls named in `_Counter` (Python-level patches and the dispatch mode)."""
    patched = {}

    def patch(owner, name, wrap):
        patched[owner, name] = getattr(owner, name)
        setattr(owner, name, wrap(patched[owner, name]))

    def counted(what, only=None):
        def wrap(fn):
            @functools.wraps(fn)
            def inner(*args, **kwargs):
                if only is None or only(args[1:], kwargs):
                    counter.count(what)
                return fn(*args, **kwargs)
            return inner
        return wrap

    for name in ("tensor", "as_tensor", "from_numpy"):
        patch(torch, name, lambda fn, name=name: (lambda *a, **k: counter.count(f"torch.{name}") or fn(*a, **k)))
    patch(torch.Tensor, "to", counted("Tensor.to(device)", _moves_device))
    for name in ("cpu", "cuda", "tolist", "item"):
        patch(torch.Tensor, name, counted(f"Tensor.{name}"))
    counter.on = True
    try:
        with counter:
            yield counter
    finally:
        counter.on = False
        for (owner, name), fn in patched.items():
            setattr(owner, name, fn)


def _builds() -> tuple[Counter, contextlib.ExitStack]:
    """Count the batches the loader makes, and the metadata builds: `step_meta`, and the
    engine's and the remap's own builders wherever they are looked up."""
    built: Counter = Counter()
    stack = contextlib.ExitStack()
    for owner, name in ((runtime, "step_meta"), (step, "rank_meta"), (engine, "rank_meta"),
                        (step, "plan_move"), (remapping, "plan_move"), (loader_module, "build_batch")):
        fn = getattr(owner, name)

        def wrapped(*args, fn=fn, name=name, **kwargs):
            built[name] += 1
            return fn(*args, **kwargs)

        stack.enter_context(_setattr(owner, name, wrapped))
    return built, stack


@contextlib.contextmanager
def _setattr(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _two_steps(rank: int, world: int, planner: str, layer_meta: bool) -> dict:
    """Two steps of the tiny Llama on `planner`'s plans, the batches from the loader (its
    prefetch thread on): (metadata builds per plan, calls counted in the layer path, what
    the plans hold)."""
    cluster = ballonet.cluster("cpu", num_nodes=2, gpus_per_node=1)
    plan_fn = functools.partial(ballonet.plan_batch, cluster=cluster, model=SPEC, planner=planner,
                                **({"cp_size": 2} if planner == "te_cp" else {}))
    built, stack = _builds()
    model = Transformer(SPEC, seed=3, recompute="full")  # the backward reruns each layer's exchanges
    counter, consumed, kinds = _Counter(), [], set()
    with stack:
        loader = BalancedLoader(load_corpus("stdlib"), global_tokens=1024, plan_fn=plan_fn, rank=rank,
                                world_size=world, seed=3, max_doc_tokens=512)
        for i, batch in enumerate(loader):
            if i == 2:
                break
            meta, ids, labels = batch.staged.to("cpu")  # the one copy (none on the CPU)
            runtime.check_plan(batch.plan, rank, None, ids.device, content=batch.content)
            with counting(counter):
                loss = model.loss(ids, labels, batch.plan, rank, meta=meta if layer_meta else None, verify_plan=False)
                loss.backward()
            consumed.append(batch.plan.digest)
            kinds |= {(r.comm, "remap" if batch.plan.remap else "") for r in batch.plan.rings}
    return {"built": dict(built), "consumed": len(consumed), "calls": dict(counter.calls), "kinds": sorted(kinds)}


def _runs(rank: int, world: int) -> list[dict]:
    return [_two_steps(rank, world, "te_cp", True), _two_steps(rank, world, "distca", True),
            _two_steps(rank, world, "distca", False)]


@pytest.mark.slow
def test_layers_build_nothing_and_copy_nothing():
    results = run_ranks(2, _runs)
    for planner, runs in zip(("te_cp", "distca"), zip(*[r[:2] for r in results])):
        for rank, res in enumerate(runs):
            assert res["calls"] == {}, (planner, rank, res["calls"])
            # One build per batch the loader made (2 used, more taken or prefetched), none elsewhere.
            built = res["built"]
            assert res["consumed"] == 2 and built["build_batch"] >= 2, built
            assert built["step_meta"] == built["rank_meta"] == built["plan_move"] == built["build_batch"], built
            assert res["kinds"] == ([("ring", "")] if planner == "te_cp" else [("allgather", "remap")]), res["kinds"]
    # The counter sees what a layer path that builds its own metadata does (the control).
    res = results[0][2]
    assert res["calls"].get("torch.tensor", 0) > 0
    assert res["built"]["step_meta"] == res["built"]["build_batch"] + 2, res["built"]  # and one per loss call
