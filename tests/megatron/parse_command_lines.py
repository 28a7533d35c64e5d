"""Parse launch command lines with megatron.training's real parser plus our flags (run under megatron-core 0.19.x).

stdin: JSON list of {"argv": [...after the entry script...], "world_size": N, "env": {launch environment}}
stdout (last line): JSON list of error strings, "" for a line that parsed and validated.
Each line goes through our validate() and then Megatron's own validate_args().
"""

import argparse
import contextlib
import copy
import io
import json
import os
import sys

from megatron_vshape.megatron.training_cpu import patch_python_compat

patch_python_compat()
from megatron.training import arguments as megatron_arguments  # noqa: E402
from megatron.training.arguments import add_megatron_arguments, validate_args  # noqa: E402

from megatron_vshape.megatron.arguments import add_arguments, validate  # noqa: E402


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
        validate(args)
        with contextlib.redirect_stdout(io.StringIO()):
            validate_args(copy.copy(args))
    except (_ParseError, AssertionError, ValueError) as err:
        return f"{type(err).__name__}: {err}".splitlines()[0] or type(err).__name__
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ""


def main():
    # validate_args asks the GPU generation when TP > 1; the scripts target A100 (Ampere = 8).
    megatron_arguments.get_device_arch_version = lambda: 8
    parser = add_arguments(add_megatron_arguments(_Parser(allow_abbrev=False)))
    items = json.load(sys.stdin)
    print(json.dumps([check(parser, item) for item in items]))


if __name__ == "__main__":
    main()
