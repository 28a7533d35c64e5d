"""megatron-vshape: controllable-memory pipeline schedules (V-Min, V-Half, V-ZB, ...) for megatron-core."""

__version__ = "0.1.0"


def add_arguments(parser):
    """Add megatron-vshape's flags to a Megatron argparse parser (usable as extra_args_provider)."""
    from .megatron.arguments import add_arguments as _add_arguments

    return _add_arguments(parser)


def install(args):
    """Validate args and plug the chosen pipeline schedule into megatron.training (megatron-core 0.19.x)."""
    from .megatron.install import install as _install

    return _install(args)


def hook_arguments():
    """For unmodified entry scripts: add our flags to Megatron's parser; check and install() during its validation."""
    from .megatron.install import hook_arguments as _hook_arguments

    return _hook_arguments()


__all__ = ["__version__", "add_arguments", "hook_arguments", "install"]
