"""What query expansion costs per request: the embedded default server (robust starter, or the plain one
with ``--starter plain``; demo gallery) answering the same distinct captions without expansion, with bank
expansion (30 neighbours), below the query's own first answer (``keep_first``, ``keep_within``), over two
to four mean-shift rounds of 64 to 96 neighbours (``rounds``; four rounds of 96, hub-corrected, the kept
answer's query moved 0.25 of the way: the robust default), with the first-answer bundle's sure answers on
top (``lead_margin``: one more text-tower pass; only where the server has a first-answer bundle), with
lists reordered by hub-corrected scores (``hub_weight``: 100 results searched a list), and with the bank's
query head (``head``: within 7, always, with hub correction and ``keep_blend`` 0.3 the plain starter's
default; half its move, ``blend``; and with one round of 64). Rounds alternate the configurations so a
drift of the machine hits all of them alike; medians over the rounds.

    python -m paraseek.loadtests.bench_expansion --data ../shared/data [--seconds 5 --rounds 3] [--starter plain]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

from paraseek.loadtests import DEFAULT_DATA, temporary_folder
from paraseek.loadtests.bench_service import drive, round_medians, start_paraseek
from paraseek.loadtests.machine import cpu_description
from paraseek.loadtests.queries import caption_groups
from paraseek.loadtests.server import stop_server

BANK = {"method": "bank", "n": 30}
CONFIGS: dict[str, dict[str, Any]] = {
    "none": {"method": "none"},
    "bank30": BANK,
    "bank30 keep_first 1": {**BANK, "keep_first": 1},
    "bank30 keep 1 within 5": {**BANK, "keep_first": 1, "keep_within": 5},
    "bank64 x3 keep 1 in 7": {"method": "bank", "n": 64, "rounds": 3, "keep_first": 1, "keep_within": 7},
    "bank64 x3 in 7 + lead": {"method": "bank", "n": 64, "rounds": 3, "keep_first": 1, "keep_within": 7,
                              "lead_margin": 0.035},
    "bank64 x3 in 7 + hub": {"method": "bank", "n": 64, "rounds": 3, "keep_first": 1, "keep_within": 7,
                             "hub_weight": 0.55},
    "bank72 x3 in 7 + hub": {"method": "bank", "n": 72, "rounds": 3, "keep_first": 1, "keep_within": 7,
                             "hub_weight": 0.55},
    "bank96 x4 in 7 @0.25 + hub": {"method": "bank", "n": 96, "rounds": 4, "keep_first": 1, "keep_within": 7,
                                   "keep_blend": 0.25, "hub_weight": 0.75},
    "bank64 x2 keep 1 in 5": {"method": "bank", "n": 64, "rounds": 2, "keep_first": 1, "keep_within": 5},
    "head keep 1 in 7": {"method": "head", "rounds": 0, "keep_first": 1, "keep_within": 7},
    "head keep_first 1": {"method": "head", "rounds": 0, "keep_first": 1},
    "head blend 0.5": {"method": "head", "rounds": 0, "blend": 0.5},
    "head keep 1 + hub": {"method": "head", "rounds": 0, "keep_first": 1, "hub_weight": 0.25},
    "head keep 1 @0.3 + hub": {"method": "head", "rounds": 0, "keep_first": 1, "keep_blend": 0.3, "hub_weight": 0.5},
    "head+bank64 keep 1 in 7": {"method": "head", "n": 64, "rounds": 1, "keep_first": 1, "keep_within": 7},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--home", type=Path, default=None, help="PARASEEK_HOME (default: a new temporary one)")
    p.add_argument("--seconds", type=float, default=5.0, help="per configuration, round and concurrency")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--starter", choices=["robust", "plain"], default=None,
                   help="which starter the server embeds (sets PARASEEK_STARTER; default: the server's setting)")
    args = p.parse_args(argv)
    texts = [c for g in caption_groups(args.data / "coco-captions/train_captions.tsv") for c in g]
    home = args.home or temporary_folder("paraseek-bench-expansion-")
    proc, url = start_paraseek(home, **({"PARASEEK_STARTER": args.starter} if args.starter else {}))
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        with urllib.request.urlopen(f"{url}/v1/info", timeout=30) as r:
            info = json.load(r)
        served, first_answer = info["bundle"], info["first_answer"]  # what the server embedded, named in the report
        configs = {name: e for name, e in CONFIGS.items() if first_answer is not None or "lead_margin" not in e}
        for round_ in range(args.rounds):
            for conc in args.concurrency:
                for index, (name, expansion) in enumerate(configs.items()):
                    # distinct texts per row: no request is a cache hit
                    offset = ((round_ * len(args.concurrency) + conc) * len(CONFIGS) + index) * 1_000_000

                    def body(i: int, offset=offset, expansion=expansion) -> dict:
                        return {"query": f"{texts[i % len(texts)]} ({offset + i})", "k": 10, "expansion": expansion}

                    results.setdefault((name, conc), []).append(asyncio.run(drive(url, body, conc, args.seconds)))
    finally:
        stop_server(proc, 10)

    lead = (f"first-answer bundle {first_answer['name']} v{first_answer['version']}, {first_answer['precision']}"
            if first_answer is not None else "no first-answer bundle: the lead row is left out")
    print(f"\nexpansion cost: the embedded default ({served['name']} v{served['version']}, {served['precision']}; {lead}) "
          f"over the demo gallery, {args.rounds} rounds x {args.seconds:.0f} s, loopback; {cpu_description()}")
    width = max(map(len, CONFIGS))
    print(f"{'expansion':{width}} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'p50 / bank30':>13} {'fail':>5}")
    failures = 0
    for conc in args.concurrency:
        base = round_medians(results[("bank30", conc)])[0]
        for name in configs:
            p50, p99, qps, fail = round_medians(results[(name, conc)])
            failures += fail
            print(f"{name:{width}} {conc:>4} {p50:8.2f} {p99:8.2f} {qps:8.1f} {p50 / base:13.2f} {fail:>5}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
