"""Rank functions for the spawn-harness tests, in a module that imports nothing heavy.

A spawned rank imports the module its function lives in; from a test module that would be
megatron-core too (about 3 s of CPU per rank) for functions that only sleep, raise or exit.
"""

import os
import time


def sleep_forever(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def raise_value_error(rank, world_size):
    raise ValueError(f"boom on {rank}")


def die_without_reporting(rank, world_size):
    if rank == 1:
        os._exit(3)  # like a segfault or an OOM kill: no report
    return rank
