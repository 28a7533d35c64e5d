"""The RNG tracker base class megatron's TECudaRNGStatesTracker subclasses (not used on CPU)."""


class CudaRNGStatesTracker:
    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def reset(self):
        self.states_, self.seeds_ = {}, set()


def activation_recompute_forward(activation_recompute=False, recompute_phase=False):
    """TE's recompute-phase marker (megatron's checkpointing imports it); a no-op context here."""
    import contextlib

    return contextlib.nullcontext()
