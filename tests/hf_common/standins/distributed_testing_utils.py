"""OUR stand-in for transformers' `tests/distributed_testing_utils.py` (not in the PyPI sdist).

The FSDP, tensor-parallel and expert-parallel mixins import these names to spawn one process per rank. This suite
is CPU-only, so: device type "cpu", backend "gloo", every rank on the CPU. Ranks are started with
`torch.multiprocessing` (spawn); each child first re-installs the swiglu_cupy patching hook of the parent run
(`hf_common.hook.install_from_env`, from the environment it inherits), so patched runs are patched in every rank.
A rank's exception fails the calling test (mp.spawn raises ProcessRaisedException).
"""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _get_distributed_device_type():
    return "cpu"


def _get_distributed_backend():
    return "gloo"


def _get_rank_device(rank):
    return torch.device("cpu")


def _set_rank_device(rank):
    return None


def _child(rank, fn, args):
    from hf_common.hook import install_from_env

    install_from_env()
    return fn(rank, *args)


def _start_rank_processes(fn, args=(), nprocs=1, **_):
    mp.start_processes(_child, args=(fn, tuple(args)), nprocs=nprocs, join=True, start_method="spawn")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank, fn, world_size, port, args, kwargs):
    from hf_common.hook import install_from_env

    install_from_env()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, *args, **kwargs)
    finally:
        dist.destroy_process_group()


def run_distributed(world_size=2, **_):
    """`run_distributed(world_size=N)(fn)(*args)`: fn(rank, *args) on N gloo ranks; any rank's error raises here."""

    def deco(fn):
        def runner(*args, **kwargs):
            mp.start_processes(_run_rank, args=(fn, world_size, _free_port(), args, kwargs), nprocs=world_size,
                               join=True, start_method="spawn")

        return runner

    return deco
