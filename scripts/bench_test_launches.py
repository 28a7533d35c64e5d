"""CPU cost of the tests' training launches: a fresh ``fork_ranks`` per launch against one launch server.

    python scripts/bench_test_launches.py --launches 3 [--base /path/to/older/checkout]

Launches Megatron's own 1F1B of the feature matrix's first model (4 CPU ranks, Megatron-LM core_v0.19.0's
``pretrain_gpt.py`` through the runner) ``--launches`` times each way and prints the CPU seconds (user + sys
of every process, reaped children included) and the wall time. ``--base``: also run an older checkout's
``fork_ranks`` (its own preload) the same way, side by side. Needs ``MEGATRON_LM_DIR`` or
``../shared/clients/megatron-lm-core_v0.19.0``.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_vshape.testing import feature_matrix as fm  # noqa: E402
from megatron_vshape.testing.launch_server import LaunchServers, cpu_env  # noqa: E402
from megatron_vshape.testing.spawn import free_port  # noqa: E402


def _env(checkout: Path) -> dict[str, str]:
    return cpu_env(PYTHONPATH=str(checkout))  # that checkout's package only


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def fresh(checkout: Path, entry: list[str], launches: int) -> None:
    for _ in range(launches):
        with tempfile.TemporaryDirectory() as logs:
            out = subprocess.run([sys.executable, "-m", "megatron_vshape.testing.fork_ranks", "--nproc", str(fm.RANKS),
                                  "--port", str(free_port()), "--logs", logs, "--stop-on-failure", "--", *entry],
                                 env=_env(checkout), cwd=checkout, capture_output=True, text=True)
            assert '"codes": [0, 0, 0, 0]' in out.stdout, out.stdout + out.stderr


def served(entry: list[str], launches: int) -> None:
    servers = LaunchServers()
    for _ in range(launches):
        with tempfile.TemporaryDirectory() as logs:
            codes = servers.launch(sys.executable, fm.RANKS, free_port(), logs, True, entry, ROOT, _env(ROOT), 600)
            assert codes == [0] * fm.RANKS, codes
    servers.close()  # the server reaps its leaders: their CPU reaches us when it exits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--base", type=Path, help="an older checkout to run side by side (its fork_ranks)")
    args = parser.parse_args()
    client = Path(os.environ.get("MEGATRON_LM_DIR", ROOT.parent / "shared/clients/megatron-lm-core_v0.19.0"))
    row = fm.DEFAULT_ROWS[0]
    entry = ["-m", "megatron_vshape.run", str(client / row.script), *row.reference_flags()]
    ways = {"fork_ranks per launch": lambda: fresh(ROOT, entry, args.launches),
            "one launch server": lambda: served(entry, args.launches)}
    if args.base is not None:
        ways[f"fork_ranks per launch at {args.base}"] = lambda: fresh(args.base.resolve(), entry, args.launches)
    print(f"| way ({args.launches} launches of {row.script}, {fm.RANKS} ranks) | CPU s | wall s |\n|---|---|---|")
    for name, run in ways.items():
        cpu, wall = _cpu_of_children(), time.monotonic()
        run()
        print(f"| {name} | {_cpu_of_children() - cpu:.1f} | {time.monotonic() - wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
