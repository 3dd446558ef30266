"""The parallel engine: xDiT-style wrappers around diffusers pipelines (see docs/architecture.md)."""
