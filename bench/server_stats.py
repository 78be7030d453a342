"""What the server counted during a run: the router's ``/metrics`` read before and after.

Speculative decoding happens on the decode nodes; the router exports their counters
(``pdserve_decode_drafts``, ``…_draft_tokens``, ``…_accepted_tokens``, one series per
instance). The difference over a run gives its acceptance rate and mean accepted length. A
server without ``/metrics`` (another OpenAI endpoint) or a gRPC target gives nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_COUNTERS = {
    "pdserve_decode_drafts": "drafts",
    "pdserve_decode_draft_tokens": "draft_tokens",
    "pdserve_decode_accepted_tokens": "accepted_tokens",
}


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding over one run, summed over the decode instances."""

    drafts: int = 0  # verification runs that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification run: the accepted drafts plus the target's own."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }

    def __sub__(self, before: SpecDecodeStats) -> SpecDecodeStats:
        # an instance that restarted mid-run counts from 0 again: never report less than 0
        return SpecDecodeStats(
            max(0, self.drafts - before.drafts),
            max(0, self.draft_tokens - before.draft_tokens),
            max(0, self.accepted_tokens - before.accepted_tokens),
        )


def parse_spec_counters(exposition: str) -> SpecDecodeStats:
    """The speculative-decoding counters of a Prometheus text exposition, summed."""
    sums = dict.fromkeys(_COUNTERS.values(), 0)
    for family in text_string_to_metric_families(exposition):
        field = _COUNTERS.get(family.name)
        if field is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                sums[field] += int(sample.value)
    return SpecDecodeStats(**sums)


async def scrape_spec_counters(
    base_url: str, api_key: str | None, timeout_s: float = 10.0
) -> SpecDecodeStats | None:
    """The router's counters now; None when ``/metrics`` is not there or not readable."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
            response = await client.get(f"{base_url.rstrip('/')}/metrics")
            response.raise_for_status()
            return parse_spec_counters(response.text)
    except (httpx.HTTPError, ValueError):
        return None
