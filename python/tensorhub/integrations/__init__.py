"""Adapters between TensorHub and inference engines and trainers.

- :mod:`tensorhub.integrations.vllm`: a vLLM weight-transfer backend named ``"tensorhub"`` (the
  engine side of vLLM's pluggable weight transfer) and the trainer's side that publishes each
  version and drives the engine's four phases.

Each adapter imports its engine only when the engine is installed: without it, the adapter still
imports and runs against a stand-in of the same interface (the tests do that).
"""
