"""Start one process per device, each running the same worker command, as one expert-parallel group.

    colibri infer model.colibri --ids 1,2,3 --devices 0,1            # the CLI builds the worker command
    python -m colibri_format.runtime.parallel.launch --nproc 2 -- infer model.colibri --ids 1,2,3

`launch(command, devices, device)` runs `command` once per device with the rank's identity in the environment
(dist.py) and returns the group's exit status; it never ends the calling process, the caller decides what the
status means. A process the launcher started is a worker (`dist.is_worker()`): `infer_runner` then hands it its
share of the run instead of launching again. Only rank 0's standard output is kept. When a rank fails the
others are stopped (they would otherwise wait for it until the timeout).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Callable

from colibri_format.errors import InvalidInput
from colibri_format.runtime.parallel import dist as pdist

POLL_S = 0.05
EXIT_OK = 0
EXIT_USAGE = 2


def launch(command: Sequence[str], devices: Sequence[int], device: str) -> int:
    """Run `command` (a program and its arguments) once per device, as ranks 0..len(devices)-1 of one group.

    Returns 0 when every rank succeeded, else the first non-zero exit status seen (the other ranks are then
    stopped). Raises InvalidInput for a bad device kind or fewer than two devices, before starting anything.
    """
    pdist.backend_for(device)
    devices = list(devices)
    if len(devices) < 2:
        raise InvalidInput("expert parallelism needs at least two devices", field="devices", value=devices)
    port = pdist.free_port()
    procs = [subprocess.Popen(list(command), env=pdist.worker_env(rank, devices, device, port),
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
            return EXIT_OK
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


# --- `infer` over several devices -------------------------------------------------------------------------

def check_world_fits(path: str | os.PathLike, world_size: int) -> None:
    """Refuse a device count the file cannot be split over, once, before any rank starts."""
    import colibri_format
    from colibri_format.runtime.parallel.placement import plan_placement

    with colibri_format.open(path, verify="never") as f:
        m = f.model
        if not m.get("moe_layers"):
            raise InvalidInput("this file has no MoE layer to spread across devices", field="devices")
        plan_placement(m["num_experts"], m["moe_layers"], world_size)


def infer_runner(devices: Sequence[int], device: str) -> Callable[..., dict[str, Any] | None] | None:
    """The `run_infer`-shaped call this process makes for an inference over `devices`.

    One device: the ordinary engine on that device. Several, in a rank the launcher started: this rank's share
    of the run (`run_infer_parallel`, which returns None on ranks other than 0). Several, in any other process:
    None, meaning that the ranks are still to be started: check_world_fits, then launch(...) the worker command.
    """
    pdist.backend_for(device)
    devices = list(devices)
    if len(devices) == 1:
        from colibri_format.runtime.infer import run_infer
        return functools.partial(run_infer, device_id=devices[0])
    if not pdist.is_worker():
        return None
    from colibri_format.runtime.parallel.run import run_infer_parallel
    return run_infer_parallel


# --- `python -m colibri_format.runtime.parallel.launch` -------------------------------------------------------

USAGE = "usage: python -m colibri_format.runtime.parallel.launch --nproc N [--devices 0,1] -- infer FILE [options]"


def colibri_command(cli_args: Sequence[str]) -> list[str]:
    """The worker command that runs `colibri <cli_args>` in a fresh interpreter."""
    return [sys.executable, "-m", "colibri_format", *cli_args]


def _cli_args_with_devices(args: list[str], devices: list[int]) -> list[str]:
    if "--devices" in args or any(a.startswith("--devices=") for a in args):
        return args
    return [*args, "--devices", ",".join(map(str, devices))]


def _device_of(args: list[str]) -> str:
    for i, a in enumerate(args):
        if a == "--device" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return "cpu"


def main(argv: Sequence[str]) -> int:
    """Launch `colibri <args after -->` over --nproc devices; returns the exit status (2: bad usage)."""
    argv = list(argv)
    if "--" not in argv:
        print(USAGE, file=sys.stderr)
        return EXIT_USAGE
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="colibri_format.runtime.parallel.launch")
    parser.add_argument("--nproc", type=int, required=True, help="processes (one per device)")
    parser.add_argument("--devices", default=None, help="device indices, default 0..nproc-1")
    try:
        opts = parser.parse_args(argv[:split])
    except SystemExit as exc:                      # argparse printed the usage error (or --help)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    tail = argv[split + 1:]
    try:
        devices = pdist.parse_devices(opts.devices) if opts.devices else list(range(opts.nproc))
        if len(devices) != opts.nproc:
            raise InvalidInput("--devices must list --nproc devices", field="devices", value=opts.devices)
        if len(tail) > 1 and tail[0] == "infer" and os.path.isfile(tail[1]):
            check_world_fits(tail[1], len(devices))
        return launch(colibri_command(_cli_args_with_devices(tail, devices)), devices, _device_of(tail))
    except InvalidInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":                         # the process boundary: argv in, exit status out
    sys.exit(main(sys.argv[1:]))
