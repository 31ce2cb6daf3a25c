"""Every random generator a rank draws from, seeded and saved so a resumed run draws the same.

Python's, numpy's (augmentations, mixup) and torch's, plus the current GPU's on a GPU: dropout
and stochastic depth draw from the device's generator there. The checkpoint keeps each rank's
:func:`rng_state`; the loader's own order is kept by the loader.
"""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """This rank's random generators. On a GPU, dropout and stochastic depth draw from the
    device's generator, so it is kept too, or a resumed run would draw other masks."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # not when a GPU run resumes on a CPU
        torch.cuda.set_rng_state(state["cuda"])
