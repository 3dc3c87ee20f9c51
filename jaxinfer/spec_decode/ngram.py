"""Prompt-lookup (n-gram) proposer: copy what followed the latest earlier occurrence of the context's tail.

Text that quotes, edits or repeats its context (code changes, summaries that cite, structured
answers) often continues as it did the last time the same few tokens appeared. The proposer
takes the context's last ``n`` tokens, for ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, finds their latest earlier occurrence and proposes the up to ``k``
tokens that followed it. Pure numpy on the host: one vectorised comparison per ``n``.

Its drafts are a point mass (the proposer is certain of each token), which the verifier's
rejection sampling turns into "accept draft d with probability p(d)".
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: np.ndarray, num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_drafts`` tokens continuing ``token_ids`` [L] by prompt lookup; ``[]`` when no n-gram repeats."""
    length = token_ids.shape[0]
    if num_drafts < 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        # Windows starting at 0 .. length - n - 1: every occurrence before the suffix itself.
        windows = sliding_window_view(token_ids[: length - 1], n)  # [length - n, n]
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n  # the latest occurrence: the most recent context wins
            return token_ids[start : start + num_drafts].tolist()
    return []
