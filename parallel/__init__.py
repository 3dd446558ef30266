"""The parallel engine: xDiT-style wrappers around diffusers pipelines (see DESIGN.md)."""
