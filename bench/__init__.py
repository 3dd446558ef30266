"""Benchmarks of the parallel engine on a compute-bound Flux-like model: `python -m bench SUITE`.

overhead      the wrapped pipeline on 1 rank against plain diffusers (goal: within 2%)
efficiency    T(1) / (N·T(N)) for Ulysses-2, Ring-2 and CFG-2, with bytes sent against the analytic minimum
diffusers-cp  the same sequence-parallel layouts under diffusers' own context parallelism, side by side
all           everything, into bench/out/results.json and a markdown table
"""
