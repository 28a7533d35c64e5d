"""Parse launch command lines with megatron.training's real parser plus our flags (run under megatron-core 0.19.x).

stdin: JSON list of {"argv": [...after the entry script...], "world_size": N, "env": {launch environment}}
stdout (last line): JSON list of error strings, "" for a line that parsed and validated.
Each line goes through our validate() and then Megatron's own validate_args().

The scripts target the Docker image (docker/Dockerfile), whose build fails unless Transformer Engine and
apex's kernels import (docker/check_kernels.py). This environment has neither, so while our validate()
runs, the checks that look for them (package metadata, module lookup; nothing is imported) see the image's.
"""

import argparse
import contextlib
import copy
import importlib.util
import io
import json
import os
import sys
from importlib import metadata
from unittest import mock

from megatron_vshape.megatron.training_cpu import patch_python_compat

patch_python_compat()
from megatron.training import arguments as megatron_arguments  # noqa: E402
from megatron.training.arguments import add_megatron_arguments, validate_args  # noqa: E402

from megatron_vshape.megatron.arguments import add_arguments, validate  # noqa: E402
from megatron_vshape.schedules.generators import registry  # noqa: E402
from megatron_vshape.schedules.lowering import validator  # noqa: E402

# What the image provides that validate() looks up (docker/check_kernels.py requires both).
IMAGE_DISTRIBUTIONS = {"transformer-engine": "2.10.0", "transformer_engine": "2.10.0"}
IMAGE_MODULES = ("fused_weight_gradient_mlp_cuda", "transformer_engine", "transformer_engine_torch")


@contextlib.contextmanager
def as_in_the_image():
    real_version, real_find_spec = metadata.version, importlib.util.find_spec

    def version(dist):
        return IMAGE_DISTRIBUTIONS[dist] if dist in IMAGE_DISTRIBUTIONS else real_version(dist)

    def find_spec(name, *args, **kwargs):
        if name in IMAGE_MODULES:
            return importlib.util.spec_from_loader(name, loader=None)
        return real_find_spec(name, *args, **kwargs)

    with mock.patch.object(metadata, "version", version), mock.patch.object(importlib.util, "find_spec", find_spec):
        yield


class _ParseError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit; collect the message instead
        raise _ParseError(message)


def check(parser, item) -> str:
    saved = dict(os.environ)
    os.environ.update(item.get("env", {}))
    try:
        args = parser.parse_args(item["argv"])
        args.rank, args.world_size = 0, item["world_size"]
        with as_in_the_image():
            validate(args)
        with contextlib.redirect_stdout(io.StringIO()):
            validate_args(copy.copy(args))
    except (_ParseError, AssertionError, ValueError) as err:
        return f"{type(err).__name__}: {err}".splitlines()[0] or type(err).__name__
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ""


def build_each_schedule_once():
    """Lines that differ only in flags the schedule does not depend on (TP, DP, sequence, model) share one
    (schedule, PP, microbatches, costs, limit): our validate() builds and validates that schedule once,
    not once per line (275 lines, 176 distinct schedules, most at full size)."""
    built, validated = {}, set()
    real_get, real_validate = registry.get_schedule, validator.validate

    def get_schedule(name, *args, **kwargs):
        key = (name, args and repr(args), repr(sorted(kwargs.items())))
        if key not in built:
            built[key] = real_get(name, *args, **kwargs)
        return built[key]

    def validate(schedule, *args, **kwargs):
        if args or kwargs or id(schedule) not in validated:  # every built schedule stays alive in ``built``
            real_validate(schedule, *args, **kwargs)
            validated.add(id(schedule))

    registry.get_schedule, validator.validate = get_schedule, validate


def main():
    # validate_args asks the GPU generation when TP > 1; the scripts target A100 (Ampere = 8).
    megatron_arguments.get_device_arch_version = lambda: 8
    build_each_schedule_once()
    parser = add_arguments(add_megatron_arguments(_Parser(allow_abbrev=False)))
    items = json.load(sys.stdin)
    print(json.dumps([check(parser, item) for item in items]))


if __name__ == "__main__":
    main()
