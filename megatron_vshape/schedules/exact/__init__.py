"""The exact optimum of a cell by constraint programming (OR-Tools CP-SAT, an optional extra).

Nothing here imports OR-Tools at module level: ``cpsat.solve`` imports it when called, so the
package (and everything that imports it) works without the solver; ``solver_available`` says
whether it is installed.
"""

from .cpsat import solver_available
from .optimum import NAME, ExactResult, optimize
from .problem import ExactProblem, build_problem

__all__ = ["NAME", "ExactProblem", "ExactResult", "build_problem", "optimize", "solver_available"]
