"""Integrations with inference engines and RL frameworks (public).

- ``m2n_async.integrations.vllm`` — an ``m2n_async`` weight-transfer backend for vLLM
  (worker engine, trainer engine, and the ``vllm.general_plugins`` entry point that
  registers both). See docs/vllm.md.

Each integration imports its framework lazily, inside the functions that need it, so these
modules import (and their tests run) without the framework installed.
"""
