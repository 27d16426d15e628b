"""Start one process per device and run the same `colibri` command line in each, as one expert-parallel group.

    python -m colibri_format.runtime.parallel.launch --nproc 2 -- infer model.colibri --ids 1,2,3
    colibri infer model.colibri --ids 1,2,3 --devices 0,1            # the same, from the CLI

Each child is `python -m colibri_format <args> --devices ...` with its rank in the environment (dist.py); the
CLI sees the worker flag and runs `run_infer_parallel` instead of spawning again. Only rank 0's standard output
is kept. When a rank fails the others are stopped (they would otherwise wait for it until the timeout).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any, Callable

from colibri_format.errors import InvalidInput
from colibri_format.runtime.parallel import dist as pdist

POLL_S = 0.05


def spawn(cli_args: list[str], devices: list[int], device: str) -> int:
    """Run `colibri <cli_args>` once per device; returns the first non-zero exit status, else 0."""
    pdist.backend_for(device)
    if len(devices) < 2:
        raise InvalidInput("expert parallelism needs at least two devices", field="devices", value=devices)
    port = pdist.free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "colibri_format", *cli_args],
                              env=pdist.worker_env(rank, devices, device, port),
                              stdout=None if rank == 0 else subprocess.DEVNULL)
             for rank in range(len(devices))]
    return _wait_all(procs)


def _wait_all(procs: list[subprocess.Popen]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            _stop(procs)
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _cli_args_with_devices(args: list[str], devices: list[int]) -> list[str]:
    if "--devices" in args:
        return args
    return [*args, "--devices", ",".join(map(str, devices))]


def _device_of(args: list[str]) -> str:
    for i, a in enumerate(args):
        if a == "--device" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return "cpu"


# --- `colibri infer --devices` ------------------------------------------------------------------------

def check_world_fits(path: str | os.PathLike, world_size: int) -> None:
    """Refuse a device count the file cannot be split over, once, before any rank starts."""
    import colibri_format
    from colibri_format.runtime.parallel.placement import plan_placement

    with colibri_format.open(path, verify="never") as f:
        m = f.model
        if not m.get("moe_layers"):
            raise InvalidInput("this file has no MoE layer to spread across devices", field="devices")
        plan_placement(m["num_experts"], m["moe_layers"], world_size)


def infer_runner(devices_text: str, device: str, path: str | os.PathLike) -> Callable[..., dict[str, Any] | None]:
    """What `colibri infer` calls instead of run_infer when --devices is given.

    One device: the ordinary engine on that device. Several, in the parent: start the ranks and exit with
    their status. Several, in a rank: this rank's share of the run (returns None on ranks other than 0).
    """
    from colibri_format.runtime.infer_cli import run_infer

    devices = pdist.parse_devices(devices_text)
    pdist.backend_for(device)
    if len(devices) == 1:
        return lambda *a, **kw: run_infer(*a, device_id=devices[0], **kw)
    if not pdist.is_worker():
        args = sys.argv[1:]
        if not args or args[0] != "infer":
            raise InvalidInput("--devices with several devices needs the `colibri infer` command line",
                               field="devices", value=devices_text)
        check_world_fits(path, len(devices))
        raise SystemExit(spawn(args, devices, device))
    from colibri_format.runtime.parallel.run import run_infer_parallel
    return run_infer_parallel


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m colibri_format.runtime.parallel.launch --nproc N -- infer FILE [options]",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="colibri_format.runtime.parallel.launch")
    parser.add_argument("--nproc", type=int, required=True, help="processes (one per device)")
    parser.add_argument("--devices", default=None, help="device indices, default 0..nproc-1")
    opts = parser.parse_args(argv[:split])
    tail = argv[split + 1:]
    devices = pdist.parse_devices(opts.devices) if opts.devices else list(range(opts.nproc))
    if len(devices) != opts.nproc:
        raise InvalidInput("--devices must list --nproc devices", field="devices", value=opts.devices)
    if len(tail) > 1 and tail[0] == "infer" and os.path.isfile(tail[1]):
        check_world_fits(tail[1], len(devices))
    return spawn(_cli_args_with_devices(tail, devices), devices, _device_of(tail))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InvalidInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
