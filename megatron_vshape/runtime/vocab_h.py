"""The H pass of one microbatch on one pipeline rank, and what its G needs: one rendezvous per microbatch.

Every pipeline rank of a replica runs H(k) (the schedule places it; runtime/vocab_iteration.py calls it).
Its collectives go on the rank's vocabulary :class:`~.comm_queue.CommQueue`, in this order on every rank
(``schedules/lowering/exchange.py`` lowers the same list and ``nccl_model.py`` checks it):

1. **in**: one broadcast from the last stage's rank: the final hidden state and the labels, packed in one
   buffer (the labels are 1/h of it, as int64 bytes). The last stage's rank does not wait for it.
2. **stats**: the all-gather of every rank's softmax statistics (3 fp32 per token; over TP first when
   TP > 1). Posted, then this rank computes ``exp(logits - local max) @ W`` (the GEMM of its part of the
   hidden gradient) while it runs; waited, then the loss and the softmax (``vocab_parallel``).
3. **reduce** (training): this rank's part of the hidden gradient per unit loss gradient (fp32), summed
   onto the last stage's rank: a reduce, as only that rank needs it. No rank waits for the loss function
   before it; the last stage multiplies the sum by its loss gradient itself. The other ranks keep the part
   (the reduce's send buffer, fp32 [tokens, hidden]) until the reduce is waited: at their next H, once its
   broadcast is posted (the last stage's rank waited the reduce before that broadcast), or at G(k) where
   that comes first; never both its H's and the next H's at once.
4. **g** (training): the loss gradient d(objective)/d(per-token loss) from the last stage's rank, after its
   loss function ran. Only G(k) needs it (the weight gradient). Where every other rank runs G(k) after the
   next H (``schedules/lowering/loss_grads.py``), g(k) rides in that H's packed broadcast, after the labels
   (the authors' Algorithm 2: no collective of its own); elsewhere it is a broadcast of its own, which the
   other ranks post and leave H.

So the ranks meet once per microbatch (steps 1 and 2: the all-gather needs every rank's logits), and
every other collective is posted and waited only where its result is needed: the last stage's rank waits
for the reduce before its B, every rank waits for g in G(k), and the others for their reduce's send at
their next H (or at G(k) where that comes first).
No step reads a tensor back to the host (no ``nonzero``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import vocab_parallel as vp
from .comm_queue import CommQueue, Pending


@dataclass
class HeldForG:
    """What H(k) leaves for G(k) on this rank."""

    out: vp.OutputState  # this rank's softmax (fp32) and the hidden state
    grad_loss: torch.Tensor  # [tokens] fp32, arriving (``pending``)
    pending: tuple[Pending, ...]  # g's broadcast (where it has one of its own)
    nbytes: int  # what this holds, for the [vshape] line's peak
    # On the other ranks: their reduce's send (the fp32 [tokens, hidden] part, kept alive by the pending
    # collective) and its bytes, until it is waited: at the next H (:meth:`HPass._release_sends`) or at G(k),
    # whichever this rank runs first.
    send: Pending | None = None
    send_bytes: int = 0

    def release_send(self, wait: Callable[[Pending], None]) -> None:
        if self.send is not None:
            wait(self.send)
            self.send, self.nbytes, self.send_bytes = None, self.nbytes - self.send_bytes, 0


class HPass:
    """H and G of one call on one rank (see the module docstring). ``layers``: the rank's
    ``VocabShardLayers``; ``dtype``: the pipeline dtype the hidden state travels in."""

    def __init__(self, layers, queue: CommQueue, rank: int, last_rank: int, dtype: torch.dtype,
                 carried: dict[int, int] | None = None):
        self.layers, self.queue, self.rank, self.last_rank, self.dtype = layers, queue, rank, last_rank, dtype
        self.held: dict[int, HeldForG] = {}
        # k -> n: g(k) rides in H(n)'s broadcast (loss_grads.py); on the last stage's rank, the g's waiting for it
        self.carried = carried or {}
        self.rides = {n: k for k, n in self.carried.items()}
        self.outgoing: dict[int, torch.Tensor] = {}
        self.wait_seconds = 0.0  # the host blocked in H's waits (the bench prints it per rank)
        # The [tokens, rows] fp32 logits buffers of microbatches whose G has run, for the next H: each is tens of
        # MiB, and a fresh one costs its page faults on the CPU every time. As many as were alive at once.
        self.free: list[torch.Tensor] = []

    @property
    def holder(self) -> bool:
        return self.rank == self.last_rank

    def _root(self) -> int:
        return dist.get_global_rank(self.layers.pp_group, self.last_rank)

    def _wait(self, pending: Pending) -> None:
        start = time.perf_counter()
        pending.wait()
        self.wait_seconds += time.perf_counter() - start

    def run(self, microbatch: int, shape: tuple[int, int, int], hidden: torch.Tensor | None,
            labels: torch.Tensor | None, loss: Callable | None, training: bool) -> torch.Tensor | None:
        """H(k). ``shape``: [s, b, h] of the hidden state; ``hidden`` and ``labels`` [b, s]: the last
        stage's (None on the other ranks);
        ``loss(per_token_loss [b, s])`` runs the script's loss function there and, training, returns
        d(objective)/d(loss). Returns the hidden state's gradient on the last stage's rank (training)."""
        layers, pp = self.layers, self.layers.pp_group
        s, b, h = shape
        hidden_in, labels_in = self._receive(hidden, labels, shape, self.rides.get(microbatch) if training else None)
        weight = layers.pass_weight()
        out = vp.local_output(hidden_in.to(weight.dtype).reshape(s * b, h), weight,
                              labels_in.t().reshape(s * b), layers.shard, self.free.pop() if self.free else None)
        stats, gathered = self._post_gather(out.stats)
        parts = vp.unit_grad_parts(out, weight) if training else None  # overlaps the all-gather
        self._wait(stats)
        vp.combine_statistics(out, torch.cat(gathered))
        partial = reduced = None
        if training:
            partial = vp.unit_hidden_grad(out, parts)
            reduced = self.queue.post(lambda: dist.reduce(partial, dst=self._root(), group=pp, async_op=True), (partial,))
        grad_loss = None
        if self.holder:
            grad_loss = loss(out.loss.view(s, b).t().contiguous())
        if not training:
            self.free.append(out.probs)
            return None
        if self.holder:
            g = grad_loss.to(torch.float32).t().reshape(s * b).contiguous()
        else:
            g = torch.empty(s * b, dtype=torch.float32, device=weight.device)
        if microbatch in self.carried:  # g goes (or, elsewhere, arrives) in the next H's broadcast
            if self.holder:
                self.outgoing[microbatch] = g
            pending = ()
        else:
            pending = (self.queue.post(lambda: dist.broadcast(g, src=self._root(), group=pp, async_op=True), (g,)),)
        send_bytes = 0 if self.holder else partial.nbytes
        nbytes = out.probs.nbytes + out.hidden.nbytes + g.nbytes + send_bytes
        self.held[microbatch] = HeldForG(out, g, pending, nbytes, None if self.holder else reduced, send_bytes)
        if not self.holder:
            return None
        self._wait(reduced)
        if layers.tp_group.size() > 1:  # the other TP ranks' shards: summed among the last stage's TP ranks
            dist.all_reduce(partial, group=layers.tp_group)
        return partial.mul_(g.unsqueeze(-1)).view(s, b, h).to(hidden.dtype)

    def weight_grad(self, microbatch: int) -> None:
        """G(k): wait for the loss gradient, then add this rank's output-layer weight gradient."""
        held = self.held.pop(microbatch)
        held.release_send(self._wait)
        for pending in held.pending:
            self._wait(pending)
        weight = self.layers.output_weight
        grad_logits = vp.logits_grad(held.out, held.grad_loss, weight.dtype)
        hidden = held.out.hidden
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is not None and main_grad.dtype == grad_logits.dtype == hidden.dtype == torch.float32:
            main_grad.addmm_(grad_logits.t(), hidden)  # straight into fp32 main_grad: no [rows, hidden] temporary
        else:
            self.layers.output_weight_grad_task(lambda: grad_logits.t() @ hidden)()
        if held.out.probs.dtype == torch.float32:
            self.free.append(held.out.probs)

    def held_bytes(self) -> int:
        return sum(held.nbytes for held in self.held.values())

    # --- step 1 ---------------------------------------------------------------------------------------

    def _receive(self, hidden, labels, shape, rider: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state and the labels from the last stage's rank, in one broadcast: the labels'
        int64 bytes first (aligned for the views back), then microbatch ``rider``'s loss gradient (fp32) if
        it rides here, then the hidden state, in the pipeline dtype."""
        s, b, h = shape
        label_elems = b * s * 8 // _element_size(self.dtype)
        g_elems = 0 if rider is None else b * s * 4 // _element_size(self.dtype)
        if self.holder:
            # Megatron's Float16Module hands a last stage's output back in fp32 under --bf16: every rank
            # receives the pipeline dtype, and the gradient goes back in the output's own dtype.
            rides = () if rider is None else (self.outgoing.pop(rider).view(self.dtype),)
            packed = torch.cat([labels.to(torch.long).contiguous().view(self.dtype).reshape(-1), *rides,
                                hidden.detach().to(self.dtype).reshape(-1)])
        else:
            packed = torch.empty(label_elems + g_elems + s * b * h, dtype=self.dtype,
                                 device=self.layers.embedding_weight.device)
        arrived = self.queue.post(lambda: dist.broadcast(packed, src=self._root(), group=self.layers.pp_group,
                                                         async_op=True), (packed,))
        if not self.holder:
            self._release_sends()
            self._wait(arrived)  # the holder reads its own copy; the send finishes behind it
            if rider is not None:
                self.held[rider].grad_loss.copy_(packed[label_elems:label_elems + g_elems].view(torch.float32))
        start = label_elems + g_elems
        return packed[start:].view(s, b, h), packed[:label_elems].view(torch.long).view(b, s)

    def _release_sends(self) -> None:
        """The other ranks' earlier reduces' sends, waited and let go at this H, before its own is made: the
        last stage's rank waited each of those reduces in its H, before this H's broadcast, so the wait costs
        nothing here (its collective is done or finishing; a wait in G(k), after this H, kept the fp32
        [tokens, hidden] buffer alive one H longer)."""
        for held in self.held.values():
            held.release_send(self._wait)

    def _post_gather(self, stats: torch.Tensor) -> tuple[Pending, list[torch.Tensor]]:
        """Every rank's statistics: over TP (blocking: the last stage's TP ranks hold the same hidden state, so
        they arrive together), then over the pipeline group on the queue."""
        gathered = stats.unsqueeze(0)
        if self.layers.tp_group.size() > 1:
            parts = [torch.empty_like(gathered) for _ in range(self.layers.tp_group.size())]
            dist.all_gather(parts, gathered.contiguous(), group=self.layers.tp_group)
            gathered = torch.cat(parts)
        pp = self.layers.pp_group
        parts = [torch.empty_like(gathered) for _ in range(pp.size())]
        source = gathered.contiguous()
        return self.queue.post(lambda: dist.all_gather(parts, source, group=pp, async_op=True), (source, *parts)), parts


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
