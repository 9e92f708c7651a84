"""Assemble `opdcache demo --ablation quantized` reports of several seeds into the README's table.

    for s in 0 1 2; do opdcache demo --seed $s --workdir Q$s --ablation quantized; done
    python benchmarks/demo_quantized.py Q0/ablation_quantized_lightning.json Q1/... Q2/...
"""

import argparse
from pathlib import Path

from opdcache.demo.quantized import summarize

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    print(summarize(ap.parse_args().reports))
