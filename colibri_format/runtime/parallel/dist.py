"""Starting and joining a torch.distributed process group on one host (loopback only, bounded timeouts).

The launcher hands every rank its identity through the environment variables torch's `env://` rendezvous
reads (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus COLIBRI_EP_* for what torch does not know: the device
list and the backend. A rank started any other way (torchrun, a test harness) can call `init_rank` directly.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

from colibri_format.errors import InvalidInput

LOOPBACK = "127.0.0.1"
TIMEOUT_S = 60
WORKER_FLAG = "COLIBRI_EP_WORKER"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    backend: str            # gloo | nccl
    device: str             # torch device string of this rank: "cpu" or "cuda:N"


def parse_devices(text: str | None) -> list[int]:
    """'0,1,3' -> [0, 1, 3]; distinct non-negative integers."""
    try:
        ids = [int(tok) for tok in (text or "").replace(" ", "").split(",") if tok]
    except ValueError:
        raise InvalidInput("--devices must be comma-separated device indices, e.g. 0,1", field="devices",
                           value=text) from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise InvalidInput("--devices needs distinct non-negative device indices", field="devices", value=text)
    return ids


def backend_for(device: str) -> str:
    if device not in ("cpu", "cuda"):
        raise InvalidInput("device must be 'cpu' or 'cuda'", field="device", value=device)
    return "nccl" if device == "cuda" else "gloo"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def worker_env(rank: int, devices: list[int], device: str, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(len(devices)), "LOCAL_RANK": str(rank),
                "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), WORKER_FLAG: "1",
                "COLIBRI_EP_DEVICE": device, "COLIBRI_EP_DEVICES": ",".join(map(str, devices))})
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")   # keep gloo on loopback whatever the hostname resolves to
    env.setdefault("NCCL_NVLS_ENABLE", "0")    # NVLink multicast off on the lent machines (KINDS.md)
    return env


def is_worker() -> bool:
    return os.environ.get(WORKER_FLAG) == "1"


def init_rank(rank: int, world_size: int, device: str = "cpu", devices: list[int] | None = None,
              port: int | None = None, timeout_s: int = TIMEOUT_S) -> RankInfo:
    """Join (or create) the default process group over loopback; returns this rank's identity."""
    import torch
    import torch.distributed as dist

    backend = backend_for(device)
    torch_device = "cpu"
    if device == "cuda":
        index = (devices or list(range(world_size)))[rank]
        torch.cuda.set_device(index)
        torch_device = f"cuda:{index}"
    if not dist.is_initialized():
        port = port if port is not None else int(os.environ["MASTER_PORT"])
        dist.init_process_group(backend, init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return RankInfo(rank, world_size, backend, torch_device)


def init_from_env(timeout_s: int = TIMEOUT_S) -> RankInfo:
    """The rank the launcher started this process as."""
    devices = parse_devices(os.environ["COLIBRI_EP_DEVICES"])
    return init_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["COLIBRI_EP_DEVICE"],
                     devices, int(os.environ["MASTER_PORT"]), timeout_s)


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
