"""The model's matrix products: ``x @ w`` with each weight stored once, [in, out].

The torch product is the reference path, for any number of rows and on any device. On a CPU in
float32, with the CPU backend, products of up to ``row_product.MAX_ROWS`` rows (decode steps,
verify rows) run on its row kernel instead; prompt chunks stay on torch.
"""
from __future__ import annotations

import torch

from .backends.cpu import row_product


class Projection:
    """``x @ w`` for w [in, out]; few-row inputs through the row kernel when ``partials`` (the
    engine's shared scratch, ``row_product.scratch``) is given."""

    __slots__ = ("w", "partials")

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.partials = w, None

    def use_row_kernel(self, partials: torch.Tensor) -> None:
        """Few-row products from now on run on the row kernel, with this scratch."""
        row_product.check_weight(self.w, partials)
        self.partials = partials

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.partials is not None and x.shape[0] <= row_product.MAX_ROWS and x.shape[0]:
            return row_product.times_rows(x, self.w, self.partials)
        return x @ self.w
