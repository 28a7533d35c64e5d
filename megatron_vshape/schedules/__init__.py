"""Pure-Python pipeline schedules: no torch import anywhere in this package.

Subpackages, by meaning (each imports only those below it; ``tests/test_import_layers.py`` checks it):

- ``core``: actions, schedules and their costs and memory model, dependencies, timing, the simulator;
- ``lowering``: a schedule turned into each rank's program (``program``), its p2p messages and the
  exchange of collective calls, the NCCL model, the validator;
- ``generators``: the schedule families (baselines, zero bubble, V shapes, building blocks, v-auto)
  and the registry that names them;
- ``export``: text, pictures, Chrome traces, PyTorch's CSV;
- ``exact``: the exact optimum by constraint programming (an oracle for the generators).

Import from the module that defines a name (``schedules.core.schedule.Costs``): importing this
package loads nothing else, so the core does not pay for every generator.
"""
