"""Every registry schedule through the NCCL model, PP 2..N, m in {min, d, 2d} (both queue settings).

    python scripts/nccl_model_check.py [--max-pp 16] [--schedules v-half,v-zb] [--a2a 1 [--moe-layers 1]]
                                       [--vocab 1 [--g-after-next-h]]

``--a2a``: the schedules built with overlapped F&B pairs (the all-to-all cost, in units of F), and every F and
B recording its expert-parallel all-to-alls (``--moe-layers`` MoE layers per stage) on the expert queue, run
as EP 2 replicas (issue 43). ``--vocab``: the schedules with ``--pipeline-vocab-parallel``'s passes (the head's
work, in units of F), their H and the embedding's collectives on the vocabulary queue; the generators run
each G(k) after H(k+1) on every rank but the last stage's, so every loss gradient but the last rides in the next
H's broadcast (``schedules/lowering/loss_grads.py``): the script counts the schedules where fewer ride.
``--g-after-next-h``: each G moved right after the next H on the last stage's rank too
(``testing/g_after_next_h.py``).

What ``tests/runtime/test_p2p_nccl_model.py`` checks in CI, as a command for a wider sweep. The
programs are the lowering chain's (``schedules/lowering/program.py``), the ones the executor runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from megatron_vshape.schedules.core.schedule import Costs, VocabWork
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule
from megatron_vshape.schedules.lowering.loss_grads import carried_loss_grads
from megatron_vshape.schedules.lowering.messages import CommError
from megatron_vshape.schedules.lowering.nccl_model import check_program
from megatron_vshape.schedules.lowering.program import lower_program
from megatron_vshape.testing.g_after_next_h import g_after_next_h


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-pp", type=int, default=16, help="largest pipeline size (default 16)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated names (default all)")
    parser.add_argument("--a2a", type=float, default=0.0, help="all-to-all cost per F and B (pairs; default 0: none)")
    parser.add_argument("--moe-layers", type=int, default=1, help="with --a2a: MoE layers per stage (default 1)")
    parser.add_argument("--vocab", type=float, default=0.0, help="the vocabulary passes' work (default 0: none)")
    parser.add_argument("--g-after-next-h", action="store_true", help="with --vocab: each G after the next H")
    args = parser.parse_args(argv)
    costs = Costs(a2a=args.a2a, vocab=VocabWork.parse(f"time={args.vocab}") if args.vocab else None)
    failures = short = 0
    for name in args.schedules.split(","):
        start, runs = time.monotonic(), 0
        for d in range(2, args.max_pp + 1):
            low = SCHEDULES[name].min_microbatches(d)
            for m in sorted({low, max(low, d), 2 * d}):
                schedule = get_schedule(name, d, m, costs)
                if args.g_after_next_h:
                    schedule = g_after_next_h(schedule)
                expert = (args.moe_layers,) * schedule.num_stages if args.a2a else ()
                if args.vocab:
                    holder = schedule.placement.device_of(schedule.num_stages - 1)
                    if len(carried_loss_grads(schedule.programs, holder)) != m - 1:
                        short += 1
                        print(f"SHORT {name} pp={d} m={m}: {len(carried_loss_grads(schedule.programs, holder))} "
                              f"of {m - 1} loss gradients ride in the next H's broadcast")
                train = lower_program(schedule, costs, expert_layers=expert)
                evaluate = lower_program(schedule, costs, forward_only_call=True, expert_layers=expert)
                for single_queue in (True, False):
                    runs += 1
                    try:
                        check_program(train, evaluate, (single_queue,))
                    except CommError as err:
                        failures += 1
                        print(f"FAIL {name} pp={d} m={m} single_queue={single_queue}: {err}")
        print(f"{name}: {runs} runs (pp 2..{args.max_pp}, both queue settings) in {time.monotonic() - start:.1f} s")
    print("all NCCL-safe" if not failures else f"{failures} failing runs")
    if args.vocab:
        print("every loss gradient but the last rides" if not short else f"{short} schedules where fewer ride")
    return 1 if failures or short else 0


if __name__ == "__main__":
    sys.exit(main())
