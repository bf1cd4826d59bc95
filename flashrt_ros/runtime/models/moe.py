"""The feed-forward block of a decoder layer: the dense SwiGLU MLP, or the sparse mixture of
experts of Qwen3.5 MoE models, behind one call.

The MoE block computes what transformers' ``Qwen3_5MoeSparseMoeBlock`` computes: router logits
x @ W_r, a float32 softmax over all experts, the top k, their probabilities renormalised to sum
to one (cast back to x's dtype); each chosen expert's SwiGLU output times its weight, summed;
plus the shared expert's SwiGLU output times sigmoid(x @ w_s). The router keeps no state: a
capsule of an MoE model holds the same regions as one of its dense twin.

Two ways to run the routed experts, the same sums in another order (both are checked against
transformers):

- ``grouped`` (any number of rows): the rows each expert was chosen by, through that expert's
  products. Which experts run is read on the host, so shapes follow the data: prefill, and a
  CPU's decode and verify, where a step computes the k routed experts only and reads nothing
  else of the expert weights. On the CPU backend each expert product is a ``Projection`` on the
  row kernel, so a verify row's bytes are a decode step's.
- ``gathered`` (few rows, fixed shapes): the k chosen experts' matrices gathered by index and
  multiplied as one batched product per projection; no host read and no data-dependent shape, so
  a decode step and a verify can be captured as CUDA graphs. The gather copies the k experts'
  weights once more per step, which is why a CPU (no graph to capture) runs ``grouped``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers import swiglu_mlp
from ..projection import Projection


class SwiGLU:
    """The dense MLP: gate and up fused into one [H, 2I] product, then down [I, H]."""

    __slots__ = ("gate_up", "down")

    def __init__(self, gate_up: Projection, down: Projection) -> None:
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor, fixed: bool = False) -> torch.Tensor:
        return swiglu_mlp(x, self.gate_up, self.down)

    def projections(self) -> list[Projection]:
        """The products every row streams."""
        return [self.gate_up, self.down]

    def expert_projections(self) -> list[Projection]:
        """The products of routed experts (a row streams only its own): none."""
        return []

    def routed_bytes(self) -> int:
        """Bytes of routed expert weights one row reads: none."""
        return 0


class SparseMoE:
    """A sparse MoE block over expert weights stacked [E, H, 2I] (gate | up) and [E, I, H].

    ``router`` is [H, E], or [H, E + 1] with the shared expert's gate as its last column (one
    product for both); ``shared`` is the shared expert, None where it has width 0."""

    __slots__ = ("router", "gate_up", "down", "top_k", "shared", "experts")

    def __init__(self, router: Projection, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                 shared: SwiGLU | None) -> None:
        num = gate_up.shape[0]
        if router.w.shape[1] != num + (shared is not None):
            raise ValueError(f"router has {router.w.shape[1]} columns for {num} experts "
                             f"{'and a shared gate' if shared is not None else ''}")
        self.router, self.gate_up, self.down, self.top_k, self.shared = router, gate_up, down, top_k, shared
        # Views of the stacks, one pair per expert: the grouped path's products.
        self.experts = [(Projection(gate_up[e]), Projection(down[e])) for e in range(num)]

    def __call__(self, x: torch.Tensor, fixed: bool = False) -> torch.Tensor:
        """x [n, H] -> [n, H]; ``fixed``: the gathered path (few rows, graph-capturable)."""
        num = self.gate_up.shape[0]
        logits = self.router(x)
        weights, index = route(logits[:, :num], self.top_k, x.dtype)
        out = self.gathered(x, weights, index) if fixed else self.grouped(x, weights, index)
        if self.shared is not None:
            out = out + torch.sigmoid(logits[:, num:]) * self.shared(x)
        return out

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Each expert over the rows that chose it. A row's contributions are added in ascending
        expert order whatever the other rows, so a row's bytes do not depend on them."""
        k = index.shape[1]
        flat = index.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()   # the host read
        rows, scale = order // k, weights.flatten().index_select(0, order)
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count:
                r = rows[start:start + count]
                gate_up, down = self.experts[e]
                y = swiglu_mlp(x.index_select(0, r), gate_up, down)
                out.index_add_(0, r, y.mul_(scale[start:start + count, None]))
            start += count
        return out

    def gathered(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The chosen experts' matrices gathered by index, one batched product per projection;
        the k contributions summed in top-k order, one add at a time, so a row's bytes do not
        depend on the number of rows."""
        n, k = index.shape
        flat = index.flatten()
        # Each row k times, [n * k, 1, H], by expand and copy: no repeat count to read back.
        rows = x[:, None].expand(n, k, x.shape[1]).reshape(n * k, 1, x.shape[1])
        gate, up = torch.bmm(rows, self.gate_up.index_select(0, flat)).chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate).mul_(up), self.down.index_select(0, flat)).view(n, k, -1)
        out = y[:, 0] * weights[:, :1]
        for j in range(1, k):
            out = out + y[:, j] * weights[:, j:j + 1]
        return out

    def projections(self) -> list[Projection]:
        """The products every row streams: the router (with the shared gate) and the shared expert."""
        return [self.router] + (self.shared.projections() if self.shared is not None else [])

    def expert_projections(self) -> list[Projection]:
        return [p for pair in self.experts for p in pair]

    def routed_bytes(self) -> int:
        """Bytes of expert weights one row reads: its k experts'."""
        per_expert = (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()
        return self.top_k * per_expert


def route(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [n, E] -> (weights [n, k] in ``dtype``, expert ids [n, k]): float32 softmax,
    top k, renormalised to sum to one. The sum is taken one add at a time, so a row's weights
    do not depend on the other rows (no reduction kernel that tiles by the row count)."""
    top, index = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    total = top[:, :1]
    for j in range(1, top_k):
        total = total + top[:, j:j + 1]
    return (top / total).to(dtype), index
