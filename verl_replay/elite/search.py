"""MAP-Elites search with a frozen base model: builds the frozen EliteReplay archive.

    python -m verl_replay.elite.search --data train.parquet --model PATH --out archive.parquet \
        [--backend hf|vllm] [--seeds-per-question 8] [--mutations-per-question 16] [--rounds 4] \
        [--batch-size 32] [--temperature 1.0] [--top-p 1.0] [--max-new-tokens 256] [--seed 0] \
        [--limit N] [--labeler rule|llm] [--vocabulary YAML] [--verify-workers 2] \
        [--verify-timeout-s 5] [--resume]

Rounds (all batched across questions, in dataset order):

* round 0 (seeds): ``--seeds-per-question`` samples per question from the dataset prompt;
* rounds 1..R (mutations): ``--mutations-per-question`` split over ``--rounds`` (the first
  ``M % R`` rounds get one more). In a round with ``m`` mutations per question the targets of
  a question are the first ``m`` approaches of :meth:`EliteArchive.rank_targets` (cycled if
  ``m`` exceeds the vocabulary) -- with ``m == 1`` that is exactly ``choose_target``; taking
  the top ``m`` keeps one round from requesting the same approach ``m`` times, since attempt
  counts only move when candidates are inserted. Each target gets a parent from
  ``choose_parent`` and a prompt from :func:`build_mutation_prompt`.

Every candidate goes through ``EliteArchive.insert``, which refuses generations that did not
finish (the backend's ``finish_reason``, e.g. ``"length"``: counted as ``truncated``, never
verified), then verifies and describes it itself;
the verifier it calls is a :class:`~verl_replay.elite.domains.PooledVerifier` whose results
were prefetched in a :class:`~verl_replay.verifiers.VerifierPool` while the next batch was
being generated. Generation seeds are derived from ``(--seed, round, batch index)`` and the
archive's own RNG drives target tie-breaks and parents, so a run is reproducible for a fixed
seed and backend (the HF backend is deterministic on CPU).

Outputs for ``--out A.parquet``: ``A.parquet`` + ``A.parquet.manifest.json`` (written at the
end with :func:`~verl_replay.elite.archive_io.save_frozen_archive`) and the resumable state
``A.parquet.search_state`` (JSON: archive state incl. its RNG, next round, the run's identity;
written atomically after every round). ``--resume`` continues after the last completed round
and refuses if anything that changes results differs (config, data file hash, vocabulary,
tokenizer); a round interrupted midway is redone from its start, so a resumed run ends with
the same archive as an uninterrupted one. A final JSON summary goes to stdout; the progress
bar (live coverage) to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_replay._files import default_file_mode
from verl_replay.elite.archive import SEED_KEY, Candidate, EliteArchive, InsertStatus, Question
from verl_replay.elite.archive_io import manifest_path, save_frozen_archive
from verl_replay.elite.domains import (
    DOMAINS,
    CachedDescriber,
    DataError,
    Domain,
    PooledVerifier,
    TokenCounter,
    detect_domain,
    hf_tokenizer_fingerprint,
    make_domain,
)
from verl_replay.elite.search_prompts import build_mutation_prompt

__all__ = [
    "IDENTITY_EXCLUDED",
    "STATE_FORMAT",
    "STATE_VERSION",
    "SearchConfig",
    "SearchError",
    "SearchSummary",
    "build_parser",
    "dataset_identity",
    "load_questions",
    "main",
    "mutation_schedule",
    "run_search",
    "state_path",
]

STATE_FORMAT = "verl_replay.elite_search_state"
STATE_VERSION = 1
BACKEND_CHOICES = ("hf", "vllm")
LABELERS = ("rule", "llm")
# Settings that do not change what the search produces: they may differ on --resume.
IDENTITY_EXCLUDED: tuple[str, ...] = ("out", "resume", "overwrite", "stop_after_round", "progress", "verify_workers")
REQUIRED_COLUMNS = ("prompt", "reward_model")


class SearchError(ValueError):
    """A search that cannot start or continue; the message says what to change."""


# ============================================================================ config


@dataclass(frozen=True)
class SearchConfig:
    """Every setting of a search run (the CLI flags; see ``--help`` for each)."""

    data: str
    model: str
    out: str
    backend: str = "hf"
    domain: str = "auto"
    seeds_per_question: int = 8
    mutations_per_question: int = 16
    rounds: int = 4
    batch_size: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    limit: int | None = None
    labeler: str = "rule"
    vocabulary: str | None = None
    verify_workers: int = 2
    verify_timeout_s: float = 5.0
    resume: bool = False
    overwrite: bool = False
    # stop (resumably) once this round has been written to the state file; 0 = the seed round
    stop_after_round: int | None = None
    device: str = "cpu"
    dtype: str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    progress: bool = True

    def validate(self) -> None:
        def positive(name: str, allow_zero: bool = False) -> None:
            value = getattr(self, name)
            low = 0 if allow_zero else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                flag = "--" + name.replace("_", "-")
                raise SearchError(f"{flag} must be an integer >= {low}, got {value!r}")

        for name in ("rounds", "batch_size", "max_new_tokens", "tensor_parallel_size"):
            positive(name)
        for name in ("seeds_per_question", "mutations_per_question", "verify_workers", "seed"):
            positive(name, allow_zero=True)
        if self.seeds_per_question + self.mutations_per_question == 0:
            raise SearchError("--seeds-per-question and --mutations-per-question are both 0: nothing to generate")
        if self.limit is not None:
            positive("limit")
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.stop_after_round is not None:
            positive("stop_after_round", allow_zero=True)
        if self.backend not in BACKEND_CHOICES:
            raise SearchError(f"--backend must be one of {list(BACKEND_CHOICES)}, got {self.backend!r}")
        if self.domain not in ("auto", *DOMAINS):
            raise SearchError(f"--domain must be auto, sql or math, got {self.domain!r}")
        if self.labeler not in LABELERS:
            raise SearchError(f"--labeler must be one of {list(LABELERS)}, got {self.labeler!r}")
        if not self.temperature >= 0:
            raise SearchError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise SearchError(f"--top-p must be in (0, 1], got {self.top_p!r}")
        if not self.verify_timeout_s > 0:
            raise SearchError(f"--verify-timeout-s must be > 0, got {self.verify_timeout_s!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise SearchError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.resume and self.overwrite:
            raise SearchError("--resume and --overwrite exclude each other")
        if not str(self.out).endswith(".parquet"):
            raise SearchError(f"--out must name a .parquet file, got {self.out!r}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["chat_template_kwargs"] = None if self.chat_template_kwargs is None else dict(self.chat_template_kwargs)
        return d

    def identity(self) -> dict[str, Any]:
        """The settings that change results (compared on ``--resume``); paths made absolute."""
        d = {k: v for k, v in self.to_dict().items() if k not in IDENTITY_EXCLUDED}
        for key in ("data", "model", "vocabulary"):
            if d.get(key) is not None and Path(d[key]).exists():
                d[key] = str(Path(d[key]).resolve())
        return d


def state_path(out: str | os.PathLike[str]) -> Path:
    """``<out>.search_state`` (next to the archive and its manifest)."""
    p = Path(out)
    return p.with_name(p.name + ".search_state")


def mutation_schedule(mutations_per_question: int, rounds: int) -> list[int]:
    """Mutations per question in each round 1..R: ``M // R`` each, the first ``M % R`` get +1."""
    base, extra = divmod(mutations_per_question, rounds)
    return [base + (1 if r < extra else 0) for r in range(rounds)]


