"""kvmesh: a distributed LLM serving mesh."""

__version__ = "0.1.0"
