from setuptools import find_packages, setup

setup(
    name="megatron-vshape",
    version="0.1.0",
    description="Pipeline Parallelism with Controllable Memory (V-Min, V-Half, V-ZB) for megatron-core",
    packages=find_packages(include=["megatron_vshape", "megatron_vshape.*"]),
    # v-auto's cache of solved small cells (schedules/generators/solved.py): read at run time.
    package_data={"megatron_vshape.schedules.generators": ["solved_cells.json"]},
    python_requires=">=3.10",
    install_requires=[],
    extras_require={
        "plot": ["matplotlib>=3.7"],
        # megatron-core 0.16.1 suffices for the executor; scripts/pretrain_gpt.py and the runner
        # need megatron.training, which ships from 0.19 on (install 0.19.x with --no-deps on 3.11).
        # The upper bound is the newest minor version CI tests: 0.16.1, 0.19.2, and 0.20.0 as Megatron-LM
        # main at d98e8a64 (megatron/patches.py TESTED). A 0.20.x release installs and starts with a
        # one-line "untested" warning until CI tests it; to support a new minor version, add it to
        # TESTED and .ci/run, run the tests, then raise the bound.
        "megatron": ["torch>=2.3", "megatron-core>=0.16.1,<0.21", "psutil",
                     "typing_extensions; python_version < '3.12'"],  # typing.override (python_compat.py)
        # `vshape optimize` (the exact schedule by CP-SAT); everything else works without it.
        "solver": ["ortools>=9.10"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100", "matplotlib>=3.7", "ruff>=0.5",
                 "import-linter>=2.1",  # the layering contracts (pyproject.toml, tests/test_import_layers.py)
                 "ortools>=9.10",  # the solver extra: the oracle tests (tests/test_optimize*.py) run in CI
                 "pybind11>=2.10",  # builds Megatron-LM main's dataset helpers (megatron/dataset_helpers.py)
                 "allpairspy>=2.5"],  # the pairwise feature matrix (testing/feature_matrix.py)
    },
    entry_points={"console_scripts": ["vshape=megatron_vshape.cli:main"]},
)
