"""``vshape plan``: a cost model (FLOPs, bandwidths, memory) plus a search over DP x TP x PP x
microbatch size, with the schedule simulator as the engine. Pure Python, no torch import."""

from .costs import CostModel, PassTimes, calibrate_efficiency
from .hardware import GPU, GPUS, get_gpu
from .memory import MemoryEstimate
from .model import PRESETS, GPTModel, get_model
from .parallel_layout import ParallelLayout, stage_layers
from .predict import Prediction, planner_schedule_names, predict
from .search import Grid, ScheduleSearch, search

__all__ = [
    "GPU", "GPUS", "PRESETS", "CostModel", "GPTModel", "Grid", "ParallelLayout", "MemoryEstimate", "PassTimes",
    "Prediction", "ScheduleSearch", "calibrate_efficiency", "get_gpu", "get_model", "planner_schedule_names",
    "predict", "search", "stage_layers",
]
