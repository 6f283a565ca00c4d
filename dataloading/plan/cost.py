"""The cost model: how long a sample keeps a rank busy, from metadata alone.

    cost(sample) = sum over its media items  (alpha_e * n^2 + beta_e * n)   # encoder e, n tokens
                 + sum over its documents    (alpha * L^2 + beta * L)       # LLM, L tokens

Packing 30 + 70 tokens costs 30^2 + 70^2 attention, not 100^2: documents in a packed row do
not attend to each other. The defaults come from the model's FLOPs (the recipes compute them
from the model config and hand the numbers in: this package never imports the model);
``fit_cost_model`` refits them from measured micro-batch times (``omni data calibrate``).

One implementation, used by every consumer: the planner's balancer, ``omni data plan``, the
benchmarks and the calibration.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dataloading.errors import DataError


@dataclass(frozen=True)
class CostModel:
    alpha: float = 0.0  # LLM, per token pair of a document
    beta: float = 1.0  # LLM, per token
    # modality -> (alpha_e, beta_e) of its encoder, n = the item's encoder tokens
    encoders: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        values = [self.alpha, self.beta, *(v for ab in self.encoders.values() for v in ab)]
        if any(not np.isfinite(v) or v < 0 for v in values):
            raise DataError(f"cost model coefficients must be finite and >= 0, got {self.to_dict()}", kind="config")

    # ---- evaluation -----------------------------------------------------------------
    def llm_cost(self, lengths) -> np.ndarray | float:
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.alpha * lengths * lengths + self.beta * lengths

    def media_cost(self, modality: str, n) -> np.ndarray | float:
        a, b = self.encoders.get(modality, (0.0, 0.0))
        n = np.asarray(n, dtype=np.float64)
        return a * n * n + b * n

    def sample_cost(self, doc_lengths: Sequence[int], media: Sequence[tuple[str, int]] = ()) -> float:
        """One sample: its documents (usually one; several after a split) and its media items."""
        total = float(np.sum(self.llm_cost(doc_lengths)))
        for modality, n in media:
            total += float(self.media_cost(modality, n))
        return total

    def features(self, doc_lengths: Sequence[int], media: Sequence[tuple[str, int]] = ()) -> np.ndarray:
        """The linear-regression features of a unit of work, in ``coefficient_names`` order."""
        lengths = np.asarray(doc_lengths, dtype=np.float64)
        row = [float((lengths ** 2).sum()), float(lengths.sum())]
        for modality in sorted(self.encoders):
            n = np.asarray([k for m, k in media if m == modality], dtype=np.float64)
            row += [float((n ** 2).sum()), float(n.sum())]
        return np.asarray(row)

    def coefficient_names(self) -> list[str]:
        names = ["alpha", "beta"]
        for modality in sorted(self.encoders):
            names += [f"{modality}.alpha", f"{modality}.beta"]
        return names

    def coefficients(self) -> np.ndarray:
        return np.asarray([self.alpha, self.beta, *(v for m in sorted(self.encoders) for v in self.encoders[m])])

    def with_coefficients(self, coef: Sequence[float]) -> "CostModel":
        coef = [float(c) for c in coef]
        encoders = {m: (coef[2 + 2 * i], coef[3 + 2 * i]) for i, m in enumerate(sorted(self.encoders))}
        return CostModel(coef[0], coef[1], encoders)

    # ---- files ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta,
                "encoders": {m: {"alpha": a, "beta": b} for m, (a, b) in sorted(self.encoders.items())}}

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "cost model") -> "CostModel":
        try:
            encoders = {str(m): (float(v["alpha"]), float(v["beta"])) for m, v in (d.get("encoders") or {}).items()}
            return cls(float(d["alpha"]), float(d["beta"]), encoders)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DataError(f"{where}: expected {{alpha, beta, encoders: {{modality: {{alpha, beta}}}}}} "
                            f"({type(e).__name__}: {e}); re-create it with `omni data calibrate`",
                            kind="config") from None

    def save(self, path: str | Path, extra: Mapping | None = None) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump({**self.to_dict(), **(extra or {})}, sort_keys=False))

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        import yaml

        path = Path(path)
        if not path.is_file():
            raise DataError(f"cost file {path}: not found; create it with `omni data calibrate --out {path}` or "
                            f"unset data.cost_file to use the FLOP-based defaults", kind="config")
        return cls.from_dict(yaml.safe_load(path.read_text()) or {}, where=f"cost file {path}")


@dataclass
class CostFit:
    model: CostModel
    intercept: float  # fixed time per micro-batch (launches, optimizer hooks): not part of a sample's cost
    r2: float
    num_points: int

    def summary(self) -> str:
        coef = ", ".join(f"{n}={v:.4g}" for n, v in zip(self.model.coefficient_names(), self.model.coefficients()))
        return f"fit on {self.num_points} micro-batches: R^2={self.r2:.4f}; {coef}; per micro-batch {self.intercept:.4g}s"


def fit_cost_model(template: CostModel, units: Sequence[tuple[Sequence[int], Sequence[tuple[str, int]]]],
                   times: Sequence[float]) -> CostFit:
    """Least-squares fit of the coefficients (kept >= 0) and an intercept to measured times.

    ``units[i]`` is one micro-batch: (document lengths, media items as (modality, n)); the
    modalities fitted are those of ``template.encoders``. Coefficients that come out negative
    are pinned to 0 and the rest refitted (an active-set NNLS for a handful of features),
    because a negative cost would let the balancer pile work onto one rank.
    """
    X = np.stack([template.features(d, m) for d, m in units])
    y = np.asarray(times, dtype=np.float64)
    if len(y) < X.shape[1] + 2:
        raise DataError(f"calibration needs at least {X.shape[1] + 2} measured micro-batches, got {len(y)}",
                        kind="config")
    scale = np.maximum(np.abs(X).max(axis=0), 1e-30)  # conditioning: features span many decades
    Xs = np.concatenate([X / scale, np.ones((len(y), 1))], axis=1)
    active = np.ones(Xs.shape[1], dtype=bool)
    while True:
        coef = np.zeros(Xs.shape[1])
        coef[active] = np.linalg.lstsq(Xs[:, active], y, rcond=None)[0]
        negative = (coef < 0) & active
        negative[-1] = False  # the intercept may be anything
        if not negative.any():
            break
        active &= ~negative
    pred = Xs @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return CostFit(template.with_coefficients(coef[:-1] / scale), float(coef[-1]), r2, len(y))
