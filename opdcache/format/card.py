"""The cache's dataset card (README.md): Hub-readable, with YAML ``configs:`` for ``datasets.load_dataset``.

``datasets.load_dataset(<cache dir or repo>, "rollouts")`` then loads the rollouts, and
``datasets.load_dataset(<cache>, "teacher-<slug>")`` one teacher's scores, each with every column.
"""

from __future__ import annotations


import yaml

from opdcache.format import schema as S
from opdcache.storage import write_text_atomic
from opdcache.stores import REGISTRY


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
        if entry["kind"] == "teacher":
            from opdcache.format.fidelity import describe

            for store in entry["params"]["stores"]:
                if store in REGISTRY:
                    lines += REGISTRY[store].card(config_name(name), entry)

            lines += [f"### Error of `{config_name(name)}` against the teacher's full vocabulary", "",
                      "Measured while scoring, from the full distribution the scorer streams (no student involved):", ""]
            lines += [f"- {line}" for line in describe(entry.get("fidelity") or {})] + [""]
    return "\n".join(lines)


def write(root, manifest: dict):
    from opdcache.storage import as_path, confined_write

    path = confined_write(as_path(root), as_path(root) / "README.md")
    write_text_atomic(path, render(manifest))
    return path
