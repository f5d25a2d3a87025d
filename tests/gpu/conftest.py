"""GPU tests need CUDA and nccl4py; ``m2n`` tests also nccl-extensions and libnccl >= 2.30.5;
a world with more ranks than GPUs needs libnccl >= 2.30 (several ranks per GPU).

Without them a test is skipped with the reason shown (``-ra``), never errored. So on a
multi-GPU host with torch's own libnccl 2.28 (before ``.gpu/kit/install.sh``) the ``nccl``
transport's tests run wherever there is one GPU per rank, and the ``m2n`` ones skip.
"""

from __future__ import annotations

import functools


@functools.cache
def gpu_skip_reason(transport: str = "m2n", world_size: int = 1) -> str | None:
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is a dependency
        return f"torch unavailable: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA device (GPU tests run on the H200 host, see DEVELOPERS.md)"
    from m2n_async._data import _cuda
    from m2n_async._data._transport import TransportSettings

    reason = _cuda.gpu_unavailable_reason(transport, TransportSettings(max_inflight=1))
    if reason is not None:
        return f"GPU stack incomplete for {transport}: {reason}"
    gpus = torch.cuda.device_count()
    version, _ = _cuda.libnccl_version()
    if world_size > gpus and (version is None or _cuda._version_tuple(version) < (2, 30)):
        return (f"libnccl {version} < 2.30 refuses several ranks on one GPU: {world_size} "
                f"ranks, {gpus} GPU(s)")
    return None
