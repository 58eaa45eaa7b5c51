"""The mmengine internals the mmseg adapter checks by behaviour: the parts of its checkpoint module that the
weights-only loading replaces and restores."""
from __future__ import annotations

from ..versions import Internal, parameters, require

__all__ = ["INTERNALS", "require"]

MMENGINE = "mmengine"
#: the module name of mmcv's compiled ops (:mod:`pid_plugins.mmseg.compat` stands in for it where it is absent)
MMCV_EXT_NAME = "mmcv._ext"
#: mmengine's checkpoint schemes grouped by loader, in the order :mod:`pid_plugins.mmseg.checkpoint` pairs them
SCHEME_PREFIXES = ((r"(\S+\:)?s3://", r"(\S+\:)?petrel://"), ("modelzoo://", "torchvision://"),
                   ("open-mmlab://", "openmmlab://"), ("mmcls://",), ("pavi://",), ("http://", "https://"), ("",))
#: a path each scheme of :data:`SCHEME_PREFIXES` answers to
_SCHEME_SAMPLES = {r"(\S+\:)?s3://": "s3://bucket/model.pth", r"(\S+\:)?petrel://": "cluster:petrel://b/model.pth",
                   "modelzoo://": "modelzoo://resnet50", "torchvision://": "torchvision://resnet50",
                   "open-mmlab://": "open-mmlab://resnet50_v1c", "openmmlab://": "openmmlab://resnet50_v1c",
                   "mmcls://": "mmcls://resnet50", "pavi://": "pavi://model.pth", "http://": "http://host/model.pth",
                   "https://": "https://host/model.pth", "": "work_dirs/model.pth"}


def _checkpoint_schemes() -> bool:
    """mmengine's schemes match the weights-only loaders and load by scheme; ``register_scheme`` rebinds the table."""
    from mmengine.runner import checkpoint as mm_checkpoint

    loader = mm_checkpoint.CheckpointLoader
    schemes = vars(loader).get("_schemes")
    ours = {p for prefixes in SCHEME_PREFIXES for p in prefixes}
    if not (isinstance(schemes, dict) and set(_SCHEME_SAMPLES) == ours
            and parameters(loader.register_scheme)[:3] == ["prefixes", "loader", "force"]):
        return False
    owners = (mm_checkpoint.__name__, f"{__package__}.checkpoint")
    known = {p for p, fn in schemes.items() if getattr(fn, "__module__", None) in owners}
    if not (known == ours and list(schemes) == sorted(schemes, reverse=True)
            and all(loader._get_checkpoint_loader(path) is schemes[p] for p, path in _SCHEME_SAMPLES.items())):
        return False
    # register_scheme rebinds the table to a new sorted one: probed on a subclass holding a copy
    probe = type("Probe", (loader,), {"_schemes": dict(schemes)})
    before = probe._schemes
    probe.register_scheme("pid-plugins-probe://", loader=lambda *args, **kwargs: None)
    return (probe._schemes is not before
            and list(probe._schemes) == sorted(probe._schemes, reverse=True)
            and "pid-plugins-probe://" in probe._schemes and "pid-plugins-probe://" not in loader._schemes)


def _checkpoint_helpers() -> bool:
    from mmengine.runner import checkpoint as mm_checkpoint

    return (all(parameters(getattr(mm_checkpoint, name)) == [] for name in (
        "_get_mmengine_home", "get_torchvision_models", "get_external_models", "get_deprecated_model_names",
        "get_mmcls_models"))
        and parameters(mm_checkpoint._process_mmcls_checkpoint) == ["checkpoint"]
        and parameters(mm_checkpoint.get_file_backend)[:2] == ["uri", "backend_args"])


#: HistoryBuffer's statistic methods, which mmengine's training checkpoints pickle as getattr(HistoryBuffer, name)
STATISTICS = ("min", "max", "current", "mean")


def _history_buffer() -> bool:
    """A ``HistoryBuffer`` maps each statistic's name to the class's function (what a training checkpoint pickles)."""
    from mmengine.logging.history_buffer import HistoryBuffer

    methods = HistoryBuffer()._statistics_methods
    return (set(STATISTICS) <= set(methods)
            and all(methods[name] is getattr(HistoryBuffer, name) for name in STATISTICS))


CHECKPOINT_SCHEMES = Internal(
    MMENGINE, "mmengine CheckpointLoader._schemes (a class attribute register_scheme rebinds) and the schemes "
    "mmengine.runner.checkpoint registers", "loading every scheme weights-only, and restoring mmengine's table after",
    "0.10.7", _checkpoint_schemes)
CHECKPOINT_HELPERS = Internal(
    MMENGINE, "mmengine.runner.checkpoint._get_mmengine_home, _process_mmcls_checkpoint, get_*_models, "
    "get_file_backend",
    "the weights-only loaders of the open-mmlab://, mmcls://, torchvision:// and s3:// schemes (mmengine's lookups)",
    "0.10.7", _checkpoint_helpers)
HISTORY_BUFFER = Internal(
    MMENGINE, "mmengine HistoryBuffer's statistic methods (min, max, current, mean; _set_default_statistics)",
    "allow-listing exactly what mmengine's training checkpoints pickle by reference (getattr(HistoryBuffer, name))",
    "0.10.7", _history_buffer)

INTERNALS = (CHECKPOINT_SCHEMES, CHECKPOINT_HELPERS, HISTORY_BUFFER)
#: what the weights-only checkpoint loading relies on
CHECKPOINTS = INTERNALS
