"""Pure-Python pipeline schedules: no torch import anywhere in this package."""

from .actions import Action, Kind, parse_action
from .blocks import BuildingBlock, fill_w, schedule_from_block
from .comm import DevicePlan, Message, Payload, Step, lower
from .registry import SCHEDULES, ScheduleSpec, fuses_backward, get_schedule, get_spec, schedule_names
from .schedule import (
    Costs,
    MemoryModel,
    Placement,
    PlacementKind,
    Schedule,
    ScheduleError,
    StageWork,
    parse_stage_work,
)
from .simulator import DeadlockError, SimulationResult, simulate
from .validator import InvalidSchedule, validate

__all__ = [
    "Action", "BuildingBlock", "Costs", "DeadlockError", "DevicePlan", "InvalidSchedule", "Kind",
    "MemoryModel", "Message", "Payload", "Placement", "PlacementKind", "SCHEDULES", "Schedule",
    "ScheduleError", "ScheduleSpec", "SimulationResult", "StageWork", "Step", "fill_w", "fuses_backward",
    "get_schedule", "get_spec", "lower",
    "parse_action", "parse_stage_work", "schedule_from_block", "schedule_names", "simulate", "validate",
]
