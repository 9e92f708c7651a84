"""``opdcache plan``: the storage frontier (opdcache/teacher/frontier.py) of one teacher on a seeded sample of a cache's own
rollouts, the setting that meets ``--max-error`` or ``--max-bytes``, and the table it prints. Memory: as
frontier.py states it (the models, [128 positions, vocabulary] blocks, the sampled rows' stored values)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from opdcache.teacher.frontier import choose, default_settings, held_out, measure, Model, scored_settings_of, Setting

DEFAULT_MAX_ERROR = 1e-2  # nats: the error budget plan recommends within when given neither --max-error nor --max-bytes


@dataclass(frozen=True)
class PlanConfig:
    """``opdcache plan``: the frontier of one teacher on a sample of the cache's own rollouts."""

    cache: Path | str
    teacher: Path | str
    rows: int = 16
    """Rollout rows sampled (seeded, over all shards); the svd settings fit on the first half and are measured on the rest."""
    seed: int = 0
    students: tuple = ()
    """Models on the same vocabulary to measure the forward-KL estimate's and gradient's errors against (e.g. pi_ref)."""
    dtype: str = "float32"
    """The teacher's (and students') compute dtype."""
    max_error: float | None = None
    max_bytes: float | None = None

    def __post_init__(self) -> None:
        from opdcache.errors import ConfigError

        if self.rows < 1:
            raise ConfigError(f"--rows must be at least 1, got {self.rows}")
        if self.max_error is not None and self.max_bytes is not None:
            raise ConfigError("--max-error and --max-bytes each pick a setting; pass one of them")
        if self.max_error is not None and not self.max_error > 0:
            raise ConfigError(f"--max-error must be positive, got {self.max_error}")
        if self.max_bytes is not None and not self.max_bytes > 0:
            raise ConfigError(f"--max-bytes must be positive, got {self.max_bytes}")


def scored_settings(cache) -> dict[str, tuple[Setting, list[str]]]:
    """The frontier settings of the stores already scored in ``cache``: {label: (setting, [teacher tables])}."""
    from opdcache.format import schema as S

    out: dict[str, tuple[Setting, list[str]]] = {}
    for table in cache.teachers:
        name = cache.teacher_table(table)
        for setting in scored_settings_of(S.StoreParams.from_dict(cache.table(name)["params"])):
            out.setdefault(setting.label, (setting, []))[1].append(name)
    return out


def run_plan(cfg: PlanConfig, settings: list[Setting] | None = None) -> dict:
    """Load the teacher (and students), sample the rows, measure; the frontier plus the pick for --max-error/--max-bytes."""
    from opdcache.backends import EngineConfig, make_backend
    from opdcache.format.cache import Cache
    from opdcache.inputs.lineage import check_same_tokenizer
    from opdcache.inputs.models import load_tokenizer, resolve_model
    from opdcache.teacher.scoring import score_requests

    cache = Cache(cfg.cache)
    base = cache.base_table
    refs = {"teacher": resolve_model(cfg.teacher, None, "--teacher")}
    refs.update({f"student {i}" if len(cfg.students) > 1 else "student": resolve_model(p, None, "--student") for i, p in enumerate(cfg.students)})
    for name, ref in refs.items():  # every model must read the cache's token ids as the cache's tokenizer wrote them
        check_same_tokenizer(cache.manifest["tokenizer"]["fingerprint"], load_tokenizer(ref.path), f"{name} {ref.name}", cache.tokenizer())
    picks = cache.sample_rows(base, cfg.rows, cfg.seed)
    requests, row_ids = [], []
    for shard, idx in sorted(picks.items()):
        table = cache.read_shard(base, shard, ["id", "prompt_ids", "response_ids"]).take(idx)
        requests += score_requests(table)
        row_ids += table["id"].to_pylist()
    models = {name: Model(make_backend(ref.path, EngineConfig(dtype=cfg.dtype)), name) for name, ref in refs.items()}
    teacher = models.pop("teacher")
    if settings is None:  # the defaults, and each already-scored setting the teacher's shapes allow, as rows of its own
        settings = default_settings(teacher.hidden_size, int(teacher.W.shape[0]))
        have = {x.label for x in settings}
        settings += [x for label, (x, _) in scored_settings(cache).items() if label not in have
                     and x.fits(teacher.hidden_size, int(teacher.W.shape[0]))]
    from opdcache.progress import bar

    with bar(len(requests) - held_out(settings, len(requests)), desc="plan", unit="row") as progress:
        report = measure(teacher, requests, row_ids, settings, models, cfg.seed, progress.update)
    report["teacher"] = str(cfg.teacher)
    report["scored"] = {label: tables for label, (_, tables) in scored_settings(cache).items() if label in report["settings"]}
    budget = cfg.max_error if cfg.max_error is not None or cfg.max_bytes is not None else DEFAULT_MAX_ERROR
    report["choice"] = choose(report, budget, cfg.max_bytes)
    report["choice_against"] = "KL(teacher || what the store implies)"
    report["choice_rule"] = (f"the most accurate within {cfg.max_bytes:g} B/token" if cfg.max_bytes is not None else
                             f"the cheapest with max kl <= {budget:g} nats a position"
                             + (", the default budget: --max-error or --max-bytes to choose another" if cfg.max_error is None else ""))
    return report


