"""Approach vocabularies: the reviewed YAML file, its validation, and offline induction by an LLM.

A vocabulary is a list of approaches (snake_case ``name`` + one-line ``description`` used in
prompts), a ``default`` approach (the catch-all a labeler answers when nothing else applies),
a ``domain`` (``sql`` or ``math``; it only words the prompts) and a ``reviewed`` flag. Induced
vocabularies are written with ``reviewed: false`` plus counts and example solutions; a human
edits the file, sets ``reviewed: true``, and only then should it drive a search
(:func:`load_vocabulary` warns otherwise).

YAML layout::

    domain: sql
    reviewed: true
    default: plain_select
    approaches:
      - name: join
        description: Combines rows of several tables with JOIN ... ON.
        count: 12            # optional (induction output)
        examples: [ ... ]    # optional (induction output)
    induction: { ... }       # optional metadata written by induction, ignored on load

The induction functions talk to a :class:`verl_replay.generation.GenerationBackend`; this module
imports no backend itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from verl_replay._files import default_file_mode

if TYPE_CHECKING:
    from verl_replay.generation.base import GenerationBackend

__all__ = [
    "DEFAULT_SQL_VOCABULARY_PATH",
    "Approach",
    "InductionResult",
    "UnreviewedVocabularyWarning",
    "Vocabulary",
    "VocabularyError",
    "build_induction_messages",
    "induce_vocabulary",
    "iter_jsonl_field",
    "load_vocabulary",
    "normalise_approach_name",
    "parse_induction_answer",
    "save_vocabulary",
    "strip_thinking",
    "write_induced_vocabulary",
]

DEFAULT_SQL_VOCABULARY_PATH = Path(__file__).with_name("approaches.yaml")
APPROACH_NAME_RE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*$")
DOMAINS = ("sql", "math")
_TOP_LEVEL_KEYS = {"domain", "reviewed", "default", "approaches", "induction"}
_APPROACH_KEYS = {"name", "description", "count", "examples"}


class VocabularyError(ValueError):
    """A vocabulary file or object is invalid; the message names the offending entry."""


class UnreviewedVocabularyWarning(UserWarning):
    """The vocabulary was induced by a model and has not been marked ``reviewed: true``."""


@dataclass(frozen=True)
class Approach:
    name: str
    description: str
    count: int | None = None  # how many seed solutions the model gave this name (induction)
    examples: tuple[str, ...] = ()  # example solutions (induction), for the reviewer

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        if self.count is not None:
            out["count"] = self.count
        if self.examples:
            out["examples"] = list(self.examples)
        return out


@dataclass(frozen=True)
class Vocabulary:
    approaches: tuple[Approach, ...]
    default: str
    domain: str = "sql"
    reviewed: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "approaches", tuple(self.approaches))
        _validate(self)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.approaches)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __len__(self) -> int:
        return len(self.approaches)

    def __iter__(self) -> Iterator[Approach]:
        return iter(self.approaches)

    def description(self, name: str) -> str:
        for approach in self.approaches:
            if approach.name == name:
                return approach.description
        raise KeyError(f"approach {name!r} is not in the vocabulary (names: {', '.join(self.names)})")

    def prompt_listing(self) -> str:
        """``- name: description`` lines, in vocabulary order, for prompts."""
        return "\n".join(f"- {a.name}: {a.description}" for a in self.approaches)

    def content_hash(self) -> str:
        """sha256 over what changes labels (domain, default, names, descriptions), not counts."""
        payload = {
            "domain": self.domain,
            "default": self.default,
            "approaches": [[a.name, a.description] for a in self.approaches],
        }
        blob = json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "reviewed": self.reviewed,
            "default": self.default,
            "approaches": [a.to_dict() for a in self.approaches],
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<dict>") -> Vocabulary:
        """Build and validate a vocabulary from parsed YAML; errors name ``source`` and the key."""
        if not isinstance(data, Mapping):
            raise VocabularyError(f"{source}: expected a mapping with an 'approaches' list, got {type(data).__name__}")
        unknown = set(data) - _TOP_LEVEL_KEYS
        if unknown:
            raise VocabularyError(
                f"{source}: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(_TOP_LEVEL_KEYS)}"
            )
        raw = data.get("approaches")
        if not isinstance(raw, list) or not raw:
            raise VocabularyError(f"{source}: 'approaches' must be a non-empty list")
        approaches = [_approach_from_dict(entry, f"{source}: approaches[{i}]") for i, entry in enumerate(raw)]
        reviewed = data.get("reviewed", False)
        if not isinstance(reviewed, bool):
            raise VocabularyError(f"{source}: 'reviewed' must be true or false, got {reviewed!r}")
        default = data.get("default")
        if default is None:
            raise VocabularyError(f"{source}: 'default' is missing: name the catch-all approach labelers fall back to")
        try:
            return cls(
                approaches=tuple(approaches), default=default, domain=data.get("domain", "sql"), reviewed=reviewed
            )
        except VocabularyError as err:
            raise VocabularyError(f"{source}: {err}") from None


def _approach_from_dict(entry: Any, where: str) -> Approach:
    if not isinstance(entry, Mapping):
        raise VocabularyError(f"{where}: expected a mapping with 'name' and 'description', got {entry!r}")
    unknown = set(entry) - _APPROACH_KEYS
    if unknown:
        raise VocabularyError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_APPROACH_KEYS)}")
    count = entry.get("count")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        raise VocabularyError(f"{where}.count must be a non-negative integer, got {count!r}")
    examples = entry.get("examples") or []
    if not isinstance(examples, list) or not all(isinstance(e, str) for e in examples):
        raise VocabularyError(f"{where}.examples must be a list of strings")
    return Approach(
        name=entry.get("name"),  # type: ignore[arg-type]  # validated by _validate
        description=entry.get("description"),  # type: ignore[arg-type]
        count=count,
        examples=tuple(examples),
    )


def _validate(vocab: Vocabulary) -> None:
    if not vocab.approaches:
        raise VocabularyError("the vocabulary has no approaches")
    seen: set[str] = set()
    for i, approach in enumerate(vocab.approaches):
        name = approach.name
        if not isinstance(name, str) or not APPROACH_NAME_RE.match(name):
            suggestion = normalise_approach_name(name) if isinstance(name, str) else None
            hint = f" (e.g. {suggestion!r})" if suggestion else ""
            raise VocabularyError(f"approaches[{i}].name {name!r} is not a snake_case name{hint}")
        if name in seen:
            raise VocabularyError(f"approach name {name!r} appears more than once")
        seen.add(name)
        if not isinstance(approach.description, str) or not approach.description.strip():
            raise VocabularyError(f"approaches[{i}] ({name}) needs a non-empty one-line 'description'")
        if "\n" in approach.description.strip():
            raise VocabularyError(f"approaches[{i}] ({name}) description must be one line")
    if vocab.default not in seen:
        raise VocabularyError(f"default {vocab.default!r} is not one of the approach names {sorted(seen)}")
    if vocab.domain not in DOMAINS:
        raise VocabularyError(f"domain {vocab.domain!r} must be one of {list(DOMAINS)}")
    if not isinstance(vocab.reviewed, bool):
        raise VocabularyError(f"reviewed must be a bool, got {vocab.reviewed!r}")


def load_vocabulary(path: str | os.PathLike[str] | None = None, *, warn_unreviewed: bool = True) -> Vocabulary:
    """Load and validate a vocabulary YAML (default: the packaged, reviewed SQL vocabulary).

    Warns with :class:`UnreviewedVocabularyWarning` when the file says ``reviewed: false`` (or
    does not say ``reviewed: true``).
    """
    file = Path(path) if path is not None else DEFAULT_SQL_VOCABULARY_PATH
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise VocabularyError(f"cannot read vocabulary file {file}: {err}") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise VocabularyError(f"{file}: invalid YAML: {err}") from err
    vocab = Vocabulary.from_dict(data, source=str(file))
    if warn_unreviewed and not vocab.reviewed:
        warnings.warn(
            f"{file}: vocabulary is not reviewed (reviewed: false); check names/descriptions, "
            "then set 'reviewed: true'",
            UnreviewedVocabularyWarning,
            stacklevel=2,
        )
    return vocab


def save_vocabulary(
    vocabulary: Vocabulary,
    path: str | os.PathLike[str],
    *,
    induction: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``vocabulary`` as YAML atomically (tmp file + ``os.replace``); returns the path."""
    data = vocabulary.to_dict()
    if induction is not None:
        data["induction"] = dict(induction)
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.fchmod(fd, default_file_mode())  # mkstemp makes 0600; keep the user's umask
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


