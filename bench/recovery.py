"""Recovery times of the failure tests: how long the survivors of SIGKILLed workers take to carry on.

- ``membership``: 4 processes all-reduce; worker 2, then worker 0 (rank 0 of the re-formed group) is SIGKILLed;
  per survivor and failure, the seconds from the failed all-reduce to the first all-reduce of the re-formed group
  (``plait.parallel.membership``; tests/distributed/membership_worker.py). Target: under 15 s each.
- ``resilience``: 3 resilient workers (heterogeneous pipelines); rank 0, then the other pipeline's only rank is
  SIGKILLed; the seconds from the failure seen to the replayed step done, on worker 1
  (tests/distributed/resilience_worker.py). Target: under 20 s each.

The tests run the same scenarios and check what they must agree on (members, ranks, sums, copies, losses); the
times depend on the machine and are printed here: about 25 s (membership) and 40 s (resilience) for the whole runs
on an idle 2-core CPU. ``--rounds`` repeats each scenario.

Run: ``.venv/bin/python bench/recovery.py [--rounds 1]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGETS_S = {"membership": 15.0, "resilience": 20.0}
"""The recovery time each scenario should stay under (seconds)."""


def recovery_times(scenario: str) -> dict[int, list[float]]:
    """Run ``scenario`` (``"membership"`` or ``"resilience"``) once: per surviving worker that reports, its recovery
    times in seconds, one per failure."""
    from tests.distributed import membership_worker, resilience_worker
    from tests.distributed.spawning import free_port, spawn_and_exit_codes

    module, world, reporting = ((membership_worker, 4, (1, 3)) if scenario == "membership"
                                else (resilience_worker, 3, (1,)))
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    codes = spawn_and_exit_codes(module.worker, (world, port), world, 600, scenario)
    expected = [-9 if w in module.VICTIMS else 0 for w in range(world)]
    if codes != expected:
        raise RuntimeError(f"{scenario}: exit codes {codes}, expected {expected}")
    return {w: json.loads(store.get(f"result/{w}"))["recovery_s"] for w in reporting}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", choices=sorted(TARGETS_S), default=None)
    args = parser.parse_args(argv)
    print(f"{'scenario':<12} {'round':>5} {'worker':>6}  recovery s (one per failure)   target")
    for r in range(args.rounds):
        for scenario, target in TARGETS_S.items():
            if args.only not in (None, scenario):
                continue
            for worker, times in recovery_times(scenario).items():
                verdict = "ok" if all(0 < t < target for t in times) else "OUTSIDE"
                print(f"{scenario:<12} {r:>5} {worker:>6}  {', '.join(f'{t:6.2f}' for t in times):<30} "
                      f"< {target:.0f} s: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
