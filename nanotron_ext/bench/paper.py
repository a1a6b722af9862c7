"""The paper column: each paper's number beside ours, and whether the paper's ordering held.

A `PaperClaim` names one measured column of one row (`column`, `where`), the paper's value of that
quantity (`paper`, None when the paper states only an ordering) and the ordering the paper claims
for it (`relation` `than`, e.g. speedup > 1, activation ratio < 1).

Verdicts are noise-aware, in one format (`Verdict.line`):
- "held" / "NOT held": the ordering holds / fails by more than 2 standard errors of the measured
  value (`err_column`: seeds or repeated iterations), or the quantity is deterministic (`exact`:
  bytes, FLOPs, parameter counts; "==" claims);
- "undetermined (1 run)": no standard error, so one run cannot tell the ordering from noise;
- "undetermined (within 2 s.e.)": the margin is inside the noise;
- "held in direction only": the ordering holds but a paper that states a number is not matched:
  our effect (measured - than) is less than half of the paper's (paper - than), e.g. a 1.24x
  speedup against the paper's 16.4x. `ours/paper` is printed beside every verdict with a number.
Our set-ups are smaller than the papers' (CPU, tiny models), so the number itself is shown, never tuned.

    claims = [PaperClaim("grouping speedup, bz=1", "speedup", 1.16, ">", 1.0,
                         where={"micro_batch": 1, "part": "block"}, source="Table 3")]
    annotate(rows, claims)           # rows gain paper_speedup beside speedup
    for v in evaluate(claims, rows): print(v.line())
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

_RELATIONS: Dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
    "==": lambda a, b: math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12),  # "identical" (e.g. FLOP counts)
    "~": lambda a, b: True,  # "no difference": decided by the noise (Verdict: within 2 s.e. of `than`)
}


@dataclasses.dataclass(frozen=True)
class PaperClaim:
    """One number of a paper and the ordering it claims, bound to one measured column of one row."""

    name: str                      # what is compared, e.g. "grouped vs ungrouped block time, bz=1"
    column: str                    # the measured row column the paper's number sits beside
    paper: Optional[float]         # the paper's value of that quantity (None: ordering only)
    relation: Optional[str] = ">"  # the ordering claimed: measured <relation> than (None: value only)
    than: float = 1.0
    where: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # selects the row: column == value
    err_column: Optional[str] = None  # the row's standard error of `column`, if measured: flags noise
    exact: bool = False            # deterministic (bytes, FLOPs, counts): one measurement decides
    source: str = ""               # "Table 3", "Fig. 6 (left)"
    setting: str = ""              # the paper's set-up, e.g. "CoLA LLaMA-7B, TP=4, GPU"

    def __post_init__(self) -> None:
        if self.relation is not None and self.relation not in _RELATIONS:
            raise ValueError(f"relation must be one of {sorted(_RELATIONS)}, got {self.relation!r}")

    @property
    def ordering(self) -> str:
        return "-" if self.relation is None else f"{self.relation} {self.than:g}"

    def matches(self, row: Mapping[str, Any]) -> bool:
        return all(row.get(k) == v for k, v in self.where.items())


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A claim checked on measured rows. `held` is None when the value was not measured or the
    claim states a value only (a different scale than ours: shown, not judged)."""

    claim: PaperClaim
    measured: Optional[float]
    held: Optional[bool]
    err: Optional[float] = None  # standard error of `measured`, when the row has one

    @property
    def within_noise(self) -> bool:
        """The ordering is decided by less than 2 standard errors."""
        return (self.measured is not None and self.err is not None
                and abs(self.measured - self.claim.than) <= 2 * self.err)

    @property
    def ours_over_paper(self) -> Optional[float]:
        p = self.claim.paper
        if self.measured is None or p is None or p == 0:
            return None
        return self.measured / p

    @property
    def effect_vs_paper(self) -> Optional[float]:
        """Our effect over the paper's, (measured - than) / (paper - than): 1 = the paper's size."""
        c = self.claim
        if self.measured is None or c.paper is None or c.relation is None or c.paper == c.than:
            return None
        return (self.measured - c.than) / (c.paper - c.than)

    @property
    def decided(self) -> bool:
        """One measurement decides (exact quantity) or the margin exceeds 2 standard errors ('~':
        any standard error decides: inside 2 s.e. holds, outside does not)."""
        if self.claim.exact or self.claim.relation == "==":
            return True
        if self.claim.relation == "~":
            return self.err is not None
        return self.err is not None and not self.within_noise

    @property
    def status(self) -> str:
        if self.measured is None:
            return "not measured"
        if self.claim.relation is None:
            return "value only"
        if not self.decided:
            return "undetermined (1 run)" if self.err is None else "undetermined (within 2 s.e.)"
        if not self.held:
            return "NOT held"
        effect = self.effect_vs_paper
        if effect is not None and effect < 0.5 and self.claim.relation != "~":
            return "held in direction only"
        return "held"

    @property
    def verdict(self) -> Optional[bool]:
        """True / False only when decided (see `status`); None otherwise."""
        return self.held if self.measured is not None and self.claim.relation is not None and self.decided else None

    def line(self) -> str:
        """One printable line: paper value, ours (+- s.e.), the ordering, the verdict and ours/paper."""
        c = self.claim
        paper = "-" if c.paper is None else f"{c.paper:.4g}"
        ours = "-" if self.measured is None else f"{self.measured:.4g}" + ("" if self.err is None
                                                                           else f" +- {self.err:.2g}")
        src = f"[{c.source}] " if c.source else ""
        claimed = f"; claimed {c.column} {c.ordering}" if c.relation else ""
        ratio = "" if self.ours_over_paper is None else f" (ours/paper {self.ours_over_paper:.3g})"
        return f"{src}{c.name}: paper {paper}, ours {ours}{claimed}: {self.status}{ratio}"

    def as_dict(self) -> Dict[str, Any]:
        c = self.claim
        return {"name": c.name, "source": c.source, "setting": c.setting, "column": c.column,
                "where": dict(c.where), "paper": c.paper, "measured": self.measured, "claimed": c.ordering,
                "held": self.held, "measured_err": self.err, "within_noise": self.within_noise,
                "ours_over_paper": self.ours_over_paper, "effect_vs_paper": self.effect_vs_paper,
                "verdict": self.status}


