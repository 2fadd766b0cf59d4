"""Checkpoints: model, optimizer, loader state and RNG of one training run."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

CHECKPOINT = "checkpoint.pt"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(path: str, step: int, model, optimizer, loader) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "loader": loader.state_dict(), "rng": rng_state()}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, device) -> dict:
    return torch.load(path, map_location=device, weights_only=False)
