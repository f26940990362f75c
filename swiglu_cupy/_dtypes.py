"""The storage dtypes the op takes, in one place for every layer."""
import torch

#: float16, bfloat16, float32, float64: the kernels' and the torch path's dtypes.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Dtypes whose math runs in their own precision (the 16-bit ones widen to fp32).
FULL_PRECISION_DTYPES = (torch.float32, torch.float64)
#: Compute dtypes that can save x12 in 8 bits (``saved_x12="fp8"``); float64, the checking dtype, cannot.
FP8_SAVED_X12_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
