"""The persistent worker pool: torchrun ranks behind a ZeroMQ endpoint (see DESIGN.md, contract P)."""
