"""Lowering a schedule to point-to-point messages, and a check that the plan runs.

Every cross-device dependency becomes one :class:`Message`. The plan of a device is its
program with, per action, the messages it must receive before it runs and the messages it sends
right after. The execution model (what the runtime does, and what :func:`check_plan`
simulates):

* sends are posted right after the producing pass and complete asynchronously;
* each device posts its receives from a given peer *in the order that peer sends them*
  (so untagged point-to-point can never pair a receive with the wrong send, e.g. swap an
  activation with a gradient), and blocks on a receive just before the pass that needs it.

Messages that stay on one device (the tip of the V, or two stages of one device) are not
messages at all: the runtime hands the tensor over locally.

Vocabulary passes (H, G) send and receive no messages: what they exchange travels in the pipeline
group's collectives, which every device of a microbatch's H joins together (:func:`check_plan` runs
them as one rendezvous).
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

from ..core.actions import Action, Kind, VocabKind
from ..core.dependencies import dependencies
from ..core.schedule import Schedule, ScheduleError
from .drive import drive


class Payload(enum.Enum):
    ACTIVATION = "act"  # output of F(stage) -> input of F(stage + 1)
    GRADIENT = "grad"  # input-grad of B(stage) -> output-grad of B(stage - 1)

    __hash__ = object.__hash__  # singletons; C-speed hashing (see Kind)


class Message(NamedTuple):
    """One tensor sent between two devices (a NamedTuple: plans hold many, hashed in C)."""

    payload: Payload
    src_stage: int  # the stage that produced the tensor
    microbatch: int
    src: int
    dst: int

    @property
    def dst_stage(self) -> int:
        return self.src_stage + 1 if self.payload is Payload.ACTIVATION else self.src_stage - 1

    def __str__(self) -> str:
        return (
            f"{self.payload.value}[{self.src_stage}->{self.dst_stage}].{self.microbatch}"
            f"@{self.src}->{self.dst}"
        )


class Step(NamedTuple):
    """One compute action with the receives it waits for and the sends it posts after."""

    action: Action
    recvs: tuple[Message, ...] = ()
    sends: tuple[Message, ...] = ()


@dataclass(frozen=True)
class DevicePlan:
    steps: tuple[Step, ...]
    # Receive posting order per peer: exactly the order in which that peer sends to us.
    recv_order: dict[int, tuple[Message, ...]]


def _message_rules(schedule: Schedule):
    """``(incoming, outgoing)`` for one schedule: the messages an action must receive before it runs (none
    for same-device inputs), and those it produces for a consumer on another device.

    The stage -> device table and stage count are looked up once: lowering touches every action, and
    full-size schedules (d = 64, hundreds of microbatches) have about 10^5 of them.
    """
    num_stages = schedule.num_stages
    device_of = [schedule.placement.device_of(stage) for stage in range(num_stages)]

    def incoming(action: Action) -> tuple[Message, ...]:
        if isinstance(action.kind, VocabKind):
            return ()  # collectives, not messages
        device = device_of[action.stage]
        payload = Payload.ACTIVATION if action.kind is Kind.F else Payload.GRADIENT
        return tuple(
            Message(payload, dep.stage, dep.microbatch, device_of[dep.stage], device)
            for dep in dependencies(action, num_stages)
            # own F before B, own B before W: always local; so is a producer on this device
            if dep.stage != action.stage and device_of[dep.stage] != device
        )

    def outgoing(action: Action) -> tuple[Message, ...]:
        if isinstance(action.kind, VocabKind):
            return ()
        if action.kind is Kind.F and action.stage + 1 < num_stages:
            consumer, payload = action.stage + 1, Payload.ACTIVATION
        elif action.kind is Kind.B and action.stage > 0:
            consumer, payload = action.stage - 1, Payload.GRADIENT
        else:
            return ()
        device, dst = device_of[action.stage], device_of[consumer]
        if dst == device:
            return ()  # the tip of the V, or two stages on one device: handed over locally
        return (Message(payload, action.stage, action.microbatch, device, dst),)

    return incoming, outgoing


def lower(schedule: Schedule) -> tuple[DevicePlan, ...]:
    """Per-device p2p plans for ``schedule``."""
    incoming, outgoing = _message_rules(schedule)
    steps_per_device = [tuple(Step(action, incoming(action), outgoing(action)) for action in program)
                        for program in schedule.programs]
    send_order: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for steps in steps_per_device:
        for step in steps:
            for msg in step.sends:
                send_order[(msg.src, msg.dst)].append(msg)
    plans = []
    for device, steps in enumerate(steps_per_device):
        recv_order = {
            src: tuple(msgs) for (src, dst), msgs in sorted(send_order.items()) if dst == device
        }
        plans.append(DevicePlan(steps, recv_order))
    return tuple(plans)


class CommError(ScheduleError):
    """The p2p plan would deadlock or pair a receive with the wrong send."""


def check_plan(plans: tuple[DevicePlan, ...]) -> None:
    """Execute the plans message by message and raise :class:`CommError` if they fail.

    Checks that every receive has exactly one matching send, that each pair's receive posting
    order equals its send order, and that blocking on receives in program order never deadlocks.
    """
    _check_matching(plans)
    devices = range(len(plans))
    programs = [with_arrivals(plan.steps) for plan in plans]

    def needs(device, entry):
        arrive, step = entry
        if step.action.kind is VocabKind.H and not arrive:
            return [("at", step.action.microbatch, other) for other in devices]
        return () if arrive else step.recvs

    def run(device, entry):
        arrive, step = entry
        return [("at", step.action.microbatch, device)] if arrive else step.sends

    cursor = drive(programs, needs, run)
    waiting = [
        f"device {dev} waits for {_waits_for(programs[dev][c][1])}"
        for dev, (c, program) in enumerate(zip(cursor, programs))
        if c < len(program)
    ]
    if waiting:
        raise CommError("p2p plan deadlocks: " + "; ".join(waiting))


def with_arrivals(steps) -> list[tuple[bool, Step]]:
    """``(arrive, step)`` per step, a collective (H) step preceded by its arrival: a device that reaches
    the rendezvous announces it, and runs the step once every device has (one in-order queue)."""
    out = []
    for step in steps:
        if step.action.kind is VocabKind.H:
            out.append((True, step))
        out.append((False, step))
    return out


def _waits_for(step) -> str:
    if step.action.kind is VocabKind.H:
        return f"every device at the collective {step.action.kind}.{step.action.microbatch}"
    return ", ".join(str(m) for m in step.recvs)


def _check_matching(plans) -> None:
    sends: dict[tuple[int, int], list[Message]] = defaultdict(list)
    needed: dict[tuple[int, int], set[Message]] = defaultdict(set)
    for plan in plans:
        for step in plan.steps:
            for msg in step.sends:
                sends[(msg.src, msg.dst)].append(msg)
            for msg in step.recvs:
                needed[(msg.src, msg.dst)].add(msg)
    for device, plan in enumerate(plans):
        for src, order in plan.recv_order.items():
            if list(order) != sends[(src, device)]:
                raise CommError(f"device {device} posts receives from {src} in a different order than sent")
    for pair in set(sends) | set(needed):
        if set(sends[pair]) != needed[pair] or len(sends[pair]) != len(needed[pair]):
            raise CommError(f"devices {pair[0]}->{pair[1]}: sends and receives do not match one to one")
