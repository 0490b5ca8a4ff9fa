"""A pairwise covering subset of a Cartesian grid: every pair of values of any two factors appears in
some chosen case (greedy, deterministic). The fast tier and CI run those; the rest is marked slow and exhaustive
(``python -m pytest -q -m exhaustive`` runs them)."""

import itertools
from typing import List, Sequence, Tuple


def pairwise(factors: Sequence[Sequence]) -> List[Tuple]:
    grid = list(itertools.product(*factors))
    pairs = {
        (i, a, j, b) for i, j in itertools.combinations(range(len(factors)), 2) for a in factors[i] for b in factors[j]
    }

    def covers(case):
        return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(factors)), 2)}

    chosen: List[Tuple] = []
    while pairs:
        best = max(grid, key=lambda case: len(covers(case) & pairs))
        chosen.append(best)
        pairs -= covers(best)
    return chosen


def grid_with_slow_marks(pytest, factors: Sequence[Sequence]):
    """Every case of the grid as a pytest param, marked slow and exhaustive unless it is in the pairwise subset."""
    fast = set(pairwise(factors))
    rest = (pytest.mark.slow, pytest.mark.exhaustive)
    return [pytest.param(*case, marks=() if case in fast else rest) for case in itertools.product(*factors)]
