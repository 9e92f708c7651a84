"""Assemble `opdcache demo --ablation storage` reports of several seeds into the README's table.

    for s in 0 1 2; do opdcache demo --seed $s --workdir S$s --ablation storage; done
    python benchmarks/demo_storage.py S0/ablation_storage.json S1/ablation_storage.json S2/ablation_storage.json
"""

import argparse
from pathlib import Path

from opdcache.demo.storage import summarize

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    print(summarize(ap.parse_args().reports))
