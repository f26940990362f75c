"""Run a test case on N gloo ranks on the CPU, with a bounded wait.

``launch(run_case, case, tmp_path, monkeypatch, world, timeout)`` starts
``world`` processes (torch.multiprocessing, forkserver; gloo on 127.0.0.1, a
fresh free port). Rank r calls ``run_case(case, r, world)`` (a module-level
function, so it pickles by name) and saves what it returns. Each rank writes
its result (or its traceback) to tmp_path; the parent fails the test, with
the ranks' tracebacks, when a rank fails or when the ranks are not done
within ``timeout`` seconds (then they are killed): a broken collective fails
instead of hanging. Shared by test_distributed.py and test_parallel.py, as are
``run_torchrun`` / ``torchrun_worker`` for their GPU (nccl) variants.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, port, out_dir, run_case, case):
    """Entry point of a spawned CPU rank."""
    out = Path(out_dir)
    try:
        # The forkserver keeps the environment it started with: set it here.
        os.environ["OMP_NUM_THREADS"] = "1"
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        result = run_case(case, rank, world)
        torch.save(result, out / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # no destroy: the peer may be gone and it could block


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_errors(out_dir: Path, world: int) -> str:
    texts = []
    for r in range(world):
        f = out_dir / f"rank{r}.err"
        if f.exists():
            texts.append(f"--- rank {r} ---\n{f.read_text()}")
    return "\n".join(texts)


def launch(run_case, case, tmp_path, monkeypatch, world, timeout):
    """Spawns `world` CPU ranks running `run_case(case, rank, world)`;
    returns their results, in rank order."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # for the process imports
    port = free_port()
    # forkserver: ranks fork from a server that imported torch once (saves
    # ~3 s of imports per test on 2 cores); fresh processes otherwise, like
    # spawn. The server does no work before forking, so forking it is safe.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "swiglu_cupy", __name__,
                                run_case.__module__])
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(tmp_path), run_case, case), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline, first_failure = time.monotonic() + timeout, None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
            first_failure = time.monotonic()
        if first_failure is not None and time.monotonic() - first_failure > 5:
            break  # a rank died; its peers are likely stuck in a collective
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    codes = [p.exitcode for p in procs]
    if hung or any(c != 0 for c in codes):
        why = f"ranks {hung} still running after {timeout}s, killed" if hung else "a rank failed"
        pytest.fail(f"case {case!r}: {why}; exit codes {codes}\n{rank_errors(tmp_path, world)}")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def run_torchrun(script: Path, case: str, tmp_path: Path, world: int, timeout: float) -> None:
    """Runs ``script --case CASE --out tmp_path`` on ``world`` ranks under
    torchrun (the GPU tests); fails the test with the ranks' tracebacks if a
    rank fails or the run outlasts ``timeout``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           str(script), "--case", case, "--out", str(tmp_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired as e:  # subprocess.run kills torchrun
        pytest.fail(f"torchrun timed out\n{e.stdout}\n{e.stderr}\n{rank_errors(tmp_path, world)}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}\n"
                    f"{rank_errors(tmp_path, world)}")


def torchrun_worker(run_case) -> None:
    """The rank side of ``run_torchrun``: nccl on the rank's GPU (gloo on the
    CPU without CUDA), then saves ``run_case(case, rank, world, device)``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    try:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=60))
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        torch.save(run_case(args.case, rank, world, device), out / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
