"""Assemble `opdcache demo --ablation staleness` reports of several seeds into the README's table and a plot.

    for s in 0 1 2; do opdcache demo --seed $s --workdir W$s --ablation staleness; done
    python benchmarks/demo_staleness.py W0/ablation_staleness_seed0.json W1/... W2/... --png benchmarks/results/staleness.png
"""

import argparse
from pathlib import Path

from opdcache.demo.staleness import summarize

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
    print(summarize(args.reports, args.png))