# ============================================================================ data


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.is_file():
        raise SearchError(f"--data {path}: file not found")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise SearchError(f"--data {path}: not a readable parquet file ({exc})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise SearchError(
            f"--data {path}: missing column(s) {missing}; a verl RL parquet has data_source, prompt, ability, "
            f"reward_model (with ground_truth) and extra_info (found: {table.column_names})"
        )
    if table.num_rows == 0:
        raise SearchError(f"--data {path}: the file has no rows")
    return table.to_pylist()


def dataset_identity(
    path: str | os.PathLike[str],
    rows: Sequence[Mapping[str, Any]],
    *,
    limit: int | None,
    num_rows: int,
    sha256: str | None = None,
) -> dict[str, Any]:
    """What the manifest records about the data: path, sha256 of the file, rows used, splits
    and data sources of the used rows (training can compare it with ``expected_dataset``)."""
    p = Path(path)
    splits = sorted(
        {
            str(r["extra_info"].get("split"))
            for r in rows
            if isinstance(r.get("extra_info"), Mapping) and r["extra_info"].get("split") is not None
        }
    )
    sources = sorted({str(r.get("data_source")) for r in rows if r.get("data_source") is not None})
    return {
        "path": str(p.resolve()),
        "sha256": sha256 if sha256 is not None else _sha256_file(p),
        "num_rows": num_rows,
        "limit": limit,
        "num_questions": len(rows),
        "splits": splits,
        "data_sources": sources,
    }


