"""EliteReplay: MAP-Elites archive of verified solutions, frozen-archive file, replay samplers
and the length-normalised replay loss.

Modules (import them directly; this package imports nothing so that ``import verl_replay.elite``
stays cheap and torch-free):

* :mod:`verl_replay.elite.archive` -- ``EliteArchive`` (search-time archive), ``FrozenArchive``;
* :mod:`verl_replay.elite.archive_io` -- parquet + manifest file (pyarrow), ``tokenizer_fingerprint``;
* :mod:`verl_replay.elite.sampler` -- ``BalancedSampler``, ``IIDSampler``;
* :mod:`verl_replay.elite.losses` -- ``length_normalized_nll`` and its building blocks (torch).
"""
