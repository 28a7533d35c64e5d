"""CPU mode: run unmodified megatron-core (0.16.x, 0.19.x) on CPU with the gloo backend.

megatron-core assumes CUDA in a handful of places that are unrelated to the maths it runs.
:func:`enable_cpu_mode` bridges exactly those places, once per process, explicitly:

* **Device arguments.** Megatron allocates with ``device=torch.cuda.current_device()``, ``"cuda"``
  literals and ``.cuda()`` (p2p buffers, the global memory buffer, DDP grad buffers, the token
  counter of the schedules, optimizer scalars). A :class:`torch.overrides.TorchFunctionMode` maps
  every CUDA device argument to ``cpu``; ``torch.cuda.current_device()`` answers ``0``.
* **``Tensor.type()`` string checks** (``clip_grads`` asserts ``'torch.cuda.FloatTensor'``, the
  mixed-precision optimizer sorts parameters by ``'torch.cuda.HalfTensor'``...): in CPU mode the
  no-argument form of ``Tensor.type()`` reports the CUDA name of a CPU tensor, so those checks
  see what they expect on a GPU.
* **``torch.cuda`` calls**: ``synchronize``, ``empty_cache``, ``set_device`` become no-ops;
  streams and events become CPU stand-ins (:mod:`.cpu_streams`: DDP's communication stream, the streams,
  events and ``record_stream`` of Megatron's combined 1F1B); the "CUDA" RNG state
  is the CPU generator's state (checkpointing and the rerun state machine read and write it).
* **The RNG tracker**: megatron's ``CudaRNGStatesTracker`` forks CUDA generator states; the CPU
  tracker below forks the CPU default generator (dropout on CPU draws from it), so tensor-parallel
  dropout regions stay reproducible and distinct per tracker name.
* **Distributed-optimizer checkpoints with torch's Adam** (the optimizer megatron-core falls back to
  without Apex or Transformer Engine, so on every CPU run): megatron-core's ``DistributedOptimizer``
  cannot resume them (a fresh optimizer's ``state_dict`` asserts on the missing step, the loaded step
  is overwritten by the template's, and every parameter then shares one step counter). The mode bridges
  the three places; see :func:`_install_torch_adam_checkpoints`.
* **Expert-parallel all-to-all split sizes**: megatron's alltoall token dispatcher copies its split
  sizes to the host as numpy arrays only when they are on a GPU (``maybe_move_tensor_to_cpu``); on CPU
  they stay tensors, which ``all_to_all_single`` rejects. The mode hands it the same host lists.

Call it before building models and before ``model_parallel_cuda_manual_seed``. It is idempotent.
It changes process-wide state on purpose (that is the point of a mode), so call it in the worker
processes that run megatron on CPU, never in a process that should see a real GPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

from . import cpu_streams

_lock = threading.Lock()
_enabled = False


def enable_cpu_mode() -> None:
    """Make megatron-core run on CPU in this process (idempotent)."""
    global _enabled
    with _lock:
        if _enabled:
            return
        if torch.cuda.is_available():
            raise RuntimeError(
                "enable_cpu_mode(): a CUDA device is visible; CPU mode is for CPU-only processes "
                "(unset CUDA_VISIBLE_DEVICES or do not call enable_cpu_mode)"
            )
        from .patches import Group, check

        check(Group.CPU)  # the RNG tracker bridge replaces megatron attributes: fail in one line if they moved
        _install_cuda_shims()
        _install_rng_tracker()
        _CpuDeviceMode().__enter__()  # stays on for the life of the process
        _install_backward_mode()
        _install_torch_adam_checkpoints()
        _enabled = True


def cpu_mode_enabled() -> bool:
    return _enabled


# --- device arguments ------------------------------------------------------------------------

def _is_cuda_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    # A bare int as a device means "CUDA device n" in torch's factory and .to() APIs.
    return isinstance(value, int) and not isinstance(value, bool)


_CPU = torch.device("cpu")


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and reports CUDA type names from ``Tensor.type()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if getattr(func, "__name__", None) == "all_to_all_single":
            for name in ("output_split_sizes", "input_split_sizes"):
                if isinstance(kwargs.get(name), torch.Tensor):
                    kwargs[name] = kwargs[name].tolist()
        return func(*args, **kwargs)


def _install_backward_mode() -> None:
    """Run custom autograd backwards under the device rewrite too.

    The mode entered above is not active inside autograd's engine when it calls a custom
    Function's backward, and Megatron's sequence-parallel backward allocates with
    ``device=torch.cuda.current_device()`` there.
    """
    from torch.autograd.function import BackwardCFunction

    original = BackwardCFunction.apply

    def apply(self, *args):
        with _CpuDeviceMode():
            return original(self, *args)

    BackwardCFunction.apply = apply


# --- distributed-optimizer checkpoints with torch's Adam ---------------------------------------

class _NoStepYet:
    """The key of the stand-in state entry (a torch optimizer's ``state_dict`` keeps non-tensor keys)."""

    def __repr__(self) -> str:
        return "<megatron-vshape: no optimizer step yet>"


_NO_STEP_YET = _NoStepYet()


def _install_torch_adam_checkpoints() -> None:
    """Let megatron-core's ``DistributedOptimizer`` save and resume torch_dist checkpoints with torch's Adam.

    Without Apex or Transformer Engine (``HAVE_APEX_OR_TE`` false: always so on CPU) the inner optimizer is
    ``torch.optim.Adam``, which keeps a ``step`` tensor per parameter, where TE's and Apex's FusedAdam keep
    one per param group. megatron-core's code for that path breaks a resume in three places (0.16.1, 0.19.2
    and main at d98e8a64 alike):

    * ``state_dict()`` asserts that the per-parameter steps hold exactly one value. ``load_checkpoint``
      builds its loading template from the freshly built optimizer, whose state is still empty: every rank
      stops at ``assert len(steps) == 1``. Here a fresh optimizer reports step 0, torch Adam's count before
      its first step (the template's value; the checkpoint's replaces it).
    * ``_set_main_param_and_optimizer_states`` copies every tensor of a parameter's state from the loaded
      one, ``step`` included. The default format (``dp_reshardable``) stores ``step`` as a local,
      non-persistent object, so the loaded "step" is the template's and would overwrite the checkpoint's
      (which megatron reads from the param groups, and which ``fully_reshardable`` and
      ``fully_sharded_model_space`` skip explicitly). Here a parameter keeps the step it has. The copies
      also run under ``torch.no_grad()``: an fp32 model's main parameters are views of its parameters,
      which require grad, and ``load_parameter_state_from_dp_reshardable``, unlike its siblings, is not
      decorated with it.
    * ``load_state_dict()`` gives every parameter's state the same ``step`` tensor, and Adam increments
      each parameter's step in place: after a resume the shared count grew by the number of parameters
      per step. Here each parameter gets its own copy.
    """
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls.state_dict, "_vshape_torch_adam", False):
        return
    state_dict_original = cls.state_dict
    set_states_original = cls._set_main_param_and_optimizer_states
    load_state_dict_original = cls.load_state_dict

    def torch_adam(self) -> bool:
        return not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(getattr(self.optimizer, "state", None), dict)

    @functools.wraps(state_dict_original)
    def state_dict(self):
        if not torch_adam(self) or len(self.optimizer.state) > 0:
            return state_dict_original(self)
        state = self.optimizer.state
        state[_NO_STEP_YET] = {"step": torch.tensor(0.0)}
        try:
            return state_dict_original(self)
        finally:
            del state[_NO_STEP_YET]

    @functools.wraps(set_states_original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if torch_adam(self):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main_param, {}).get("step")
            if isinstance(step, torch.Tensor):
                tensors = {**tensors, "step": step}  # copied onto itself: the param groups' step stays
        with torch.no_grad():
            return set_states_original(self, model_param, tensors)

    @functools.wraps(load_state_dict_original)
    def load_state_dict(self, state_dict):
        load_state_dict_original(self, state_dict)
        if torch_adam(self):
            for state in self.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()

    state_dict._vshape_torch_adam = True
    cls.state_dict = state_dict
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    cls.load_state_dict = load_state_dict


# --- torch.cuda calls ------------------------------------------------------------------------

def _install_cuda_shims() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.set_device = lambda device: None
    cpu_streams.install()  # streams, events, Tensor.record_stream (see cpu_streams)
    # The "CUDA" generator of a CPU process is the CPU generator (checkpoints, rerun machine).
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)


# --- RNG tracker -----------------------------------------------------------------------------

def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker over the CPU default generator (the one CPU dropout uses)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            generator = torch.Generator()
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state, outer_name = torch.get_rng_state(), self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    # initialize_rng_tracker() looks the class up by name at call time, so later (re)initialisations
    # also get the CPU tracker; activation checkpointing saves/restores through these two helpers.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    mrandom.initialize_rng_tracker(force_reset=True)