def load_questions(
    path: str | os.PathLike[str],
    domain: Domain,
    *,
    limit: int | None = None,
    rows: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[list[Question], dict[str, Any]]:
    """Questions of the first ``limit`` rows (all when None) and the dataset identity.
    ``rows``: the file's rows when already read (they must be the rows of ``path``)."""
    p = Path(path)
    all_rows = list(rows) if rows is not None else _read_rows(p)
    rows = all_rows[:limit] if limit is not None else all_rows
    questions = []
    try:
        for i, row in enumerate(rows):
            questions.append(domain.question_from_row(row, i))
    except DataError as exc:
        raise SearchError(f"--data {p}: {exc}") from None
    seen: dict[str, int] = {}
    for i, q in enumerate(questions):
        if q.id in seen:
            raise SearchError(
                f"--data {p}: rows {seen[q.id]} and {i} have the same extra_info.question_id {q.id!r}; "
                "archive cells are per question, so ids must be unique"
            )
        seen[q.id] = i
    return questions, dataset_identity(p, rows, limit=limit, num_rows=len(all_rows))


# ============================================================================ outputs


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, default_file_mode())  # mkstemp makes 0600; keep the user's umask
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class SearchSummary:
    """Outcome of :func:`run_search` (also the CLI's stdout JSON, via :meth:`to_dict`)."""

    out: str
    manifest: str
    state: str
    finished: bool  # False when stopped early by stop_after_round (the archive is not written then)
    rounds_completed: int  # mutation rounds done (the seed round is round 0)
    total_rounds: int
    coverage: dict[str, Any]
    counts: dict[str, int]
    seed_counts: dict[str, int]
    insert_rate: float
    verification: dict[str, int]
    labeler: dict[str, Any]
    elapsed_s: float
    resumed: bool = False
    domain: str = ""
    # verification failures by the verifier's reason code (verifiers.sql / verifiers.math REASONS)
    failure_reasons: dict[str, int] = field(default_factory=dict)
    manifest_data: dict[str, Any] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("manifest_data")
        return d


# ============================================================================ search


@dataclass(frozen=True)
class _Request:
    question: Question
    prompt: Any
    requested: str | None
    parent: Any  # CellKey | None


