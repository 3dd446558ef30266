"""The persistent worker pool: torchrun ranks behind a ZeroMQ endpoint (docs/architecture.md, contract P)."""
