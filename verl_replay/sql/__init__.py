"""SQL descriptors for EliteReplay: strategy skeleton, structural descriptor, approach labelers,
approach vocabularies. Names are resolved lazily so that importing a light module
(e.g. ``verl_replay.sql.vocabulary``) does not import sqlglot.
"""

from __future__ import annotations

from verl_replay._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "SQLParseError": "verl_replay.sql.skeleton",
    "parse_query": "verl_replay.sql.skeleton",
    "sql_skeleton": "verl_replay.sql.skeleton",
    "StructuralDescriptor": "verl_replay.sql.descriptor",
    "describe_sql": "verl_replay.sql.descriptor",
    "structural_descriptor": "verl_replay.sql.descriptor",
    "Labeler": "verl_replay.sql.labeler",
    "LLMLabeler": "verl_replay.sql.labeler",
    "RuleBasedLabeler": "verl_replay.sql.labeler",
    "SQL_RULE_PRECEDENCE": "verl_replay.sql.labeler",
    "Approach": "verl_replay.sql.vocabulary",
    "Vocabulary": "verl_replay.sql.vocabulary",
    "VocabularyError": "verl_replay.sql.vocabulary",
    "UnreviewedVocabularyWarning": "verl_replay.sql.vocabulary",
    "load_vocabulary": "verl_replay.sql.vocabulary",
    "save_vocabulary": "verl_replay.sql.vocabulary",
    "induce_vocabulary": "verl_replay.sql.vocabulary",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
