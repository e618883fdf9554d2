"""The orthonormal rotation of the ``"linearpatch"`` repair: a Hadamard matrix of the hidden
size, scaled by ``1/sqrt(n)``, or where none is constructed here, a seeded random rotation.

A Hadamard matrix of order n (entries ±1, ``H Hᵀ = n I``) exists only for n = 1, 2 or a
multiple of 4. :func:`hadamard_rotation` builds one for ``n = 2^k · m`` (m odd) as a
Kronecker product ``B ⊗ S``:

- ``m = 1``: Sylvester's construction alone (``S_{2j} = [[S_j, S_j], [S_j, −S_j]]``);
- otherwise ``B`` of order ``2^j · m`` for the smallest ``j <= k`` that one of Paley's two
  constructions reaches with a prime ``q`` (Paley I: order ``q + 1``, ``q ≡ 3 mod 4``;
  Paley II: order ``2(q + 1)``, ``q ≡ 1 mod 4``), times Sylvester's ``S`` of order ``2^(k−j)``.
  SmolLM2's 576 = 9 · 64 is Paley II of order 36 (q = 17) ⊗ Sylvester 16; Gemma-3's 640 =
  5 · 128 is Paley I of order 20 (q = 19) ⊗ Sylvester 32; 768 = 3 · 256 is Paley I 12 (q = 11)
  ⊗ Sylvester 64; 896 = 7 · 128 is Paley II 28 (q = 13) ⊗ Sylvester 32.

Other sizes (those where no Hadamard matrix exists, e.g. 6 or 10, and those whose order needs
another construction, e.g. 92 = 4 · 23) fall back to a random orthogonal matrix: the Q factor
of the QR decomposition of a standard Gaussian ``(n, n)`` float64 matrix drawn from
``torch.Generator().manual_seed(0)``, its columns' signs fixed by ``R``'s diagonal (so the
same matrix on every run). The description returned with the matrix names what was used,
and the repair's record keeps it.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["FALLBACK_SEED", "hadamard_matrix", "hadamard_rotation"]

#: Seed of the random orthogonal rotation used where no Hadamard matrix is constructed.
FALLBACK_SEED = 0


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    f = 2
    while f * f <= q:
        if q % f == 0:
            return False
        f += 1
    return True


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[a, b] = χ(b − a)`` with χ the quadratic character modulo the prime q (χ(0) = 0)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = [0] + [1 if r in squares else -1 for r in range(1, q)]
    idx = torch.arange(q)
    diff = (idx[None, :] - idx[:, None]) % q
    return torch.tensor(chi, dtype=torch.float64)[diff]


def _conference(q: int, sign: int) -> torch.Tensor:
    """The ``(q + 1)`` conference matrix ``[[0, 1ᵀ], [sign · 1, Q]]`` of Paley's constructions."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:] = 1.0
    c[1:, 0] = float(sign)
    c[1:, 1:] = _jacobsthal(q)
    return c


def _sylvester(order: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < order:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _paley(order: int) -> tuple[torch.Tensor, str] | None:
    """A Hadamard matrix of ``order`` (a multiple of 4) by Paley I or II with a prime q, or ``None``."""
    q = order - 1
    if _is_prime(q) and q % 4 == 3:  # I: I + C, C antisymmetric
        return torch.eye(order, dtype=torch.float64) + _conference(q, -1), f"Paley I {order} (q = {q})"
    q = order // 2 - 1
    if _is_prime(q) and q % 4 == 1:  # II: C ⊗ [[1, 1], [1, −1]] + I ⊗ [[1, −1], [−1, −1]], C symmetric
        c = _conference(q, 1)
        plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, plus) + torch.kron(torch.eye(q + 1, dtype=torch.float64), minus), f"Paley II {order} (q = {q})"
    return None


def hadamard_matrix(n: int) -> tuple[torch.Tensor, str] | None:
    """A ±1 float64 Hadamard matrix of order ``n`` (``H Hᵀ = n I``) and how it was built
    (see the module's text), or ``None`` where none is constructed here.

    Raises:
        ValueError: ``n`` is not an int >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: a Hadamard order is an int >= 1")
    k = (n & -n).bit_length() - 1
    m = n >> k
    if m == 1:
        return _sylvester(n), f"Sylvester {n}"
    for j in range(k + 1):
        order = m << j
        if order % 4:
            continue
        base = _paley(order)
        if base is not None:
            matrix, how = base
            rest = n // order
            if rest == 1:
                return matrix, how
            return torch.kron(matrix, _sylvester(rest)), f"{how} x Sylvester {rest}"
    return None


@functools.lru_cache(maxsize=8)
def _rotation(n: int) -> tuple[torch.Tensor, str]:
    built = hadamard_matrix(n)
    if built is not None:
        matrix, how = built
        return matrix / float(n) ** 0.5, f"Hadamard {n} = {how}, scaled by 1/sqrt({n})"
    gen = torch.Generator().manual_seed(FALLBACK_SEED)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return q * signs[None, :], (f"random orthogonal {n} (no Hadamard matrix of order {n} is constructed: QR of a "
                                f"Gaussian matrix, seed {FALLBACK_SEED})")


def hadamard_rotation(n: int) -> tuple[torch.Tensor, str]:
    """The ``(n, n)`` float64 orthonormal rotation of the LinearPatch repair (a Hadamard matrix
    scaled by ``1/sqrt(n)``, else the seeded random rotation: see the module's text) and its
    description. A new tensor on each call (the cached one is never handed out).

    Raises:
        ValueError: ``n`` is not an int >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: a rotation's size is an int >= 1")
    matrix, how = _rotation(n)
    return matrix.clone(), how
