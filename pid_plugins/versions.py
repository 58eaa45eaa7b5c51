"""The zoo versions pid-plugins is tested with (:data:`TESTED`; outside it, the import warns once) and the guard on the
zoo internals the adapters read (``<zoo>/internals.py``; :class:`InternalChanged` before anything is computed)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import platform
import re
import sys
import threading
import types
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["TESTED", "Internal", "InternalChanged", "ProbeUnavailable", "UntestedVersionWarning", "behaviour_probe",
           "check_version", "installed_version", "parameters", "perturbed", "reads", "require", "settle"]

#: distribution -> (lowest, newest) release the tests run under (make test-compat / make test); torch's lowest is the
#: core's and vLLM's (constraints-vllm.txt), the zoo adapters' is :data:`ZOO_TORCH`
TESTED: Dict[str, Tuple[str, str]] = {
    "torch": ("2.13.0", "2.15.0"),
    "transformers": ("5.20.0", "5.24.0"),
    "timm": ("1.0.28", "1.0.31"),
    "mmsegmentation": ("1.2.2", "1.2.2"),
    "mmengine": ("0.10.7", "0.10.7"),
    "mmcv-lite": ("2.1.0", "2.1.0"),
    "fairseq": ("0.12.2", "0.12.2"),
    "peft": ("0.21.2", "0.21.2"),
    "accelerate": ("1.15.0", "1.15.0"),
}

#: the lowest torch the zoo adapters (timm, transformers, mmseg, fairseq) are tested with (make test-compat)
ZOO_TORCH = "2.14.1"


class UntestedVersionWarning(UserWarning):
    """A zoo (or torch) is installed at a version outside the range pid-plugins is tested with."""


class InternalChanged(RuntimeError):
    """A zoo internal an adapter reads does not look as the adapter expects (a zoo release changed it)."""


class ProbeUnavailable(RuntimeError):
    """An internal's behavioural check cannot run in the caller's construction context (nothing was found changed)."""


def _key(version: str) -> Tuple[int, ...]:
    """``"5.24.0"`` -> (5, 24, 0); local and pre-release parts ignored (``2.15.0+cu132``, ``1.0.0rc1``)."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution``, or None."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def tested_range(distribution: str) -> str:
    low, high = TESTED[distribution]
    return f"{low} to {high}" if low != high else low


@functools.lru_cache(maxsize=None)
def check_version(distribution: str, version: Optional[str] = None) -> bool:
    """Warn once if ``distribution`` is installed outside its tested range; True when inside (or not installed)."""
    version = installed_version(distribution) if version is None else version
    if version is None or distribution not in TESTED:
        return True
    low, high = TESTED[distribution]
    if _key(low) <= _key(version) <= _key(high):
        return True
    side = "newer than the newest" if _key(version) > _key(high) else "older than the oldest"
    warnings.warn(
        f"{distribution} {version} is {side} release pid-plugins is tested with ({tested_range(distribution)}). "
        f"Internals the adapter reads are checked where used and refused with an error if they changed; for results "
        f"we have verified, install {distribution}=={high} (pip install -c constraints.txt 'pid-plugins[...]').",
        UntestedVersionWarning, stacklevel=3)
    return False


@dataclass(frozen=True)
class Internal:
    """A private internal of a zoo that an adapter reads; ``check`` answers whether it still looks as expected."""

    zoo: str  #: the distribution (``"transformers"``)
    name: str  #: what is read (``"StaticLayer.cumulative_length"``)
    why: str  #: what the adapter needs it for
    versions: str  #: the releases it is known to hold in (``"5.0 -"``)
    check: Callable[[], bool] = field(repr=False, compare=False)

    def require(self) -> None:
        """Raise :class:`InternalChanged` if the internal changed (never inside a compile trace or a probe)."""
        if not self.holds():
            raise InternalChanged(self.message())

    def holds(self) -> bool:
        """Whether the internal looks as expected (True inside a compile trace and while this thread probes)."""
        return torch.compiler.is_compiling() or _probing() or _holds(self)

    def message(self, detail: str = "") -> str:
        """The refusal: the zoo's version (or Python's: ``zoo="python"``), the tested range, what to install."""
        extra = f" ({detail})" if detail else ""
        if self.zoo == "python":
            head, advice = f"Python {platform.python_version()}", f"It is known to hold in Python {self.versions}; " \
                "run under one of those, or report it with this message."
        else:
            head = f"{self.zoo} {installed_version(self.zoo) or '?'}"
            advice = (f"pid-plugins is tested with {self.zoo} {tested_range(self.zoo)} (known to hold in "
                      f"{self.versions}); install {self.zoo}=={TESTED[self.zoo][1]} (pip install -c constraints.txt), "
                      "or report it with this message.")
        return (f"{head} changed an internal pid-plugins reads: {self.name}{extra}, needed for {self.why}. {advice} "
                "Nothing was computed with the changed internal.")


