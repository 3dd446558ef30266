"""The parallel layout: its degrees and options (config.py), `--layout auto`'s cost model and choice (choice.py),
and a pool's layout per job size (auto.py)."""
