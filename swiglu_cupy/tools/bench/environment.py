"""The environment a bench report records: versions, device, git commit."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import torch


def _version(module: str):
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "unknown")
    except Exception:
        return None


def environment(device: torch.device) -> dict:
    from ..._version import __version__

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": _version("cupy"),
        "cuda_runtime": None,
        "nvrtc": None,
        "driver": None,
        "gpu_name": None,
        "gpu_capability": None,
        "gpu_memory_bytes": None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "swiglu_cupy": __version__,
        "liger_kernel": _version("liger_kernel"),
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "git_commit": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu_name"] = props.name
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["gpu_memory_bytes"] = int(props.total_memory)
        try:
            import cupy
            rt = cupy.cuda.runtime.runtimeGetVersion()
            env["cuda_runtime"] = f"{rt // 1000}.{rt % 1000 // 10}"
            major, minor = cupy.cuda.nvrtc.getVersion()
            env["nvrtc"] = f"{major}.{minor}"
            dv = cupy.cuda.runtime.driverGetVersion()
            env["driver"] = f"CUDA {dv // 1000}.{dv % 1000 // 10}"
        except Exception:
            pass
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            if smi.returncode == 0 and smi.stdout.strip():
                version = smi.stdout.strip().splitlines()[0]
                env["driver"] = version + (f" ({env['driver']})" if env["driver"] else "")
        except Exception:
            pass
    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        if git.returncode == 0:
            env["git_commit"] = git.stdout.strip()
    except Exception:
        pass
    return env