# --------------------------------------------------------------------------------------------
# Induction
# --------------------------------------------------------------------------------------------

_FILLER_TOKENS = frozenset({"a", "an", "the", "approach", "strategy", "method", "technique", "based", "using", "via"})
_NOT_PLURAL = frozenset({"exists", "has", "does", "always", "less", "across", "analysis", "basis", "various"})
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def strip_thinking(text: str) -> str:
    """Drop ``<think>...</think>`` blocks (reasoning models); an unclosed block keeps its body."""
    text = _THINK_RE.sub(" ", text)
    return re.sub(r"</?think>", " ", text, flags=re.IGNORECASE)


def _singular(token: str) -> str:
    if token in _NOT_PLURAL or len(token) <= 3:
        return token
    if token.endswith("ies"):
        return token[:-3] + "y"
    if token.endswith(("sses", "xes", "ches", "shes")):
        return token[:-2]
    if token.endswith("s") and not token.endswith(("ss", "us", "is")):
        return token[:-1]
    return token


def normalise_approach_name(raw: str) -> str | None:
    """Map a model-written name to snake_case, singular, without filler words; None if empty.

    ``"Nested Subqueries"`` -> ``nested_subquery``, ``"join-based approach"`` -> ``join``.
    """
    text = re.sub(r"[^a-z0-9]+", "_", raw.lower())
    tokens = [_singular(t) for t in text.split("_") if t and t not in _FILLER_TOKENS]
    while tokens and tokens[0][0].isdigit():
        tokens.pop(0)  # "1_join" from a numbered list
    tokens = tokens[:6]
    return "_".join(tokens) or None


