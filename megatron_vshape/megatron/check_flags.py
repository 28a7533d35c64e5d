"""``vshape check-flags [--te-version X.Y] [--world-size N] -- <pretrain_gpt.py flags>``: check a recipe first.

Runs Megatron's own argument parser with the plugin's flags, the plugin's start-up checks and then
Megatron's ``validate_args``, without GPUs or process groups, and prints either ``accepted`` with the
schedule, the layer spec and the split route the job would use, or the one-line refusal training would
give (exit 0 or 2). Meant for a login node before a Slurm job, where Transformer Engine is often not
installed: ``--te-version`` states the cluster's TE (default: the installed one, else none). Needs
megatron.training (megatron-core >= 0.19).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import sys
from dataclasses import dataclass

from ..cli_parser import OneLineParser, UsageError, one_line, usage_error

# What Megatron's validate_args asks the GPU for: Hopper (the FP8 recipes' target) unless told.
DEFAULT_ARCH = 9
# Set for the check when the shell has not (Megatron requires it with TP or CP > 1; its recipes export it).
LAUNCH_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    line: str  # "accepted: ..." or the refusal


def _parse_own(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise UsageError("give the training flags after '--': vshape check-flags [--te-version X.Y] -- <flags>")
    split = argv.index("--")
    parser = OneLineParser(prog="vshape check-flags", description=__doc__.split("\n\n")[0])
    parser.add_argument("--te-version", default=None, metavar="X.Y",
                        help="Transformer Engine version of the cluster (default: the installed one; 'none': no TE)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="ranks of the job (default: TP x PP x CP, one data-parallel replica)")
    parser.add_argument("--gpu-arch", type=int, default=DEFAULT_ARCH, metavar="MAJOR",
                        help="GPU compute capability major version Megatron's checks see (default 9, Hopper)")
    return parser.parse_args(argv[:split]), argv[split + 1:]


def _te_version(text: str | None):
    """(tuple for our checks, packaging Version for Megatron's), or None for the installed one."""
    if text is None:
        return None
    if text.lower() == "none":
        return (), "0.0.0"
    parts = text.split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise UsageError(f"--te-version: expected X.Y or X.Y.Z (e.g. 2.8), got {text!r}")
    return tuple(int(p) for p in parts), text


class _TrainingParser(argparse.ArgumentParser):
    def error(self, message):  # Megatron's parser would print its whole usage first
        raise UsageError(message)


@contextlib.contextmanager
def _declared_te(version):
    """Megatron's own TE version checks (megatron.core.utils caches it) answer the declared version."""
    from megatron.core import utils as core_utils
    from packaging.version import Version

    saved = core_utils._te_version
    if version is not None:
        core_utils._te_version = Version(version[1])
    try:
        yield
    finally:
        core_utils._te_version = saved


@contextlib.contextmanager
def _launch_environment():
    """What Megatron's recipes export before launching (a login node's shell has none of it)."""
    import os

    added = {k: v for k, v in LAUNCH_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def check(argv: list[str], te_version: str | None = None, world_size: int | None = None,
          gpu_arch: int = DEFAULT_ARCH) -> Verdict:
    """The verdict on ``argv`` (pretrain_gpt.py's flags) as training would give it."""
    from .training_cpu import patch_python_compat, require_megatron_training

    require_megatron_training()
    patch_python_compat()
    from megatron.training import arguments as megatron_arguments

    from .arguments import add_arguments, validate, validate_after_megatron
    from .feature_checks import split_route_reason
    from .flags import ConfigError
    from .install import effective_schedule
    from .sizes import Sizes

    version = _te_version(te_version)
    parser = add_arguments(megatron_arguments.add_megatron_arguments(_TrainingParser(allow_abbrev=False)))
    args = parser.parse_args(argv)
    if version is not None:
        args.vshape_te_version = version[0] or None
    sizes = Sizes.from_args(args)
    args.rank = 0
    args.world_size = world_size or sizes.tp * sizes.pp * sizes.cp
    route = split_route_reason(args)  # before validate() fills in --spec
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            validate(args)
    except ConfigError as err:
        return Verdict(False, one_line(err))
    saved_arch = megatron_arguments.get_device_arch_version
    megatron_arguments.get_device_arch_version = lambda: gpu_arch
    validated = copy.copy(args)
    try:
        with _declared_te(version), _launch_environment(), contextlib.redirect_stdout(io.StringIO()):
            megatron_arguments.validate_args(validated)
    except (AssertionError, ValueError, RuntimeError, TypeError) as err:
        return Verdict(False, f"Megatron refuses: {one_line(err) or type(err).__name__}")
    finally:
        megatron_arguments.get_device_arch_version = saved_arch
    try:  # what training checks again once Megatron has derived its defaults (install does)
        validate_after_megatron(validated)
    except ConfigError as err:
        return Verdict(False, one_line(err))
    spec = ":".join(args.spec) if getattr(args, "spec", None) else f"megatron's {args.transformer_impl} spec"
    return Verdict(True, f"accepted: --pipeline-schedule {effective_schedule(args)}, layer spec {spec}, "
                         f"split route: {route}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        own, flags = _parse_own(argv)
        _te_version(own.te_version)  # a bad version is a usage error before Megatron is imported
        verdict = check(flags, own.te_version, own.world_size, own.gpu_arch)
    except UsageError as err:
        return usage_error(err)
    except ImportError as err:
        return usage_error(f"check-flags needs megatron.training (megatron-core >= 0.19): {err}")
    if not verdict.accepted:
        return usage_error(verdict.line)
    print(verdict.line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
