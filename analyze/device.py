"""Where the attention kernels of the analyses run (option ``device`` of ``replay`` and ``norms``).

- ``"cpu"`` (the library's default): numpy, float32; torch is not needed.
- ``"cuda"``, ``"cuda:N"``: torch on that GPU (``analyze/torch_kernels.py``), float32 with TF32 off,
  the same definitions: every score, softmax and change of the numpy kernels, and every count and
  critical level from the same float64 comparisons of the float32 dot products. Results equal the
  numpy path's within float32 rounding (each is checked against float64 at the suite's attention
  tolerance, 1e-5 for logits up to 32, growing with them beyond); a count can differ only where a
  float32 near-tie or a value on a threshold rounds the other way.
- ``"cpu-torch"``: the torch kernels on the CPU, to check them without a GPU (the suite does).
- ``"auto"`` (the CLI's default, as for the model): ``"cuda"`` where torch sees a CUDA device, else
  ``"cpu"``.

Only the dense attention work moves to the device (the clean attention, the smooth summaries' perturbed
softmax, the attention each key receives); the noise draws, the critical levels of the sparse instances
and every reduction into results stay on the CPU in float64.
"""
from __future__ import annotations

import glob
import re
import sys

from .errors import AnalysisError

DEVICE_FORM = re.compile(r"^(auto|cpu|cpu-torch|cuda(:\d+)?)$")


def check_device(name: str, value) -> None:
    """The option's form: auto, cpu, cpu-torch, cuda or cuda:N."""
    if not isinstance(value, str) or not DEVICE_FORM.match(value):
        raise AnalysisError(
            f"option {name}={value!r}: expected auto, cpu (numpy), cpu-torch (the torch kernels on the CPU), "
            "cuda or cuda:N"
        )


def resolve_device(value: str) -> str:
    """The device the kernels run on, checked on this machine: "cpu" (numpy) or a torch device name.
    "auto" on a machine without an NVIDIA device file (no /dev/nvidia0, ...) is "cpu" without importing
    torch, which would cost seconds for nothing."""
    check_device("device", value)
    if value == "cpu" or (value == "auto" and "torch" not in sys.modules and not glob.glob("/dev/nvidia[0-9]*")):
        return "cpu"
    try:
        import torch
    except ModuleNotFoundError:
        if value == "auto":
            return "cpu"
        raise AnalysisError(
            f"device={value!r} runs the attention kernels with torch, which is not installed: install it "
            "(pip install 'orthosphere[extract]') or use device=cpu (numpy)"
        ) from None
    if value == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value.startswith("cuda"):
        if not torch.cuda.is_available():
            raise AnalysisError(f"device={value!r}: torch sees no CUDA device on this machine "
                                "(torch.cuda.is_available() is False): use device=cpu, or auto")
        index = int(value.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise AnalysisError(f"device={value!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return value


def torch_device(device: str):
    """The torch.device of a resolved device other than "cpu" ("cpu-torch" is torch's CPU); float32
    products stay float32 (TF32 off), as the numpy kernels compute them."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    return torch.device("cpu" if device == "cpu-torch" else device)