def build_induction_messages(item: str, *, domain: str = "sql") -> list[dict[str, str]]:
    """Chat messages asking the model to name the strategy of one seed solution."""
    what, fence = ("SQL query", "sql") if domain == "sql" else ("math solution", "")
    content = (
        f"Here is a correct {what}.\n\n```{fence}\n{item.strip()}\n```\n\n"
        f"Name the problem-solving strategy this {what} uses, in general terms that would also "
        "describe other solutions using the same strategy (not this particular question).\n"
        "Answer with exactly two lines:\n"
        "name: <short snake_case name, 1-4 words>\n"
        "description: <one sentence describing the strategy>"
    )
    return [{"role": "user", "content": content}]


def parse_induction_answer(text: str) -> tuple[str, str] | None:
    """Extract ``(normalised name, description)`` from a model answer; None if no usable name.

    Accepts the requested ``name: ... / description: ...`` lines, a JSON object with those
    keys, or a bare first line used as the name.
    """
    text = strip_thinking(text).strip()
    if not text:
        return None
    raw_name: str | None = None
    description = ""
    obj = re.search(r"\{.*?\}", text, re.DOTALL)
    if obj:
        try:
            parsed = json.loads(obj.group(0))
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            raw_name = parsed["name"]
            description = str(parsed.get("description") or "")
    if raw_name is None:
        name_match = re.search(r"(?im)^[\W_]*name[\W_]*[:=]\s*(.+)$", text)
        desc_match = re.search(r"(?im)^[\W_]*description[\W_]*[:=]\s*(.+)$", text)
        if name_match:
            raw_name = name_match.group(1)
        else:
            first = next(line for line in text.splitlines() if line.strip())
            if len(first.split()) > 6:
                return None  # prose, not a name
            raw_name = first
        description = desc_match.group(1) if desc_match else ""
    name = normalise_approach_name(raw_name)
    if name is None:
        return None
    return name, " ".join(description.strip().strip("*`\"'").split())


@dataclass
class InductionResult:
    vocabulary: Vocabulary  # reviewed=False, at most max_approaches entries, sorted by count
    num_items: int
    unparsed: int  # answers that named nothing usable
    dropped: dict[str, int] = field(default_factory=dict)  # approaches beyond max_approaches
    variants: dict[str, list[str]] = field(default_factory=dict)  # kept name -> merged spellings

    def metadata(self) -> dict[str, Any]:
        return {
            "num_items": self.num_items,
            "unparsed": self.unparsed,
            "dropped": dict(self.dropped),
            "merged_variants": {k: list(v) for k, v in self.variants.items() if len(v) > 1},
        }


