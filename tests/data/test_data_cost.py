import numpy as np
import pytest

from dataloading.errors import DataError
from dataloading.plan.cost import CostModel, fit_cost_model


def test_packing_costs_the_sum_of_squares_not_the_square_of_the_sum():
    cm = CostModel(alpha=1.0, beta=0.0, encoders={"image": (2.0, 1.0)})
    assert cm.sample_cost([30, 70]) == 30 ** 2 + 70 ** 2 < 100 ** 2
    assert cm.sample_cost([10], [("image", 4), ("image", 2)]) == 100 + (2 * 16 + 4) + (2 * 4 + 2)
    assert cm.sample_cost([10], [("audio", 99)]) == 100  # no encoder cost known: none counted


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = CostModel(alpha=2e-6, beta=3e-3, encoders={"audio": (0.0, 5e-3), "image": (1e-5, 2e-3)})
    units, times = [], []
    for _ in range(80):
        docs = rng.integers(16, 2048, size=rng.integers(1, 6)).tolist()
        media = [("image", int(n)) for n in rng.integers(16, 400, size=rng.integers(0, 3))]
        media += [("audio", int(n)) for n in rng.integers(50, 750, size=rng.integers(0, 2))]
        units.append((docs, media))
        times.append(truth.sample_cost(docs, media) + 0.05)  # + a fixed per-micro-batch time
    fit = fit_cost_model(CostModel(encoders={"audio": (1, 1), "image": (1, 1)}), units, times)
    assert fit.r2 > 0.999999 and fit.intercept == pytest.approx(0.05, rel=1e-6)
    np.testing.assert_allclose(fit.model.coefficients(), truth.coefficients(), rtol=1e-5, atol=1e-12)
    assert "R^2=1.0000" in fit.summary()


def test_fit_keeps_coefficients_non_negative():
    rng = np.random.default_rng(1)
    units = [([int(n)], []) for n in rng.integers(10, 1000, size=40)]
    times = [1e-3 * u[0][0] - 1e-7 * u[0][0] ** 2 for u in units]  # would need a negative alpha
    fit = fit_cost_model(CostModel(), units, times)
    assert fit.model.alpha == 0.0 and fit.model.beta > 0


def test_cost_file_round_trip_and_errors(tmp_path):
    cm = CostModel(1.5, 2.5, {"image": (3.0, 4.0)})
    cm.save(tmp_path / "c.yaml", extra={"fit": {"r2": 0.9}})
    assert CostModel.load(tmp_path / "c.yaml") == cm
    with pytest.raises(DataError, match="not found; create it with `omni data calibrate"):
        CostModel.load(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("alpha: 1\n")
    with pytest.raises(DataError, match="bad.yaml: expected"):
        CostModel.load(tmp_path / "bad.yaml")
    with pytest.raises(DataError, match="finite and >= 0"):
        CostModel(alpha=-1.0)
    with pytest.raises(DataError, match="at least 4 measured micro-batches"):
        fit_cost_model(CostModel(), [([1], [])], [1.0])
