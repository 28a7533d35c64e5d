"""Which microbatches' loss gradients ride with the next H's broadcast (vocabulary parallelism).

The authors' Algorithm 2 (Yeung et al., MLSys 2025) sends microbatch k's loss gradient in the one broadcast
that carries microbatch k+1's hidden state, so that the loss gradient costs no collective of its own. Here
the loss gradient g(k) (d(objective)/d(per-token loss), one fp32 per token) is computed by the last stage's
rank at the end of H(k), and every other rank needs it only in G(k) (the output layer's weight gradient).
It can ride with the next H's packed broadcast exactly when every other rank runs G(k) after that H: the
runtime (``runtime/vocab_h.py``) and the lowering (``exchange._emit_h``) both read this one answer, so every
rank issues the same collectives. The generators place every G that way on every rank but the last stage's
(``generators/vocab_passes.py``), so on their schedules every g but the last H's rides. Where some rank's G(k)
comes before the next H (a schedule written or moved by hand), g(k) keeps a broadcast of its own, posted at
the end of H(k).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.actions import Action, VocabKind


def carried_loss_grads(programs: Sequence[Sequence[Action]], holder: int) -> dict[int, int]:
    """{k: n} for every microbatch k whose loss gradient rides with H(n)'s broadcast, n the H after H(k) in the
    order every rank meets them. ``programs``: every rank's actions in run order; ``holder``: the rank of the
    last stage (it computes g and needs no broadcast for its own G). Empty without G passes (evaluation)."""
    order = [action.microbatch for action in programs[holder] if action.kind is VocabKind.H]
    if not any(action.kind is VocabKind.G for action in programs[holder]):
        return {}
    where = [{(action.kind, action.microbatch): i for i, action in enumerate(program)
              if isinstance(action.kind, VocabKind)} for program in programs]
    return {k: n for k, n in zip(order, order[1:])
            if all(at[(VocabKind.G, k)] > at[(VocabKind.H, n)] for rank, at in enumerate(where) if rank != holder)}
