"""Page-locking a process batcher's results areas (``cudaHostRegister``), so that the GPU copies a batch's outputs
straight into the shared memory. torch is imported only when a batcher on a GPU calls these."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def page_lock(areas: list[np.ndarray], device: Any) -> int | None:
    """Page-lock the results areas (``cudaHostRegister``, one range: they are the last fields of the layout, from a
    page on) so that the GPU copies into them at full speed and without holding the host: the range's address, or
    None when CUDA refuses (the answers then go through the context's own pinned buffers into the slots). From a
    thread of its own: a refusal leaves CUDA's last error set on the calling thread, where torch's next check of a
    kernel launch would report it. In ``device``'s context (the engines' GPU; None: the current one)."""
    import torch

    if not torch.cuda.is_available():  # engines that say they queue on a GPU, on a machine without one (tests)
        return None
    start = min(a.__array_interface__["data"][0] for a in areas)
    end = max(a.__array_interface__["data"][0] + a.nbytes for a in areas)
    result: list[Any] = []

    def register() -> None:
        with _on(device):  # a new thread's current device is 0
            result.append(torch.cuda.cudart().cudaHostRegister(start, end - start, 1))  # 1: portable

    thread = threading.Thread(target=register, name="trtc-page-lock")
    thread.start()
    thread.join()
    error = result[0] if result else "no answer (see the thread's exception above)"
    if getattr(error, "value", error) != 0:
        log.info("CUDA cannot page-lock the batcher's results areas (%s); answers are copied into the slots", error)
        return None
    return start


def page_unlock(address: int, device: Any) -> None:
    import torch

    with _on(device):
        torch.cuda.cudart().cudaHostUnregister(address)


def _on(device: Any) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)``, or nothing for None (the current device)."""
    import torch

    return contextlib.nullcontext() if device is None else torch.cuda.device(device)
