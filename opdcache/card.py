"""The cache's dataset card (README.md): Hub-readable, with YAML ``configs:`` for ``datasets.load_dataset``.

``datasets.load_dataset(<cache dir or repo>, "rollouts")`` then loads the rollouts, and
``datasets.load_dataset(<cache>, "teacher-<slug>")`` one teacher's scores, each with every column.
"""

from __future__ import annotations


import yaml

from opdcache import schema as S
from opdcache.storage import write_text_atomic


def config_name(table: str) -> str:
    return table if not table.startswith("teachers/") else "teacher-" + table.split("/", 1)[1]


def render(manifest: dict) -> str:
    configs = []
    for i, name in enumerate(sorted(manifest["tables"], key=lambda t: (t.startswith("teachers/"), t))):
        configs.append({"config_name": config_name(name), "data_files": [{"split": "train", "path": f"{name}/*.parquet"}],
                        **({"default": True} if i == 0 else {})})
    header = {"configs": configs, "tags": ["opdcache", "distillation", "on-policy-distillation"], "license": "other"}
    lines = ["---", yaml.safe_dump(header, sort_keys=False).rstrip(), "---", "",
             f"# opdcache {manifest['kind']} cache", "",
             "Written by [opdcache](https://pypi.org/project/opdcache/) "
             f"{manifest['opdcache_version']} (format v{manifest['format_version']}). "
             "`opdcache.json` is the manifest: lineage, settings, and every shard's size and sha256.", "",
             "| config | rows | tokens | stores | model |", "| --- | --- | --- | --- | --- |"]
    for name, entry in sorted(manifest["tables"].items()):
        rows = sum(s["rows"] for s in entry["shards"])
        tokens = sum(s["tokens"] for s in entry["shards"])
        model = (entry.get("model") or {}).get("name_or_path", "")
        lines.append(f"| `{config_name(name)}` | {rows:,} | {tokens:,} | {', '.join(entry['params']['stores'])} | {model} |")
    lines += ["", "```python", "import datasets",
              f"rollouts = datasets.load_dataset(PATH_OR_REPO, {config_name(manifest['kind'])!r}, split='train')", "```", "",
              "## Columns", "",
              "Per-token columns are aligned with `response_ids`: position t is the value for predicting `response_ids[t]` "
              "from `prompt_ids + response_ids[:t]`. Teacher tables are row-aligned with the rollouts by `id`.", ""]
    present = {c for entry in manifest["tables"].values()
               for c in (col.name for col in S.columns(entry["kind"], S.StoreParams.from_dict(entry["params"])))}
    for kind in ("sft", "rollouts", "teacher"):
        if not any(e["kind"] == kind for e in manifest["tables"].values()):
            continue
        lines.append(f"**{kind}**")
        lines.append("")
        for col in S.columns(kind):
            if col.name in present:
                lines.append(f"- `{col.name}`: {col.doc}")
        lines.append("")
    for name, entry in sorted(manifest["tables"].items()):
        dtype = entry["params"].get("hidden_dtype")
        if "hidden" in entry["params"]["stores"] and dtype in HIDDEN_RECIPES:
            lines += [f"### Decoding `hidden` in `{config_name(name)}` ({dtype})", "",
                      f"The column stores the teacher's {dtype} hidden states bit-exact, as their raw 16-bit patterns in `uint16` "
                      "(Parquet has no bfloat16): every client (datasets, DuckDB, Polars, pandas) returns integers, and the field's "
                      "`opdcache.dtype` metadata is lost once loaded. Decode a row like this:", "",
                      "```python", HIDDEN_RECIPES[dtype], "```", ""]
        params = entry["params"]
        if params.get("topk_precision") or params.get("topk_mass") is not None:
            topk = entry.get("topk") or {}
            d = topk.get("distortion") or {}
            precision = params.get("topk_precision") or "float32"
            lines += [f"### Decoding the compact top-k in `{config_name(name)}` (format v{4 if precision == 'prob14' else 3}: {precision}, residual mass "
                      f"{params.get('topk_mass')})", "",
                      "Each position keeps the teacher's most likely tokens until the probability left out is at most the "
                      "residual mass (at most `top_k`), most likely first; the remaining slots hold id `-1` (and log-prob "
                      "`-inf`). `topk_tail` is the probability outside the kept entries."
                      + (" The log-probs are IEEE float16 bit patterns in `uint16`." if precision == "float16" else "")
                      + (" The values are probabilities as `uint16` codes c (probability c x 2^-14, to within 2^-15; entries "
                         "below 2^-15 are in the tail), and the kept entries are in ascending id order, not most likely first."
                         if precision == "prob14" else "")
                      + (f" Measured when written, against the exact top-k: |log-prob error| at most {d['max_abs_logprob_error']:.2e}, "
                         f"{d['mean_entries']:.1f} entries a position, at most {d['max_moved_mass']:.2e} of the probability moved into "
                         "the tail." if d else ""), "", "Decode a row like this:", "",
                      "```python", TOPK_RECIPE[precision], "```", ""]
        if "sampled" in params["stores"]:
            lines += [f"### Reading the sampled store in `{config_name(name)}` (format v3, RS-KD)", "",
                      f"At each position, {params['samples_per_position']} tokens were drawn from the teacher's temperature-1 "
                      "distribution; `sampled_ids` holds the distinct ones, most drawn first, padded with `-1`; `sampled_counts` "
                      "how often each was drawn; `sampled_logprobs` the teacher's log-prob of each, as float16 bits in `uint16`. "
                      "(1/m) * sum(count * (teacher_logprob - student_logprob)) is an unbiased estimate of the forward KL.", "",
                      "```python", SAMPLED_RECIPE, "```", ""]
        if entry["kind"] == "teacher":
            from opdcache.fidelity import describe

            lines += [f"### Error of `{config_name(name)}` against the teacher's full vocabulary", "",
                      "Measured while scoring, from the full distribution the scorer streams (no student involved):", ""]
            lines += [f"- {line}" for line in describe(entry.get("fidelity") or {})] + [""]
    return "\n".join(lines)


