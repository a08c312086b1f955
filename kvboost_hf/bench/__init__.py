"""Benchmarks: ``python -m kvboost_hf.bench NAME`` runs ``kvboost_hf.bench.NAME.main(argv)``.

Each benchmark prints a table, and saves a JSON file and a PNG plot under ``--out`` (default
``bench_results/``). Ratios are measured side by side in one run.
"""
