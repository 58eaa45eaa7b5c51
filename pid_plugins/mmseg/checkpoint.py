"""mmengine checkpoint loading that never runs code from a checkpoint (``weights_only=True`` with
:data:`SAFE_GLOBALS`), on the plugin's paths, under :class:`WeightsOnlyCheckpointHook` or after :func:`install`."""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import threading
from typing import Any, Callable, Dict, Iterator, List, Tuple, Union

import numpy as np
import torch
from mmengine.dist import get_dist_info
from mmengine.hooks import Hook
from mmengine.logging.history_buffer import HistoryBuffer
from mmengine.runner import checkpoint as mm_checkpoint
from mmseg.registry import HOOKS

from ..core.checkpoint import UnsafeCheckpointError, load_weights_only, weights_only
from .internals import CHECKPOINT_HELPERS, CHECKPOINT_SCHEMES, CHECKPOINTS, SCHEME_PREFIXES, require

__all__ = ["load_checkpoint", "weights_only_schemes", "WeightsOnlyCheckpointHook", "install",
           "history_buffer_method", "SAFE_GLOBALS", "UnsafeCheckpointError"]

_STATISTICS = ("min", "max", "current", "mean")  # HistoryBuffer._set_default_statistics


def history_buffer_method(owner: Any, name: str) -> Callable:
    """``getattr`` restricted to what mmengine checkpoints pickle: ``HistoryBuffer.<statistic>``."""
    if owner is HistoryBuffer and name in _STATISTICS:
        return getattr(HistoryBuffer, name)
    raise pickle.UnpicklingError(f"checkpoint asks for getattr({owner!r}, {name!r}); only HistoryBuffer's "
                                 f"statistic methods {list(_STATISTICS)} are allowed")


def _numpy_globals() -> List[Any]:
    core = np._core if hasattr(np, "_core") else np.core  # numpy 2 / numpy 1
    dtypes = [type(np.dtype(t)) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                         np.uint32, np.uint64, np.float16, np.float32, np.float64)]
    return [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype, *dtypes]


#: the classes mmengine's training checkpoints need beyond tensors, allow-listed only inside these loads
SAFE_GLOBALS: List[Union[Any, Tuple[Callable, str]]] = [
    HistoryBuffer, (history_buffer_method, "builtins.getattr"), *_numpy_globals()]
_ALLOWED = "weights and mmengine's checkpoint classes"


def _torch_load(source: Any, name: str, map_location: Any) -> Any:
    return load_weights_only(source, map_location, name=name, allowed=SAFE_GLOBALS, allowed_text=_ALLOWED)


def load_from_local_weights_only(filename: str, map_location: Any = None) -> Any:
    path = os.path.expanduser(filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{filename} can not be found.")
    return _torch_load(path, filename, map_location)


def load_from_http_weights_only(url: str, map_location: Any = None) -> Any:
    def fetch() -> Any:
        with weights_only(url, SAFE_GLOBALS, _ALLOWED):
            return torch.hub.load_state_dict_from_url(url, map_location=map_location, progress=False,
                                                      weights_only=True)

    rank, world_size = get_dist_info()  # rank 0 downloads first, as mmengine's load_from_http
    checkpoint = fetch() if rank == 0 else None
    if world_size > 1:
        torch.distributed.barrier()
        if rank > 0:
            checkpoint = fetch()
    return checkpoint


def load_from_ceph_weights_only(filename: str, map_location: Any = None) -> Any:
    backend = mm_checkpoint.get_file_backend(filename, backend_args={"backend": "petrel"})
    with io.BytesIO(backend.get(filename)) as buffer:
        return _torch_load(buffer, filename, map_location)


def load_from_torchvision_weights_only(filename: str, map_location: Any = None) -> Any:
    name = filename.split("://", 1)[1]
    return load_from_http_weights_only(mm_checkpoint.get_torchvision_models()[name], map_location)


def load_from_openmmlab_weights_only(filename: str, map_location: Any = None) -> Any:
    name = filename.split("://", 1)[1]
    name = mm_checkpoint.get_deprecated_model_names().get(name, name)
    url = mm_checkpoint.get_external_models()[name]
    if url.startswith(("http://", "https://")):
        return load_from_http_weights_only(url, map_location)
    return load_from_local_weights_only(os.path.join(mm_checkpoint._get_mmengine_home(), url), map_location)


def load_from_mmcls_weights_only(filename: str, map_location: Any = None) -> Any:
    checkpoint = load_from_http_weights_only(mm_checkpoint.get_mmcls_models()[filename[len("mmcls://"):]], map_location)
    return mm_checkpoint._process_mmcls_checkpoint(checkpoint)


def load_from_pavi_refused(filename: str, map_location: Any = None) -> Any:
    raise UnsafeCheckpointError(f"pid_plugins.mmseg does not load pavi:// checkpoints ({filename!r}): mmengine's "
                                "pavi loader cannot be made weights-only; download the file and give its local path")


# mmengine 0.10's schemes (mmengine/runner/checkpoint.py), longest prefix first as in CheckpointLoader.
_SCHEMES: List[Tuple[Tuple[str, ...], Callable[..., Any]]] = list(zip(SCHEME_PREFIXES, (
    load_from_ceph_weights_only, load_from_torchvision_weights_only, load_from_openmmlab_weights_only,
    load_from_mmcls_weights_only, load_from_pavi_refused, load_from_http_weights_only, load_from_local_weights_only,
)))


def load_checkpoint(filename: str, map_location: Any = None) -> Any:
    """Load a checkpoint by path or URL (mmengine's schemes) with ``weights_only=True``, always."""
    require(*CHECKPOINTS)
    for prefixes, loader in _SCHEMES:
        for prefix in prefixes:
            if prefix and re.match(prefix, filename):
                return loader(filename, map_location)
    return load_from_local_weights_only(filename, map_location)


_SCOPE_LOCK = threading.RLock()


@contextlib.contextmanager
def weights_only_schemes() -> Iterator[None]:
    """Inside: every mmengine ``CheckpointLoader`` scheme loads weights only; after: mmengine's table as it was."""
    require(CHECKPOINT_SCHEMES, CHECKPOINT_HELPERS)
    loader_class = mm_checkpoint.CheckpointLoader
    with _SCOPE_LOCK:
        # register_scheme mutates mmengine's table and rebinds a sorted copy: a copy rebound afterwards restores it
        saved: Dict[str, Callable[..., Any]] = loader_class._schemes.copy()
        try:
            for prefixes, loader in _SCHEMES:
                loader_class.register_scheme(prefixes, loader=loader, force=True)
            yield
        finally:
            loader_class._schemes = saved


@HOOKS.register_module()
class WeightsOnlyCheckpointHook(Hook):
    """Every mmengine checkpoint load between ``before_run`` and ``after_run`` is weights-only."""

    priority = "HIGHEST"

    def __init__(self) -> None:
        self._scope: Any = None

    def before_run(self, runner: Any) -> None:
        if self._scope is None:
            scope = weights_only_schemes()
            scope.__enter__()  # refused (InternalChanged) before mmengine's table changes: no scope is kept
            self._scope = scope

    def after_run(self, runner: Any) -> None:
        if self._scope is not None:
            scope, self._scope = self._scope, None
            scope.__exit__(None, None, None)


def install() -> None:
    """Opt-in, process-wide: every mmengine checkpoint scheme loads weights only from now on."""
    require(*CHECKPOINTS)
    torch.serialization.add_safe_globals(SAFE_GLOBALS)
    for prefixes, loader in _SCHEMES:
        mm_checkpoint.CheckpointLoader.register_scheme(prefixes, loader=loader, force=True)
