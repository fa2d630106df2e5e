"""Strategy comparisons the way the papers run them: ``python -m verl_replay.compare``.

``plan`` turns a comparison (``headroom_drift``: on-policy matched / larger, naive replay,
Headroom-Drift; ``elite``: GRPO, IID archive replay, EliteReplay) and a profile (``tiny`` on CPU,
``paper`` on a GPU cluster) into recipe commands, ``runner`` runs them one at a time,
``collect`` reads what each run wrote and ``report`` writes ``comparison.json``, ``table.md``
and ``curves.png``. No training loop of its own: every arm is a normal recipe run.
"""
