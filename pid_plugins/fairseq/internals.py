"""The one internal the fairseq adapter checks: Python's ``dataclasses._get_field``, which
:mod:`pid_plugins_fairseq_compat` wraps."""
from __future__ import annotations

import inspect

from ..versions import Internal

__all__ = ["DATACLASS_FIELD", "INTERNALS"]


def _dataclass_field() -> bool:
    """``dataclasses._get_field`` refuses an unhashable dataclass default and takes one whose class has ``__hash__``."""
    import dataclasses

    import pid_plugins_fairseq_compat

    if not pid_plugins_fairseq_compat.target_holds():
        return False
    get_field = pid_plugins_fairseq_compat.python_get_field()
    later = list(inspect.signature(get_field).parameters.values())[3:]  # 3.12's default_kw_only

    @dataclasses.dataclass
    class Inner:
        x: int = 0

    class Owner:
        inner: Inner = Inner()

    args = (Owner, "inner", Inner, *(False for p in later if p.default is inspect.Parameter.empty))
    try:
        get_field(*args)
        return False  # taken while unhashable: this Python does not refuse it, and the hook would relax nothing
    except ValueError:
        pass
    Inner.__hash__ = object.__hash__  # type: ignore[assignment,method-assign]  (what the hook does to the class)
    field = get_field(*args)
    return isinstance(field, dataclasses.Field) and field.default is vars(Owner)["inner"]


DATACLASS_FIELD = Internal(
    "python", "dataclasses._get_field(cls, a_name, a_type, ...) refusing defaults whose class is unhashable",
    "importing fairseq 0.12.2 and hydra 1.0.7, whose config dataclasses have dataclass instances as defaults "
    "(pid_plugins_fairseq_compat)", "3.11 - 3.13", _dataclass_field)

INTERNALS = (DATACLASS_FIELD,)
