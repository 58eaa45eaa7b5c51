"""A method author's kit: run a registered attention method through every installed zoo against the author's own
float64 rule for one layer, the contract pid-plugins runs on its own methods (tests/core/test_method_contract.py).

    report = check("my_method", rule, cfg={"gamma": 0.7}, zero={"gamma": 0.0})
    print(report)          # one line per (model, case): exact, refused (the message) or wrong (the error)
    assert report.ok       # nothing wrong

``rule(qs, ks, vs, mask) -> u``: the query and key/value heads of the group's layers so far (the current layer
last, float64), the additive causal mask or None, and the layer's output before its output projection
(:mod:`.zoos`: :func:`~.zoos.on_outputs`, :func:`~.zoos.attention64`). The models (:data:`MODELS`): timm's DeiT and
FAN, a transformers Llama with grouped-query attention (left padding, ``generate`` on its caches) and BERT, mmseg's ViT
backbone and Segmenter head, fairseq's transformer_lm; the cases (:data:`CASES`): the float64 reference, the zero
parameters as the stock model bit for bit, activation checkpointing, ``torch.compile(fullgraph=True)``, a save/load
round trip, cached decoding. A zoo that is not installed is reported ``skipped``. Importing this needs only torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional

from .cases import APPLIES, CASES
from .models import MODELS, SEGMENTOR, Cfg, Model
from .zoos import Rule, attention64, causal_mask, on_outputs, on_scores, scores64

__all__ = ["APPLIES", "CASES", "MODELS", "SEGMENTOR", "Model", "Report", "Result", "Rule", "attention64",
           "causal_mask", "check", "on_outputs", "on_scores", "run_case", "scores64"]

ZOO_PACKAGES = ("timm", "transformers", "mmseg", "mmengine", "fairseq", "omegaconf")


@dataclass(frozen=True)
class Result:
    """One case on one model: ``status`` is ``exact``, ``refused`` (the zoo or the method said no: ``message``),
    ``wrong`` (``message``: the error) or ``skipped`` (the zoo is not installed)."""

    model: str
    case: str
    status: str
    message: str = ""

    def __str__(self) -> str:
        return f"{self.model:16} {self.case:14} {self.status}" + (f": {self.message}" if self.message else "")


class Report(List[Result]):
    """The results of :func:`check`, one line each when printed."""

    @property
    def ok(self) -> bool:
        """No case was wrong."""
        return all(r.status != "wrong" for r in self)

    def __str__(self) -> str:
        return "\n".join(map(str, self))


def run_case(model: Model, case: str, method: str, cfg: Cfg, rule: Optional[Rule] = None,
             zero: Cfg = None) -> Result:
    """One case of :data:`CASES` on ``model``, classified (a refusal is a ``ValueError``, ``TypeError`` or
    ``NotImplementedError``)."""
    try:
        CASES[case](model, method, cfg, rule, zero)
    except ImportError as error:
        if getattr(error, "name", None) in ZOO_PACKAGES:
            return Result(model.name, case, "skipped", str(error))
        return Result(model.name, case, "wrong", f"{type(error).__name__}: {error}")
    except (ValueError, TypeError, NotImplementedError) as error:
        return Result(model.name, case, "refused", str(error).splitlines()[0] if str(error) else type(error).__name__)
    except Exception as error:  # noqa: BLE001  (what went wrong is the report's line)
        return Result(model.name, case, "wrong", f"{type(error).__name__}: {error}".splitlines()[0])
    return Result(model.name, case, "exact")


def check(method: str, rule: Rule, cfg: Cfg = None, zero: Cfg = None, models: Optional[Iterable[str]] = None,
          cases: Optional[Iterable[str]] = None) -> Report:
    """Every case (``cases``: those named) on every model (``models``: those named) for the method registered as
    ``method`` with parameters ``cfg`` (over each zoo's preset); ``zero``: the parameters that compute the stock
    attention (the ``zero`` case runs only with them; ``reference`` only with a ``rule``)."""
    report = Report()
    for model in (MODELS[n] for n in (models or MODELS)):
        for case in cases or CASES:
            if (case == "zero" and zero is None) or (case == "reference" and rule is None):
                continue
            if APPLIES.get(case, lambda m: True)(model):
                report.append(run_case(model, case, method, cfg, rule, zero))
    return report