@functools.lru_cache(maxsize=None)
def _holds(internal: Internal) -> bool:
    try:
        return bool(internal.check())
    except ProbeUnavailable as exc:  # not an answer: asked again at the next use
        raise ProbeUnavailable(f"pid-plugins could not check {internal.zoo}'s {internal.name}: {exc}") from None
    except Exception:  # an attribute, a class or a signature that is gone: the internal changed
        return False


def require(*internals: Internal) -> None:
    """:meth:`Internal.require` each of ``internals``, in order."""
    for internal in internals:
        internal.require()


def settle(*internals: Internal) -> None:
    """Check ``internals`` now (at the adapter's import) and keep the answers for where they are used.

    The probes run on one intra-op thread: kernels on more would start the calling thread's OpenMP thread pool, and
    a process forked after the import (``torch.multiprocessing`` with ``start_method="fork"``) would deadlock in its
    first parallel kernel, as it does after any computation in its parent (GNU OpenMP is not fork-safe)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for internal in internals:
            with contextlib.suppress(ProbeUnavailable):
                internal.holds()
    finally:
        torch.set_num_threads(threads)


def reads(function: Any, name: str = "self") -> FrozenSet[str]:
    """The attributes ``function`` reads or calls on ``name`` (``<name>.<attribute>`` in its source)."""
    return frozenset(re.findall(rf"\b{name}\.(\w+)", inspect.getsource(function)))


def parameters(function: Any) -> List[str]:
    """The names of ``function``'s parameters, in order."""
    return list(inspect.signature(function).parameters)


_LOCAL = threading.local()


def _probing() -> bool:
    return getattr(_LOCAL, "probing", False)


def _global_context() -> Optional[str]:
    """A process-wide construction context that changes what any module built now holds, or None."""
    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if getattr(zero, "zero_init_context", 0):
        return "deepspeed.zero.Init is active (it partitions every module built)"
    module = torch.nn.Module
    if any(getattr(module, n).__module__ != module.__module__ for n in ("register_parameter", "register_buffer")) \
            or not all(isinstance(getattr(torch, n), types.BuiltinFunctionType) for n in ("empty", "zeros", "ones")):
        return "torch's module or tensor constructors are patched (accelerate's init_empty_weights or init_on_device)"
    return None


class _OwnRandom(TorchFunctionMode):
    """This thread's random draws (torch's random ops, ``nn.init``) come from the probe's generator, not torch's."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)
        self.ops = {getattr(torch, n) for n in ("rand", "randn", "randint", "randperm", "normal", "bernoulli",
                                                "multinomial", "poisson")}
        self.ops |= {getattr(torch.Tensor, n) for n in ("uniform_", "normal_", "random_", "bernoulli_", "exponential_",
                                                        "cauchy_", "log_normal_", "geometric_")}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if (func in self.ops or "generator" in kwargs) and kwargs.get("generator") is None:
            kwargs["generator"] = self.generator
        return func(*args, **kwargs)


def behaviour_probe(compare: Callable[[], bool]) -> Callable[[], bool]:
    """An internal's check by behaviour: ``compare()`` builds the zoo's part and the method's and compares them,
    changing nothing another thread sees; :class:`ProbeUnavailable` where a construction context stops it.
    """
    @functools.wraps(compare)
    def probe() -> bool:
        if _probing():
            return True
        context = _global_context()
        if context is not None:
            raise ProbeUnavailable(
                f"its check builds tiny models, and {context}. Import the adapter before entering the context (the "
                "import runs the check), or build the model outside it; nothing was found changed.")
        _LOCAL.probing = True
        try:
            with torch.device("cpu"), _OwnRandom():
                return bool(compare())
        finally:
            _LOCAL.probing = False
    return probe


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in float32 and eval mode, every parameter moved off its initial value (every step counts)."""
    module.float().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, dtype=p.dtype) * 0.1)
    return module
