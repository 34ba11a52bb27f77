"""The one tensor copy the vLLM and SGLang integrations make per object and layer, CPU tensors by numpy.

torch's ``copy_`` opens an OpenMP parallel region on every call; on the 2 shared, busy cores of
the CI machine, gathering a save of 16 × 1 MiB blocks into reserved arena extents with one
``copy_`` per block took 2.7 ms at best but 220-320 ms at the median (the regions' threads
waiting for cores), numpy's single-threaded ``copyto`` of the same 3.3 ms at best and 11-15 ms at
the median.  :func:`host_array` goes further for vLLM's per-(block, layer) copies: the cache's
memory as numpy, made once, so a copy costs no torch call at all.  Loaded by the engine modules
only (imports torch).
"""

from __future__ import annotations

import numpy as np
import torch

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype of each element size: numpy has no bfloat16 or float8, their bits copy as these."""


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for tensors of one shape and dtype: numpy's copy (any strides) when
    both are in host memory, torch's otherwise (a device tensor)."""
    as_int = _SAME_SIZE_INT.get(dst.element_size())
    if (as_int is None or dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype
            or dst.shape != src.shape):
        dst.copy_(src)
        return
    np.copyto(dst.view(as_int).numpy(), src.view(as_int).numpy())


def host_array(t: torch.Tensor) -> np.ndarray | None:
    """``t``'s memory as a numpy array (of a same-size integer dtype: its bits), or None for a
    device tensor or an element size numpy has no integer for.  Writes through it change ``t``."""
    as_int = _SAME_SIZE_INT.get(t.element_size())
    if as_int is None or t.device.type != "cpu":
        return None
    arr: np.ndarray = t.detach().view(as_int).numpy()
    return arr
