"""Which method and k (or none) for a workload and batch size, from measured acceptance and costs.

    costs.py      measured costs: a draft's c, the verify-cost curve v(W), the proposers' own probes
    replay.py     the calibration's stand-ins: a target replaying a known greedy answer, feature capture
    calibration.py the short calibration on the user's prompts (PickerConfig, Calibration)
    picker.py     the prediction from a calibration and the recommendation
    auto.py       `auto`: the pick at the batch size at hand, k per step from the costs at that size
"""
from .auto import Auto, AutoConfig, build_auto
from .calibration import Calibration, PickerConfig, budget_for, calibrate, sample_order
from .costs import (fit_verify_cost, fit_verify_curve, measure_cost, measure_head_cost, measure_heads_cost,
                    measure_speculator_cost, measure_verify_cost, median_block_times)
from .picker import (Recommendation, acceptance, choose, expected_tokens, predict, prediction_table, recommend,
                     save)
from .replay import Capture, Replay

__all__ = ["Auto", "AutoConfig", "Calibration", "Capture", "PickerConfig", "Recommendation", "Replay", "acceptance", "budget_for", "build_auto",
           "calibrate", "choose", "expected_tokens", "fit_verify_cost", "fit_verify_curve",
           "measure_cost", "measure_head_cost", "measure_heads_cost", "measure_speculator_cost",
           "measure_verify_cost", "median_block_times", "predict", "prediction_table", "recommend",
           "sample_order", "save"]
