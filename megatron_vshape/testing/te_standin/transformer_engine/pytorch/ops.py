"""TE's fusible ops API is not stood in: megatron only builds it with --use-te-activation-func / op fuser."""


class _NotStoodIn:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"the TE stand-in has no {type(self).__name__}")


class Sequential(_NotStoodIn):
    pass


class SwiGLU(_NotStoodIn):
    pass


class GEGLU(_NotStoodIn):
    pass


class ReGLU(_NotStoodIn):
    pass


class GELU(_NotStoodIn):
    pass


class ReLU(_NotStoodIn):
    pass
