"""Per-step metrics: one JSON line per record (rank 0), optional TensorBoard, a tqdm progress bar."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Optional

from tqdm import tqdm

from nanotron_ext.config.schema import LoggingConfig
from nanotron_ext.fileio import named, write_text_atomic


class _ProgressBar(tqdm):
    """tqdm without its monitor thread: a daemon thread still running at interpreter exit is one way a process
    aborts there; the bar is updated every step anyway, so the monitor's forced refreshes are not needed."""

    monitor_interval = 0


class MetricsLogger:
    """Writes `<run_dir>/metrics.jsonl`; every call is a no-op on ranks other than the main one."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, total_steps: int, start_step: int, is_main: bool) -> None:
        self.is_main = is_main
        self.path = run_dir / "metrics.jsonl"
        self._file = None
        self._tb = None
        self._bar = None
        if not is_main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, start_step)
        self._file = self.path.open("a", buffering=1)  # line-buffered: a crash loses at most one line
        if cfg.tensorboard:
            try:
                # the optional `tensorboard` extra
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("logging.tensorboard is true but tensorboard is not installed: "
                                   "pip install -e '.[tensorboard]'") from e
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg.progress_bar:
            self._bar = _ProgressBar(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, record: Dict[str, Any]) -> None:
        if not self.is_main:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: the bare error names no file
            raise named(e, self.path) from e
        if self._tb is not None:
            for key, value in _flatten(record).items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])

    def progress(self, steps: int, **shown: Any) -> None:
        """Advance the bar by `steps`, showing `shown` (set first, so the drawn line carries this step's values)."""
        if self._bar is None or self._bar.disable:
            return
        self._bar.set_postfix({k: _short(v) for k, v in shown.items() if v is not None}, refresh=False)
        if self._bar.n + steps >= self._bar.total:
            # the last step: close() draws the final line, once (an update would draw it a second time, and every
            # redraw is a line of its own in a log file or when the line wraps in a narrow terminal)
            self._bar.n += steps
            self._bar.close()
        else:
            self._bar.update(steps)

    def write(self, text: str) -> None:
        """Print without breaking the progress bar."""
        if self.is_main:
            (self._bar.write if self._bar is not None else print)(text)

    def close(self) -> None:
        """Close the bar, TensorBoard and the file (each at most once, all of them even if one fails)."""
        bar, tb, file = self._bar, self._tb, self._file
        self._bar = self._tb = self._file = None
        try:
            if bar is not None:
                bar.close()
            if tb is not None:
                tb.close()
        finally:
            if file is not None:
                try:
                    file.close()
                except OSError as e:
                    raise named(e, self.path) from e


def _flatten(record: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _short(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.3g}" if math.isfinite(value) else str(value)
    return value


def read_metrics(path: Path) -> list:
    """The records of a metrics file; a torn last line (a crash or full disk mid-write) is left out."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON (only a torn last line is tolerated)") from None
    return records


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only records up to `step` (the step training resumes from) and drop a torn last line, atomically:
    steps after the checkpoint are trained again and would otherwise appear twice."""
    if not path.exists():
        return
    text = path.read_text()
    kept = []
    for line in text.splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a torn line from an interrupted write
    new = "".join(line + "\n" for line in kept)
    if new != text:
        write_text_atomic(path, new)


def plot_losses(metrics_path: Path, out_png: Path, title: Optional[str] = None) -> Path:
    """Training and validation loss against step, as a PNG beside the metrics."""
    # matplotlib only when plotting (seconds to import)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png
