"""What an overloaded ranker says, as both ends of a Rank call read it.

A ranker refuses a ranking call with RESOURCE_EXHAUSTED in two ways (services/ranker/admission.py):
at once, on admission (the call would not complete within its deadline there, so another
instance may take it), or late: admitted, it was still waiting for the engine when its queue
budget ran out (the instance drains slower than it measured). A late refusal carries
LATE_REFUSAL in its details; the router does not retry it (services/router/forwarding.py).
"""

from __future__ import annotations

LATE_REFUSAL = "late_refusal"


def is_late_refusal(details: str | None) -> bool:
    """A RESOURCE_EXHAUSTED detail string is a ranker's late refusal."""
    return details is not None and LATE_REFUSAL in details
