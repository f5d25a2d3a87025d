"""A stand-in for the few vLLM 0.33 modules the m2n_async backend imports (tests only).

Put ``tests/integrations/vllm_stub`` first on ``sys.path`` to use it. The classes keep vLLM's
module paths, names and loader semantics (TP shards narrowed by rank, fused qkv/gate_up
loaded by shard id), so the backend's own code paths run as they do under vLLM.
"""
