"""GPU tests need CUDA, nccl4py, nccl-extensions and libnccl >= 2.30 (several ranks per GPU).

Without them every test here is skipped with the reason shown (``-ra``), never errored.
"""

from __future__ import annotations

import functools


@functools.cache
def gpu_skip_reason() -> str | None:
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is a dependency
        return f"torch unavailable: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA device (GPU tests run on the H200 host, see DEVELOPERS.md)"
    from m2n_async._data import _cuda
    from m2n_async._data._transport import TransportSettings

    reason = _cuda.gpu_unavailable_reason("m2n", TransportSettings(1 << 20, 1))
    if reason is not None:
        return f"GPU stack incomplete: {reason}"
    version, _ = _cuda.libnccl_version()
    if version is None or _cuda._version_tuple(version) < (2, 30):
        return f"libnccl {version} < 2.30: several ranks on one GPU are refused"
    return None