HIDDEN_RECIPES = {
    "bfloat16": "import numpy as np, torch\n"
                "bits = np.asarray(row['hidden'], dtype=np.uint16)  # [tokens, hidden] raw bfloat16 bits\n"
                "hidden = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)",
    "float16": "import numpy as np\n"
               "hidden = np.asarray(row['hidden'], dtype=np.uint16).view(np.float16)  # [tokens, hidden]",
}
"""How to turn a row's 16-bit ``hidden`` bit patterns back into numbers, per stored dtype (shown in the card, run by a test)."""

_TOPK_RECIPE = ("import numpy as np\n"
                "ids = np.asarray(row['topk_ids'])  # [tokens, top_k], -1 = no entry\n"
                "logprobs = {decode}\n"
                "kept = ids != -1\n"
                "entries = [dict(zip(i[k].tolist(), lp[k].tolist())) for i, lp, k in zip(ids, logprobs, kept)]\n"
                "tail = np.asarray(row['topk_tail'])  # probability outside the kept entries")
TOPK_RECIPE = {
    "float16": _TOPK_RECIPE.format(decode="np.asarray(row['topk_logprobs'], dtype=np.uint16).view(np.float16).astype(np.float32)"),
    "float32": _TOPK_RECIPE.format(decode="np.asarray(row['topk_logprobs'], dtype=np.float32)"),
    "prob14": _TOPK_RECIPE.format(decode="np.log(np.asarray(row['topk_logprobs'], dtype=np.float64) * 2.0 ** -14)  "
                                         "# uint16 codes: probability c x 2^-14"),
}
"""Decoding a compact top-k row into {token id: log-prob} per position (shown in the card, run by a test)."""

SAMPLED_RECIPE = ("import numpy as np\n"
                  "ids, counts = np.asarray(row['sampled_ids']), np.asarray(row['sampled_counts'])  # [tokens, m]\n"
                  "logprobs = np.asarray(row['sampled_logprobs'], dtype=np.uint16).view(np.float16).astype(np.float32)\n"
                  "draws = [dict(zip(i[c > 0].tolist(), c[c > 0].tolist())) for i, c in zip(ids, counts)]  # {token id: count}")
"""Reading the sampled store's row into {token id: count} per position (shown in the card, run by a test)."""


def write(root, manifest: dict):
    from opdcache.storage import as_path, confined_write

    path = confined_write(as_path(root), as_path(root) / "README.md")
    write_text_atomic(path, render(manifest))
    return path