class _Run:
    """One invocation of the search (fresh or resumed)."""

    def __init__(
        self, config: SearchConfig, backend: Any, domain: Domain, questions: list[Question], identity: dict[str, Any]
    ) -> None:
        self.config = config
        self.backend = backend
        self.domain = domain
        self.questions = questions
        self.identity = identity
        self.verifier = PooledVerifier(self.domain)
        self.describer = CachedDescriber(self.domain)
        self.failure_reasons: Counter[str] = Counter()  # rejected candidates by the verifier's reason
        self.archive = EliteArchive(
            verifier=self.verifier,
            describer=self.describer,
            token_counter=self.domain.token_counter,
            approaches=self.domain.vocabulary.names,
            seed=self.config.seed,
        )
        self.schedule = mutation_schedule(self.config.mutations_per_question, self.config.rounds)
        self.next_round = 0
        self.elapsed_before = 0.0
        self.generated = 0
        self.resumed = False

    def restore(self, state: Mapping[str, Any], path: Path) -> None:
        diffs = _identity_diff(state.get("identity", {}), self.identity)
        if diffs:
            listing = "; ".join(diffs)
            raise SearchError(
                f"cannot --resume from {path}: the run differs from the saved one ({listing}). Re-run with the "
                "saved settings, or start over with --overwrite"
            )
        try:
            self.archive.load_state_dict(state["archive"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SearchError(f"cannot --resume from {path}: the archive state is invalid ({exc})") from None
        saved = {q.id: q for q in self.archive.questions()}
        if set(saved) != {q.id for q in self.questions} or any(saved[q.id] != q for q in self.questions):
            raise SearchError(f"cannot --resume from {path}: its questions differ from those in --data")
        self.next_round = int(state["next_round"])
        stats = state.get("stats", {})
        self.verifier.pooled = int(stats.get("verification", {}).get("pooled", 0))
        self.verifier.inline = int(stats.get("verification", {}).get("inline", 0))
        self.failure_reasons = Counter({str(k): int(v) for k, v in stats.get("failure_reasons", {}).items()})
        labeler_stats = stats.get("labeler", {})
        if hasattr(self.domain.labeler, "num_fallbacks"):
            self.domain.labeler.num_labeled = int(labeler_stats.get("labeled", 0))
            self.domain.labeler.num_fallbacks = int(labeler_stats.get("fallbacks", 0))
        self.elapsed_before = float(stats.get("elapsed_s", 0.0))
        self.generated = int(stats.get("generated", 0))
        self.resumed = True

    # ---------------------------------------------------------------- rounds

    def round_requests(self, round_index: int) -> tuple[list[_Request], int]:
        """Prompts of one round and the number of samples per prompt."""
        if round_index == 0:
            return [
                _Request(q, list(q.prompt) if not isinstance(q.prompt, str) else q.prompt, None, None)
                for q in self.questions
            ], self.config.seeds_per_question
        per_question = self.schedule[round_index - 1]
        requests = []
        vocab = self.domain.vocabulary
        for q in self.questions:
            if per_question == 0:
                break
            ranked = self.archive.rank_targets(q.id)  # consumes the archive RNG: order matters
            for i in range(per_question):
                target = ranked[i % len(ranked)]
                parent = self.archive.choose_parent(q.id, target)
                prompt = build_mutation_prompt(
                    list(q.prompt) if not isinstance(q.prompt, str) else q.prompt,
                    target_approach=target,
                    target_description=vocab.description(target),
                    format_instruction=self.domain.format_instruction,
                    parent_solution=None if parent is None else self.domain.parent_view(parent.text),
                    parent_approach=None if parent is None else parent.approach,
                    domain=self.domain.name,
                    solution_noun=self.domain.solution_noun,
                )
                requests.append(_Request(q, prompt, target, None if parent is None else parent.cell))
        return requests, 1

    def run_round(self, round_index: int, bar: Any) -> None:
        from verl_replay.generation.base import derive_seed

        requests, n = self.round_requests(round_index)
        if not requests or n == 0:
            return
        per_call = max(1, self.config.batch_size // n)
        chunks = [requests[i : i + per_call] for i in range(0, len(requests), per_call)]
        kind = "seed" if round_index == 0 else "mutation"
        pending: list[tuple[Question, Candidate]] | None = None
        for chunk_index, chunk in enumerate(chunks):
            outputs = self.backend.generate(
                [r.prompt for r in chunk],
                n=n,
                temperature=self.config.temperature,
                top_p=self.config.top_p,
                max_new_tokens=self.config.max_new_tokens,
                seed=derive_seed(self.config.seed, round_index, chunk_index),
            )
            if len(outputs) != len(chunk) or any(len(samples) != n for samples in outputs):
                raise RuntimeError(f"the generation backend returned {len(outputs)} prompts' samples for {len(chunk)}")
            candidates = []
            for request, samples in zip(chunk, outputs, strict=True):
                for j, gen in enumerate(samples):
                    meta = {
                        "kind": kind,
                        "round": round_index,
                        "sample": j,
                        "finish_reason": gen.finish_reason,
                        "generated_tokens": gen.num_tokens,
                    }
                    candidates.append(
                        (
                            request.question,
                            Candidate(
                                question_id=request.question.id,
                                text=gen.text,
                                requested_approach=request.requested,
                                parent=request.parent,
                                metadata=meta,
                                finish_reason=gen.finish_reason,
                            ),
                        )
                    )
            self.generated += len(candidates)
            # verification of this batch runs in the pool while the previous one is inserted
            # and the next one generated
            # (cut-off generations are refused by the archive unverified: nothing to prefetch)
            self.verifier.prefetch([(q, c.text) for q, c in candidates if not c.truncated])
            if pending is not None:
                self.insert(pending, round_index, bar)
            pending = candidates
        if pending is not None:
            self.insert(pending, round_index, bar)

    def insert(self, candidates: list[tuple[Question, Candidate]], round_index: int, bar: Any) -> None:
        verified = [c.text for q, c in candidates if not c.truncated and self.verifier.verdict(q, c.text).correct]
        self.describer.prefetch(verified)  # one batched labeler call (matters for --labeler llm)
        for question, candidate in candidates:
            result = self.archive.insert(question, candidate, round=round_index)
            if result.status is InsertStatus.REJECTED:
                self.failure_reasons[result.reason or "unknown"] += 1
        bar.update(len(candidates))
        bar.set_postfix_str(_progress_text(self.archive), refresh=False)

    # ---------------------------------------------------------------- state

    def stats(self, start: float) -> dict[str, Any]:
        labeler = self.domain.labeler
        labeler_stats: dict[str, Any] = {"kind": self.config.labeler}
        if hasattr(labeler, "num_fallbacks"):
            labeler_stats.update(labeled=labeler.num_labeled, fallbacks=labeler.num_fallbacks)
        return {
            "verification": self.verifier.stats(),
            "failure_reasons": dict(sorted(self.failure_reasons.items())),
            "labeler": labeler_stats,
            "generated": self.generated,
            "elapsed_s": round(self.elapsed_before + time.monotonic() - start, 3),
        }

    def state_dict(self, start: float, finished: bool) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "identity": self.identity,
            "next_round": self.next_round,
            "total_rounds": self.config.rounds,
            "finished": finished,
            "stats": self.stats(start),
            "archive": self.archive.state_dict(),
        }


def _identity_diff(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(now))
    return [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


def _progress_text(archive: EliteArchive) -> str:
    cov = archive.coverage()
    totals = archive.counts()["totals"]
    rate = totals["insertions"] / totals["attempts"] if totals["attempts"] else 0.0
    return (
        f"covered {cov['questions_covered']}/{cov['questions']} cells {cov['cells']} "
        f"mean {cov['mean_cells']:.2f}/q insert {rate:.1%}"
    )


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SearchError(f"cannot read the search state {path} ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
        raise SearchError(f"{path} is not a search state of this version (expected {STATE_FORMAT} v{STATE_VERSION})")
    return state


def _make_backend(config: SearchConfig) -> Any:
    from verl_replay.generation import make_backend

    if config.backend == "hf":
        if not Path(config.model).exists():
            raise SearchError(f"--model {config.model}: directory not found (the hf backend loads a local model)")
        return make_backend(
            "hf",
            model_path=config.model,
            device=config.device,
            dtype=config.dtype or "float32",
            batch_size=config.batch_size,
            chat_template_kwargs=dict(config.chat_template_kwargs or {}),
        )
    return make_backend(
        "vllm",
        model_path=config.model,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        seed=config.seed,
        dtype=config.dtype or "auto",
        chat_template_kwargs=dict(config.chat_template_kwargs or {}),
    )


def _check_frozen(backend: Any) -> None:
    """The search must sample from a frozen model: eval mode, no parameter needs gradients."""
    model = getattr(backend, "model", None)
    if model is None or not hasattr(model, "parameters"):
        return  # e.g. vLLM: an inference engine, nothing to train
    if getattr(model, "training", False) or any(p.requires_grad for p in model.parameters()):
        raise SearchError("the generation backend's model is not frozen (training mode or parameters with grad)")


def _load_vocabulary(config: SearchConfig, domain_name: str) -> Any:
    if config.vocabulary is None:
        return None  # make_domain picks the packaged default of the domain
    from verl_replay.sql.vocabulary import VocabularyError, load_vocabulary

    if not Path(config.vocabulary).is_file():
        raise SearchError(f"--vocabulary {config.vocabulary}: file not found")
    try:
        vocab = load_vocabulary(config.vocabulary)
    except VocabularyError as exc:
        raise SearchError(f"--vocabulary: {exc}") from None
    if vocab.domain != domain_name:
        raise SearchError(f"--vocabulary {config.vocabulary} is a {vocab.domain} vocabulary, the data is {domain_name}")
    return vocab


def run_search(config: SearchConfig, backend: Any = None) -> SearchSummary:
    """Run (or resume) a search; see the module docstring. ``backend`` replaces the one the
    config would build (tests inject an HF backend they reuse across runs)."""
    start = time.monotonic()
    config.validate()
    out = Path(config.out)
    spath = state_path(out)
    if config.resume and not spath.is_file():
        raise SearchError(f"--resume: no search state at {spath} (nothing to resume; run without --resume)")
    if not config.resume and not config.overwrite and spath.exists():
        raise SearchError(
            f"{spath} exists (an earlier search of {out}); pass --resume to continue it or --overwrite to start over"
        )
    data_path = Path(config.data)
    all_rows = _read_rows(data_path)  # checks file and columns before the model loads
    used_rows = all_rows[: config.limit] if config.limit is not None else all_rows
    try:
        domain_name = config.domain if config.domain != "auto" else detect_domain(used_rows)
    except DataError as exc:
        raise SearchError(f"--data {data_path}: {exc}") from None
    vocabulary = _load_vocabulary(config, domain_name)
    state = _read_state(spath) if config.resume else None

    if backend is None:
        backend = _make_backend(config)
    _check_frozen(backend)
    tokenizer = backend.tokenizer
    domain = make_domain(
        domain_name,
        vocabulary=vocabulary,
        labeler=config.labeler,
        token_counter=TokenCounter(tokenizer),
        backend=backend,
        verify_timeout_s=config.verify_timeout_s,
        seed=config.seed,
    )
    questions, dataset = load_questions(data_path, domain, limit=config.limit, rows=all_rows)
    fingerprint = hf_tokenizer_fingerprint(tokenizer)
    identity = {
        **config.identity(),
        "domain": domain_name,
        "data_sha256": dataset["sha256"],
        "vocabulary_hash": domain.vocabulary.content_hash(),
        "tokenizer_fingerprint": fingerprint,
    }

    run = _Run(config, backend, domain, questions, identity)
    if state is not None:
        run.restore(state, spath)
    else:
        for q in questions:
            run.archive.register(q)

    pool = None
    if config.verify_workers > 0:
        from verl_replay.verifiers.pool import VerifierPool

        pool = VerifierPool(
            num_workers=config.verify_workers,
            task_timeout_s=config.verify_timeout_s * 4 + 2.0,
            preload=domain.preload,
            initializer=domain.initializer,
            on_failure=domain.failure,
        )
    run.verifier.pool = pool

    from tqdm.auto import tqdm

    n_q = len(questions)
    planned = n_q * (config.seeds_per_question + config.mutations_per_question)
    done = run.archive.counts()["totals"]["attempts"]
    bar = tqdm(
        total=planned,
        initial=done,
        desc="elite search",
        unit="cand",
        file=sys.stderr,
        disable=not config.progress,
        dynamic_ncols=True,
    )
    stopped_early = False
    try:
        for round_index in range(run.next_round, config.rounds + 1):
            bar.set_description(f"elite search round {round_index}/{config.rounds}")
            run.run_round(round_index, bar)
            run.verifier.clear()
            run.describer.clear()
            run.next_round = round_index + 1
            finished = run.next_round > config.rounds
            _atomic_write_text(spath, json.dumps(run.state_dict(start, finished), sort_keys=True))
            if not finished and config.stop_after_round is not None and round_index >= config.stop_after_round:
                stopped_early = True
                break
    finally:
        bar.close()
        if pool is not None:
            pool.close(wait=False)

    stats = run.stats(start)
    manifest_data = None
    if not stopped_early:
        # a crash before this line leaves a finished state; --resume then only writes the archive
        manifest_data = save_frozen_archive(run.archive, out, manifest=_manifest(config, run, dataset, stats, backend))
    coverage = {k: v for k, v in run.archive.coverage().items() if k != "cells_per_question"}
    counts = run.archive.counts()
    totals = counts["totals"]
    return SearchSummary(
        out=str(out),
        manifest=str(manifest_path(out)),
        state=str(spath),
        finished=not stopped_early,
        rounds_completed=run.next_round - 1,
        total_rounds=config.rounds,
        coverage=coverage,
        counts=totals,
        seed_counts=counts["per_approach"].get(SEED_KEY, {}),
        insert_rate=(totals["insertions"] / totals["attempts"]) if totals["attempts"] else 0.0,
        verification=stats["verification"],
        labeler=stats["labeler"],
        elapsed_s=stats["elapsed_s"],
        resumed=run.resumed,
        domain=run.domain.name,
        failure_reasons=stats["failure_reasons"],
        manifest_data=manifest_data,
    )


def _manifest(
    config: SearchConfig, run: _Run, dataset: dict[str, Any], stats: dict[str, Any], backend: Any
) -> dict[str, Any]:
    tokenizer = backend.tokenizer
    vocab = run.domain.vocabulary
    model = Path(config.model)
    return {
        "base_model": {
            "path": str(model.resolve()) if model.exists() else config.model,
            "name": model.name or config.model,
            "backend": config.backend,
        },
        "tokenizer_name": str(getattr(tokenizer, "name_or_path", "") or config.model),
        "tokenizer_fingerprint": run.identity["tokenizer_fingerprint"],
        "dataset": dataset,
        "domain": run.domain.name,
        "vocabulary_hash": vocab.content_hash(),
        "vocabulary_source": str(Path(config.vocabulary).resolve()) if config.vocabulary else "packaged default",
        "vocabulary_default": vocab.default,
        "search_config": {**config.to_dict(), "mutation_schedule": run.schedule},
        "search": {
            "rounds_completed": run.next_round - 1,
            "resumed": run.resumed,
            "state_file": state_path(config.out).name,
            "generated": stats["generated"],
            "verification": stats["verification"],
            "labeler": stats["labeler"],
            "elapsed_s": stats["elapsed_s"],
        },
    }


# ============================================================================ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m verl_replay.elite.search",
        description="MAP-Elites search with a frozen base model; writes the frozen EliteReplay archive.",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="the tiny EliteReplay run's archive: tiny SQL data and model, a small budget "
        "(flags given as well still win)",
    )
    p.add_argument("--data", default=None, help="verl RL parquet of training questions (required without --tiny)")
    p.add_argument(
        "--model", default=None, help="frozen base model (directory; hub id for vllm; required without --tiny)"
    )
    p.add_argument("--out", required=True, help="archive file ARCHIVE.parquet (manifest and state go next to it)")
    p.add_argument("--backend", default="hf", choices=BACKEND_CHOICES, help="hf (CPU/tests) or vllm (GPU)")
    p.add_argument("--domain", default="auto", choices=("auto", *DOMAINS), help="default: from the data's ability")
    p.add_argument("--seeds-per-question", type=int, default=8)
    p.add_argument("--mutations-per-question", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4, help="mutation rounds the budget is split over")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per generate call")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="use only the first N questions")
    p.add_argument("--labeler", default="rule", choices=LABELERS, help="approach labeler (llm = the frozen model)")
    p.add_argument("--vocabulary", default=None, help="approach vocabulary YAML (default: the packaged reviewed one)")
    p.add_argument("--verify-workers", type=int, default=2, help="verification processes (0 = in process)")
    p.add_argument("--verify-timeout-s", type=float, default=5.0)
    p.add_argument("--resume", action="store_true", help="continue from ARCHIVE.parquet.search_state")
    p.add_argument("--overwrite", action="store_true", help="start over even if a search state exists")
    p.add_argument(
        "--stop-after-round", type=int, default=None, help="stop (resumably) after this round; 0 = the seed round"
    )
    p.add_argument("--device", default="cpu", help="hf backend: torch device")
    p.add_argument("--dtype", default=None, help="model dtype (hf default float32, vllm default auto)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm only")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vllm only")
    p.add_argument("--max-model-len", type=int, default=None, help="vllm only")
    p.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default=None,
        help="JSON for the chat template, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument(
        "--json", dest="json_summary", action="store_true", help="print the summary as one JSON object instead"
    )
    return p


# The archive for `python -m verl_replay.main tiny_task=sql replay.strategy=elite`: its data and
# frozen model, 16 questions, 8 seeds and 2 mutations each in one round (a few minutes on CPU).
TINY_SEARCH = {
    "domain": "sql",
    "limit": 16,
    "seeds_per_question": 8,
    "mutations_per_question": 2,
    "rounds": 1,
    "max_new_tokens": 96,
}


def tiny_search_defaults() -> dict[str, Any]:
    from verl_replay.data.tiny_assets import build_tiny_assets

    assets = build_tiny_assets()
    return {"data": str(assets.sql_train), "model": str(assets.sql_model_dir), **TINY_SEARCH}


def parse_config(argv: Sequence[str] | None = None) -> SearchConfig:
    """The command line as a :class:`SearchConfig`; ``--tiny`` fills in what was not given."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tiny:
        parser.set_defaults(**tiny_search_defaults())
        args = parser.parse_args(argv)
    for name in ("data", "model"):
        if getattr(args, name) is None:
            parser.error(f"--{name} is required (or --tiny: the tiny EliteReplay run's data and model)")
    values = vars(args)
    values.pop("tiny")
    values.pop("json_summary")
    return SearchConfig(**values)


def reason_meanings(domain: str) -> dict[str, str]:
    """What each verifier reason code of ``domain`` means (both domains' when unknown)."""
    from verl_replay.verifiers.math import REASONS as MATH_REASONS
    from verl_replay.verifiers.sql import REASONS as SQL_REASONS

    if domain == "sql":
        return dict(SQL_REASONS)
    if domain == "math":
        return dict(MATH_REASONS)
    return {**MATH_REASONS, **SQL_REASONS}


def summary_lines(summary: SearchSummary) -> list[str]:
    """The search's outcome for a person: where the archive is, what it covers, and what became of
    every candidate, the failed verifications by the verifier's reason."""
    counts, coverage = summary.counts, summary.coverage
    if summary.finished:
        head = f"elite search: done in {summary.elapsed_s:.0f} s; archive {summary.out}"
    else:
        head = (
            f"elite search: stopped after round {summary.rounds_completed} of {summary.total_rounds} "
            f"({summary.elapsed_s:.0f} s); the archive is written when the last round ends: continue with --resume"
        )
    lines = [
        head,
        f"  {coverage.get('cells', 0)} elites: {coverage.get('questions_covered', 0)} of "
        f"{coverage.get('questions', 0)} questions covered, {coverage.get('mean_cells', 0.0):.2f} cells a question",
        f"  {counts.get('attempts', 0)} candidates:",
        f"    {counts.get('insertions', 0)} inserted ({counts.get('new', 0)} in a new cell, "
        f"{counts.get('improved', 0)} shorter than their cell's elite)",
    ]
    outcomes = (
        ("not_added", "correct, but no shorter than their cell's elite"),
        ("verification_failures", "failed verification"),
        ("truncated", "cut off at --max-new-tokens (never verified)"),
        ("parse_failures", "correct, but the describer found no approach of the vocabulary"),
    )
    for key, what in outcomes:
        if counts.get(key, 0):
            lines.append(f"    {counts[key]} {what}")
        if key == "verification_failures" and counts.get(key, 0):
            lines += _failure_lines(summary)
    return lines


def _failure_lines(summary: SearchSummary) -> list[str]:
    """The failed verifications by the verifier's reason code, most frequent first, with its meaning."""
    if not summary.failure_reasons:
        return ["      (their reasons were not recorded: the search resumed from an older state)"]
    meanings = reason_meanings(summary.domain)
    width = len(str(max(summary.failure_reasons.values())))
    ordered = sorted(summary.failure_reasons.items(), key=lambda item: (-item[1], item[0]))
    return [
        f"      {number:>{width}} {reason}" + (f": {meanings[reason]}" if reason in meanings else "")
        for reason, number in ordered
    ]


def main(argv: Sequence[str] | None = None, *, backend: Any = None) -> int:
    config = parse_config(argv)
    json_summary = build_parser().parse_args(argv).json_summary
    try:
        summary = run_search(config, backend=backend)
    except (SearchError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if summary.finished and summary.coverage["cells"] == 0:
        print("warning: the archive is empty (no candidate verified); training would refuse it", file=sys.stderr)
    if json_summary:
        print(json.dumps(summary.to_dict(), sort_keys=True))
    else:
        print("\n".join(summary_lines(summary)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
