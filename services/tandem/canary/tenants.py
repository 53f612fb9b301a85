"""How much each tenant's observations weigh in an arm's statistics: no tenant more than a share of the weight.

Without a cap, one tenant that sends most of an arm's traffic (say a flood of deliberately slow requests on the
candidate) *is* that arm's statistics, and can drive a rollback alone. So every statistic of an arm is computed with
each tenant's observations down-weighted until that tenant holds at most `max_share` of the statistic's total weight:

    factor_t = min(1, x / total_t), with x the largest level such that x <= share * sum_t min(total_t, x)

("water filling": tenants at or under the level keep their full weight, heavier ones are cut to it). Each statistic
caps its own natural weight: requests for the error rate, timed requests for TPOT percentiles, drafted tokens for the
acceptance rate (so a tenant cannot buy weight with long generations), greedy checks for the mismatch rate, and
distinct sessions for `min_sessions` (so a flood of sessions alone does not make an arm ready to judge).

Weighting rather than dropping the surplus: every observation still counts, and a tenant's own statistic is estimated
from all of its traffic; only its share of the arm's is bounded. A tenant within the cap weighs exactly as before, and
with one tenant (no API keys: everyone is the anonymous tenant "") nothing changes. With fewer tenants than
1 / max_share the cap cannot hold for all of them; they then weigh equally (share 1 / tenants).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

_TOLERANCE = 1e-9


def tenant_factors(totals: Mapping[str, float], max_share: float) -> dict[str, float]:
    """Per tenant, the factor in (0, 1] that its observations' weights are multiplied by (see the module docstring);
    tenants with no weight get 1."""
    positive = {tenant: float(total) for tenant, total in totals.items() if total > 0}
    factors = {tenant: 1.0 for tenant in totals}
    if len(positive) < 2:
        return factors
    share = max(max_share, 1.0 / len(positive))
    heaviest = sorted(positive.values(), reverse=True)
    free = sum(heaviest)  # the weight of the tenants below the level
    level = math.inf
    for capped, total in enumerate(heaviest):
        # With the `capped` heaviest tenants at the level x: x = share * (free + capped * x).
        room = 1.0 - share * capped
        level = share * free / room if room > _TOLERANCE else min(heaviest)
        if total <= level * (1.0 + _TOLERANCE):
            break
        free -= total
    return factors | {tenant: min(1.0, level / total) for tenant, total in positive.items()}


def capped_total(totals: Mapping[str, float], max_share: float) -> float:
    """The sum of the tenants' totals after the cap (e.g. the sessions that count towards min_sessions)."""
    factors = tenant_factors(totals, max_share)
    return sum(total * factors[tenant] for tenant, total in totals.items())


def weighted_percentiles(pairs: Sequence[tuple[float, float]], qs: Sequence[float]) -> list[float | None]:
    """The qs-th percentiles (0-100) of (value, weight) pairs sorted by value, weights positive; None each for no
    pairs. Weights act as frequencies: each value counts as weight / (the smallest weight) copies, and the copies get
    observations.percentile's rule (linear interpolation between closest ranks), so equal weights give exactly that
    percentile."""
    if not pairs:
        return [None] * len(qs)
    unit = min(weight for _, weight in pairs)
    ends = list(itertools.accumulate(weight / unit for _, weight in pairs))  # ends[i] - 1: the rank of i's last copy
    found: list[float | None] = []
    for q in qs:
        rank = (ends[-1] - 1.0) * q / 100.0
        index = min(bisect.bisect_left(ends, rank + 1.0), len(pairs) - 1)  # the first value with a copy at >= rank
        first = ends[index - 1] if index else 0.0  # the rank of its first copy
        if rank >= first or not index:
            found.append(pairs[index][0])
        else:  # between the previous value's last copy and this one's first
            low = pairs[index - 1][0]
            found.append(low + (pairs[index][0] - low) * (rank - (first - 1.0)))
    return found


def weighted_percentile(values: Iterable[tuple[float, float]], q: float) -> float | None:
    """One percentile of (value, weight) pairs in any order (see weighted_percentiles)."""
    return weighted_percentiles(sorted(pair for pair in values if pair[1] > 0), [q])[0]
