"""What the engine's entry points (run.py, make_inputs.py, demo.py) share: the parser whose mistakes are one
`error:` line, torchrun's exit codes read as the ranks' own, and the PNG decode of an output."""
