"""vLLM 0.33's two weight-transfer factories, as far as registration and dispatch go: a
registry per factory, ``register_engine`` refusing a name twice, and the trainer factory's
``trainer_init`` dispatching on ``init_info.backend`` (``ValueError`` for an unknown one)."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar


class _Factory:
    _registry: ClassVar[dict[str, Any]]
    what: ClassVar[str]

    @classmethod
    def register_engine(cls, name: str, module_path_or_cls: Any,
                        class_name: str | None = None) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls._registry[name] = (module_path_or_cls, class_name)

    @classmethod
    def _engine_cls(cls, name: str) -> Any:
        if name not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {name}. Available "
                             f"{cls.what}: {list(cls._registry)}")
        module, class_name = cls._registry[name]
        if isinstance(module, str):
            return getattr(importlib.import_module(module), str(class_name))
        return module


class WeightTransferEngineFactory(_Factory):
    _registry: ClassVar[dict[str, Any]] = {}
    what = "engines"


class WeightTransferTrainerFactory(_Factory):
    _registry: ClassVar[dict[str, Any]] = {}
    what = "trainer engines"

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> Any:
        return cls._engine_cls(init_info.backend).trainer_init(init_info, client=client,
                                                               source=source)