def mean_se(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    """(mean, standard error of the mean) over seeds or repeats; s.e. None from one value (a verdict
    then says "undetermined (1 run)"), both None from none."""
    import statistics

    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) / len(vals) ** 0.5 if len(vals) > 1 else None)


def _finite(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def measured_value(claim: PaperClaim, rows: Sequence[Mapping[str, Any]],
                   column: Optional[str] = None) -> Optional[float]:
    """The claim's column (or `column`) in the first row that matches its `where` (None: no such
    row or value)."""
    for row in rows:
        if claim.matches(row):
            return _finite(row.get(column or claim.column))
    return None


def evaluate(claims: Sequence[PaperClaim], rows: Sequence[Mapping[str, Any]]) -> List[Verdict]:
    """Whether each claim's ordering held on the measured rows."""
    out = []
    for c in claims:
        v = measured_value(c, rows)
        err = measured_value(c, rows, c.err_column) if c.err_column else None
        held = None if v is None or c.relation is None else _RELATIONS[c.relation](v, c.than)
        if c.relation == "~" and v is not None:
            held = err is not None and abs(v - c.than) <= 2 * err
        out.append(Verdict(c, v, held, err))
    return out


def annotate(rows: Sequence[Dict[str, Any]], claims: Sequence[PaperClaim]) -> Sequence[Dict[str, Any]]:
    """Put each claim's paper value beside its measured column: row["paper_<column>"] (in place;
    rows no claim selects get None there, so every row has the paper column)."""
    columns = {c.column for c in claims}
    for row in rows:
        for col in columns:
            row.setdefault(f"paper_{col}", None)
        for c in claims:
            if c.matches(row):
                row[f"paper_{c.column}"] = c.paper
    return rows


def verdict_table(verdicts: Sequence[Verdict]) -> Tuple[List[str], List[List[Any]]]:
    """(headers, body) of the paper-vs-measured table."""
    headers = ["source", "quantity", "paper setting", "paper", "ours", "ours/paper", "claimed", "verdict"]
    body = [[v.claim.source, v.claim.name, v.claim.setting or "-",
             "-" if v.claim.paper is None else f"{v.claim.paper:.4g}",
             "-" if v.measured is None else f"{v.measured:.4g}" + ("" if v.err is None else f" +- {v.err:.2g}"),
             "-" if v.ours_over_paper is None else f"{v.ours_over_paper:.3g}",
             f"{v.claim.column} {v.claim.ordering}" if v.claim.relation else "-", v.status]
            for v in verdicts]
    return headers, body


def verdict_lines(verdicts: Sequence[Verdict]) -> List[str]:
    """Printable lines, one per claim."""
    return [v.line() for v in verdicts]
