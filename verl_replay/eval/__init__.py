"""Evaluation. :mod:`verl_replay.eval.metrics` holds the pure metrics (pass@k,
Mean@n / Best@n, macro / weighted averages, distinct correct strategies, AmbiQT coverage).
This package imports nothing eagerly.
"""