def render(report: dict) -> str:
    """The frontier as a table: B/token beside the errors against the full vocabulary."""
    students = sorted({n for r in report["settings"].values() for n in r["students"]})
    lines = [f"{report['rows']} rows, {report['tokens']:,} response tokens; vocabulary {report['vocab_size']:,}, hidden "
             f"{report['hidden_size']:,}; teacher entropy {report['teacher_entropy']:.3f} nats a position", "",
             "B/token: the store's bytes on disk per response token, measured by writing the sampled rows.",
             "kl max / kl mean: KL(teacher || the full distribution the store implies), nats, the largest and the mean over",
             "the sampled rows' response positions (sampled m: not a bias but the standard error of its forward-KL",
             "estimate's teacher term, on the sampled rows; never chosen without a --student).",
             "*: a setting this cache already holds (its table named below)."]
    for n in students:
        lines.append(f"{n} fkl max / mean: |forward-KL estimate - exact| a position; grad max / mean: ||gradient - exact||_1 "
                     "on the student's logits, a position.")
    header = f"{'setting':<26} {'B/token':>9} {'kl max':>9} {'kl mean':>9}"
    for n in students:
        header += f" {(n + ' fkl max')[:16]:>16} {'mean':>9} {'grad max':>9} {'mean':>9}"
    lines += ["", header, "-" * len(header)]
    scored = report.get("scored") or {}
    for label, r in report["settings"].items():
        line = f"{(label + (' *' if label in scored else '')):<26} {r['bytes_per_token']:>9.1f} {r['kl']['max']:>9.2e} {r['kl']['mean']:>9.2e}"
        for n in students:
            st = r["students"][n]
            line += f" {st['fkl_error']['max']:>16.2e} {st['fkl_error']['mean']:>9.2e} {st['grad_l1_error']['max']:>9.2e} {st['grad_l1_error']['mean']:>9.2e}"
        lines.append(line)
    if report.get("svd_calibration_positions"):
        n = report["svd_calibration_positions"]
        lines += ["", f"svd rows: fitted on the first half of the sample ({n:,} positions), where score-teacher fits on "
                      "max(32 x rank, 2,048) drawn over every shard; a small sample overstates their kl (SmolLM2, rank 512: "
                      "6.7e-3 at 2,048 positions, 4.8e-3 at 16,384; BENCHMARKS.md). More --rows measures them closer."]
    for label, tables in scored.items():
        lines.append(f"* {label}: in {', '.join(tables)}")
    if "choice" in report:
        c = report["choice"]
        lines.append("")
        lines.append(f"recommended ({report.get('choice_rule', 'the rule given')}): " + ("no setting qualifies" if c is None else
                     f"{c['label']} ({c['bytes_per_token']:.1f} B/token, max kl {c['max_error']:.2e}): score-teacher {c['flags']}"))
    return "\n".join(lines)