def induce_vocabulary(
    items: Sequence[str],
    backend: GenerationBackend,
    *,
    domain: str = "sql",
    max_approaches: int = 16,
    examples_per_approach: int = 2,
    batch_size: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 96,
    seed: int = 0,
) -> InductionResult:
    """Ask the model to name the strategy of each seed solution; merge and count the names.

    Names are normalised (:func:`normalise_approach_name`) and names with the same set of
    words (``join_self`` / ``self_join``) are merged; the most frequent spelling is kept. The
    ``max_approaches`` most frequent names are kept (ties by name), the rest are reported in
    ``dropped``. Each kept approach gets its most common description and its
    ``examples_per_approach`` shortest distinct example solutions.
    """
    if max_approaches < 1:
        raise ValueError(f"max_approaches must be >= 1, got {max_approaches}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not items:
        raise ValueError("no seed solutions given")
    answers: list[str] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        prompts = [build_induction_messages(item, domain=domain) for item in chunk]
        outputs = backend.generate(
            prompts, n=1, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed + start
        )
        answers.extend(samples[0].text for samples in outputs)

    groups: dict[tuple[str, ...], list[tuple[int, str, str]]] = {}  # word set -> (index, name, desc)
    unparsed = 0
    for index, answer in enumerate(answers):
        parsed = parse_induction_answer(answer)
        if parsed is None:
            unparsed += 1
            continue
        name, description = parsed
        groups.setdefault(tuple(sorted(name.split("_"))), []).append((index, name, description))
    if not groups:
        raise VocabularyError(f"the model named no usable approach for any of the {len(items)} seed solutions")

    merged = [_merge_group(members, items, examples_per_approach) for members in groups.values()]
    merged.sort(key=lambda a: (-(a[0].count or 0), a[0].name))
    kept, rest = merged[:max_approaches], merged[max_approaches:]
    vocabulary = Vocabulary(
        approaches=tuple(a for a, _ in kept),
        default=kept[0][0].name,
        domain=domain,
        reviewed=False,
    )
    return InductionResult(
        vocabulary=vocabulary,
        num_items=len(items),
        unparsed=unparsed,
        dropped={a.name: a.count or 0 for a, _ in rest},
        variants={a.name: spellings for a, spellings in kept},
    )


def _merge_group(
    members: list[tuple[int, str, str]], items: Sequence[str], examples_per_approach: int
) -> tuple[Approach, list[str]]:
    name_counts = Counter(name for _, name, _ in members)
    first_seen = {}
    for index, name, _ in members:
        first_seen.setdefault(name, index)
    name = min(name_counts, key=lambda n: (-name_counts[n], n))
    desc_counts = Counter(d for _, _, d in members if d)
    if desc_counts:
        description = min(desc_counts, key=lambda d: (-desc_counts[d], d))
    else:
        description = f"Strategy the model called '{name}' (it gave no description)."
    distinct: dict[str, int] = {}
    for index, _, _ in members:
        distinct.setdefault(items[index].strip(), index)
    examples = sorted(distinct, key=lambda text: (len(text), distinct[text]))[:examples_per_approach]
    spellings = sorted(name_counts, key=lambda n: (-name_counts[n], n))
    return Approach(name=name, description=description, count=len(members), examples=tuple(examples)), spellings


def write_induced_vocabulary(
    result: InductionResult, path: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None
) -> Path:
    """Save an induction result for human review (``reviewed: false`` + counts and examples)."""
    metadata = result.metadata()
    if extra:
        metadata.update(extra)
    return save_vocabulary(result.vocabulary, path, induction=metadata)


def iter_jsonl_field(lines: Iterable[str], field_name: str, *, source: str = "<jsonl>") -> Iterator[str]:
    """Yield ``record[field_name]`` of each non-blank JSONL line, with line numbers in errors."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{source}:{number}: invalid JSON: {err}") from err
        value = record.get(field_name) if isinstance(record, dict) else None
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{source}:{number}: missing or empty string field {field_name!r}")
        yield value
