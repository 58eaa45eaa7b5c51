"""The zoo versions pid-plugins is tested with (:data:`TESTED`; outside it, the import warns once) and the zoo
internals the adapters read (:class:`Internal`: ``check`` where first read, ``probe`` under ``pid-plugins doctor``)."""
from __future__ import annotations

import functools
import inspect
import platform
import re
import traceback
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

import torch

__all__ = ["TESTED", "Internal", "InternalChanged", "UntestedVersionWarning", "check_version", "doctor",
           "installed_version", "parameters", "perturbed", "reads", "require"]
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


def _key(version: str) -> Tuple[int, ...]:  # "5.24.0" -> (5, 24, 0); local and pre-release parts ignored
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
    #: what :func:`doctor` runs besides ``check``: the zoo's part and the method's compared on tiny models
    probe: Optional[Callable[[], bool]] = field(default=None, repr=False, compare=False)
    #: where it does not hold, the adapter refuses what needs it (an older release without it): not a change
    optional: bool = field(default=False, compare=False)

    def require(self) -> None:
        """Raise :class:`InternalChanged` if the internal changed (never inside a compile trace)."""
        if not self.holds():
            raise InternalChanged(self.message())

    def holds(self) -> bool:
        """Whether the internal looks as expected (``check``, once per process)."""
        return torch.compiler.is_compiling() or _holds(self)

    def message(self, detail: str = "") -> str:
        """The refusal: the zoo's version, the tested range, what to install."""
        if self.zoo == "python":
            head, advice = f"Python {platform.python_version()}", f"It is known to hold in Python {self.versions}; " \
                "run under one of those, or report it with this message."
        else:
            head = f"{self.zoo} {installed_version(self.zoo) or '?'}"
            advice = (f"pid-plugins is tested with {self.zoo} {tested_range(self.zoo)} (known to hold in "
                      f"{self.versions}); install {self.zoo}=={TESTED[self.zoo][1]} (pip install -c constraints.txt), "
                      "or report it with this message.")
        return (f"{head} changed an internal pid-plugins reads: {self.name}{f' ({detail})' if detail else ''}, "
                f"needed for {self.why}. {advice} "
                "Nothing was computed with the changed internal.")


@functools.lru_cache(maxsize=None)
def _holds(internal: Internal) -> bool:
    try:
        return bool(internal.check())
    except Exception:  # an attribute, a class or a signature that is gone: the internal changed
        return False


def require(*internals: Internal) -> None:
    """:meth:`Internal.require` each of ``internals``, in order."""
    for internal in internals:
        internal.require()


def reads(function: Any, name: str = "self") -> FrozenSet[str]:
    """The attributes ``function`` reads or calls on ``name`` (``<name>.<attribute>`` in its source)."""
    return frozenset(re.findall(rf"\b{name}\.(\w+)", inspect.getsource(function)))


def parameters(function: Any) -> List[str]:
    """The names of ``function``'s parameters, in order."""
    return list(inspect.signature(function).parameters)


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in float32 and eval mode, every parameter moved off its initial value (every step counts)."""
    module.float().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, dtype=p.dtype) * 0.1)
    return module


def doctor(internals: Iterable[Internal]) -> List[Tuple[Internal, Optional[str]]]:
    """Each internal's check and probe, run now on the CPU (torch's random state restored): ``(internal, None)``
    where it holds, else what failed."""
    results = []
    for internal in internals:
        failed: Optional[str] = None
        for kind, run in (("check", internal.check), ("probe", internal.probe)):
            if run is None or failed is not None:
                continue
            try:
                with torch.random.fork_rng(devices=[]), torch.device("cpu"):
                    torch.manual_seed(0)
                    ok = bool(run())
            except Exception as exc:  # noqa: BLE001 - reported, with where it came from
                failed = f"its {kind} raised {type(exc).__name__}: {exc} ({traceback.format_exc(limit=-1).strip()})"
            else:
                failed = None if ok else f"its {kind} found it changed"
        results.append((internal, failed))
    return results
