"""Stage 5: canonical math -> IR (einsum contractions and elementwise steps).

The same rule lowers the forward pass and every gradient: a sum of terms, each term a
product of tensor accesses and pointwise factors summed over some indices, becomes one
einsum per term (pointwise factors materialized first, over their own indices only),
and the terms are added after aligning their axes. Concretely:

- A pointwise factor whose indices no single operand covers (`(x[b,i,k] - x[b,j,k])**2`)
  would be a tensor bigger than any operand; when it is a polynomial, the term is expanded
  into monomials instead, each of which contracts directly.
- Three or more operands contract pairwise in the order `opt_einsum` finds optimal for
  representative sizes; TF's einsum would guess with unknown dims taken as 1.
- A Kronecker delta left between two gradient indices becomes an identity-matrix operand
  (`tf.eye`) in the einsum, which places the result on the diagonal; einsum itself cannot
  write repeated output labels.
- Identical expressions are computed once per function body (hash-consing on the frozen
  IR), which shares work across the gradients of all inputs.

The parts, one module each: `pointwise` (elementwise steps), `contract` (einsum
contractions), `kernels` (recognised patterns: convolutions, prefix sums), `gathers`
(computed positions and their transposes), `common` (the body being built, helpers), and
`lowerer` (the `Lowerer` made of them, and `lower`).
"""

from ..derive import Backward
from ..model import tensor
from .common import align
from .lowerer import Lowerer, lower, lower_sizes

__all__ = ["Backward", "Lowerer", "align", "lower", "lower_sizes", "tensor"]
