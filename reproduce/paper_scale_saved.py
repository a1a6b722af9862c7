"""`reproduce/paper_scale.py --from-json FILE`: the saved result checked whole before it is rendered (issue 53).

Every part render and plot read is checked for its kind (and numbers for being finite): the fits, every row and its
parts, the measured-by list, the not-predicted list, the summaries and the figure's curves. A damaged file is refused
in one line naming the file and the key (`rows[3].ratio is a string, not a number`), exit 2, instead of a KeyError or
ValueError while rendering.
"""
from __future__ import annotations

from typing import Any, Dict

ROW_TEXT = ("group", "source", "label", "unit", "kind", "preset", "paper_note")
ROW_NUMBERS = ("paper", "ours", "ours_no_overlap", "ratio", "ratio_no_overlap", "tflops", "error")
PART_NUMBERS = ("paper", "ours", "ours_no_overlap", "ratio", "ratio_no_overlap")
FIT_TEXT = ("row", "unit", "preset", "device", "preset_source")


def checked(saved: Any, result: Dict[str, Any]) -> Dict[str, Any]:
    """`result` (read by `saved`, a cli_checks.JsonFile) when every part of it is of the kind rendering reads;
    otherwise `saved.fail` names the first key that is not."""
    fits = saved.need(result, "fits", dict)
    for group, fit in fits.items():
        where = f"fits.{group}"
        saved.need(fits, group, dict, "fits")
        for key in FIT_TEXT:
            saved.need(fit, key, str, where)
        saved.need(fit, "fitted", bool, where)
        for key in ("tflops", "paper", "preset_tflops"):
            saved.number(fit, key, where, low=0.0, low_open=key != "paper")
    for key in ("median_abs_error",):
        saved.number(result, key, low=0.0)
    for key in ("within_25", "predicted"):
        saved.number(result, key, low=0.0)
    cpu = saved.need(result, "cpu", dict)
    for key in ("median_abs_error", "within_25", "predicted"):
        saved.number(cpu, key, "cpu", low=0.0)
    saved.need(result, "date", str)
    gemm = saved.need(result, "gemm_efficiency", dict, optional=True)
    if gemm is not None:
        for key in ("device", "path"):
            saved.need(gemm, key, str, "gemm_efficiency")
        saved.number(gemm, "peak_tflops", "gemm_efficiency", low=0.0, low_open=True)
    for i, row in enumerate(saved.need(result, "rows", list)):
        _row(saved, row, f"rows[{i}]")
    for name, keys in (("measured", ("source", "measured", "why")), ("not_predicted", ("source", "what", "why"))):
        for i, item in enumerate(saved.need(result, name, list)):
            where = f"{name}[{i}]"
            if not isinstance(item, dict):
                saved.fail(f"{where} is not an object")
            for key in keys:
                saved.need(item, key, str, where)
    _curves(saved, saved.need(result, "curves", dict))
    return result


def _row(saved: Any, row: Any, where: str) -> None:
    if not isinstance(row, dict):
        saved.fail(f"{where} is not an object")
    for key in ROW_TEXT:
        saved.need(row, key, str, where)
    for key in ("predicted", "gpu_kernels", "steady"):
        saved.need(row, key, bool, where)
    for key in ROW_NUMBERS:
        saved.number(row, key, where, low=0.0)
    _pair(saved, row, "spread", where)
    _parts(saved, row, where)
    if "breakdown" in row:
        _breakdown(saved, row, where)
    if "block" in row:
        for key in ("compute_us", "tp_us"):
            saved.number(saved.need(row, "block", dict, where), key, f"{where}.block")


def _pair(saved: Any, obj: Dict[str, Any], key: str, where: str) -> None:
    """obj[key]: two finite numbers (a spread; a bound pair)."""
    pair = saved.need(obj, key, list, where)
    if len(pair) != 2:
        saved.fail(f"{where}.{key} has {len(pair)} entries, not 2")
    for j in range(2):
        saved.number({key: pair[j]}, key, f"{where}[{j}]")


def _parts(saved: Any, row: Dict[str, Any], where: str) -> None:
    for j, part in enumerate(saved.need(row, "parts", list, where)):
        pw = f"{where}.parts[{j}]"
        if not isinstance(part, dict):
            saved.fail(f"{pw} is not an object")
        saved.need(part, "label", str, pw)
        for key in PART_NUMBERS:
            saved.number(part, key, pw, low=0.0)
        stage = saved.need(part, "stage", list, pw, optional=True)
        if stage is not None and (len(stage) != 2 or not all(isinstance(x, (int, float)) for x in stage)):
            saved.fail(f"{pw}.stage is not [Mbit/s, ms]")


def _breakdown(saved: Any, row: Dict[str, Any], where: str) -> None:
    for run, terms in saved.need(row, "breakdown", dict, where).items():
        bw = f"{where}.breakdown.{run}"
        if not isinstance(terms, dict):
            saved.fail(f"{bw} is not an object")
        for key in ("compute_s", "bubble_s", "stage_wire_s", "lower_s", "upper_s"):
            saved.number(terms, key, bw)
        for key in ("tp_s", "stage_link_s", "dp_s"):
            _pair(saved, terms, key, bw)


def _curves(saved: Any, curves: Dict[str, Any]) -> None:
    def series(obj: Dict[str, Any], key: str, where: str, n: int) -> None:
        values = saved.need(obj, key, list, where)
        if len(values) != n:
            saved.fail(f"{where}.{key} has {len(values)} points, not {n} (one per bandwidth)")
        for i, v in enumerate(values):
            saved.number({key: v}, key, f"{where}[{i}]", low=0.0)

    bws = saved.need(curves, "bandwidth_mbps", list, "curves")
    for i, v in enumerate(bws):
        saved.number({"bandwidth_mbps": v}, "bandwidth_mbps", f"curves[{i}]", low=0.0, low_open=True)
    gain = saved.need(curves, "resbm_gain", dict, "curves")
    for opt in ("adamw", "muon"):
        series(gain, opt, "curves.resbm_gain", len(bws))
    util = saved.need(curves, "het_utilisation", dict, "curves")
    for kind in ("compressed", "uncompressed"):
        series(util, kind, "curves.het_utilisation", len(bws))
    saved.number(curves, "het_unpriced_pp_bytes_per_outer_step", "curves", low=0.0)
