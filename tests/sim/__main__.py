"""Run simulated schedules on demand: ``python -m tests.sim --schedules 200000``.

Prints schedules explored, faults injected and invariant checks per second; a failing seed
is replayed with its trace, shrunk to the smallest plan that still fails.

    python -m tests.sim --schedules 20000              # seeds 0..19999
    python -m tests.sim --schedules 5000 --start 1000000  # other seeds
    python -m tests.sim --seed 709                     # replay one seed, print its trace
    python -m tests.sim --mutant fence-not-floored     # a mutant: stops at its first failure
    python -m tests.sim --two-step                     # the guard's two-step commit path
"""

from __future__ import annotations

import argparse
import sys

from .harness import campaign, make_plan, make_publish_plan, make_two_step_plan, run_plan, shrink
from .mutants import BY_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", type=int, default=2000, help="how many seeds to run")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--seed", type=int, help="replay this one seed with its full trace")
    parser.add_argument(
        "--mutant", choices=sorted(BY_NAME), help="run a mutant of the library instead"
    )
    parser.add_argument(
        "--two-step",
        action="store_true",
        help="the guard's two-step path (store and lock apart), without client resends and "
        "network delays",
    )
    parser.add_argument(
        "--publish",
        action="store_true",
        help="standalone publishes (the library's PUBLISH decision) among the guard workers",
    )
    parser.add_argument("--no-shrink", action="store_true", help="print the unshrunk trace")
    parser.add_argument("--progress", type=int, default=0, help="print a line every N schedules")
    args = parser.parse_args(argv)
    mutant = BY_NAME[args.mutant] if args.mutant else None
    make = make_two_step_plan if args.two_step else make_plan
    if args.publish or (mutant is not None and mutant.publish):
        make = make_publish_plan
    if mutant is not None:
        mutant.check()

    if args.seed is not None:
        plan = make(args.seed)
        res = run_plan(plan, mutant)
        print(plan.describe())
        print(res.format_trace())
        print(res.violation or "no violation")
        return 1 if res.failed else 0

    seeds = range(args.start, args.start + args.schedules)
    if args.progress:
        total = None
        for lo in range(seeds.start, seeds.stop, args.progress):
            part = campaign(
                range(lo, min(lo + args.progress, seeds.stop)),
                mutant,
                stop_at_first=mutant is not None,
                make=make,
            )
            total = part if total is None else _merge(total, part)
            print(
                f"... {total.schedules} schedules, {len(total.failures)} failing, "
                f"{total.seconds:.0f}s CPU",
                flush=True,
            )
            if mutant is not None and total.failures:
                break
        result = total
    else:
        result = campaign(seeds, mutant, stop_at_first=mutant is not None, make=make)
    assert result is not None
    print(result.summary())
    if not result.failures:
        print("all invariants held" if mutant is None else f"mutant {mutant.name} NOT caught")
        return 0 if mutant is None else 1
    first = result.failures[0]
    print(f"\nfirst failing seed: {first.plan.seed}: {first.violation}")
    shown = first if args.no_shrink else shrink(first.plan, mutant)
    print(("plan" if args.no_shrink else "shrunk plan") + f" (size {shown.plan.size()}):")
    print(shown.plan.describe())
    print(shown.format_trace())
    print(shown.violation)
    return 0 if mutant is not None else 1


def _merge(a, b):  # type: ignore[no-untyped-def]
    a.schedules += b.schedules
    a.steps += b.steps
    a.checks += b.checks
    a.requests += b.requests
    a.faults.update(b.faults)
    a.outcomes.update(b.outcomes)
    a.unfinished += b.unfinished
    a.late_starts += b.late_starts
    a.excused_fences += b.excused_fences
    a.reruns_after_loss += b.reruns_after_loss
    a.failures += b.failures
    a.seconds += b.seconds
    return a


if __name__ == "__main__":
    sys.exit(main())
