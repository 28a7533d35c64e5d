"""FP8 state, carried and answered (no FP8 maths): what fp8_autocast set is what is_fp8_enabled says."""

import contextlib


class FP8GlobalStateManager:
    FP8_ENABLED = False
    FP8_RECIPE = None
    FP8_PARAMETERS = False

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED

    @classmethod
    def get_fp8_recipe(cls):
        return cls.FP8_RECIPE

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.FP8_PARAMETERS

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        return False


@contextlib.contextmanager
def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
    saved = FP8GlobalStateManager.FP8_ENABLED, FP8GlobalStateManager.FP8_RECIPE
    FP8GlobalStateManager.FP8_ENABLED, FP8GlobalStateManager.FP8_RECIPE = bool(enabled), fp8_recipe
    try:
        yield
    finally:
        FP8GlobalStateManager.FP8_ENABLED, FP8GlobalStateManager.FP8_RECIPE = saved


@contextlib.contextmanager
def fp8_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    saved = FP8GlobalStateManager.FP8_PARAMETERS
    FP8GlobalStateManager.FP8_PARAMETERS = bool(enabled)
    try:
        yield
    finally:
        FP8GlobalStateManager.FP8_PARAMETERS = saved
