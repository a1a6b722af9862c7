"""`python -m nanotron_ext.advise`: which system and layout reaches the target loss soonest on your hardware.

    python -m nanotron_ext.advise --preset internet-1g
    python -m nanotron_ext.advise --hardware my_cluster.yaml \
        --config-file reproduce/het_sparseloco/sparseloco_512m.yaml --json ranking.json --write-config best.yaml

Every system of the WAN meter at its best layout (nanotron_ext/advise/: search.py, layouts.py), its step from the
model clock and its steps to target from loss runs (penalties.py). `--losses` picks the loss runs (ours
at d = 128 or a size of loss_scales.json, or the papers' published losses).
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from nanotron_ext.advise.hardware import Hardware, load, presets
from nanotron_ext.advise.layouts import RULES
from nanotron_ext.advise.penalties import REPO, penalties, sources
from nanotron_ext.advise.ranking import meter_config, rank, render
from nanotron_ext.advise.search import Planner
from nanotron_ext.cli_checks import Writer
from nanotron_ext.cli_flags import InputFile, OutputFile, OutputFolder, Parser, one_line_refusals
from nanotron_ext.errors import UserFacingError

CACHE = REPO / "reproduce" / "wan" / "results" / "advise_plans"
ADVISE = Writer("python -m nanotron_ext.advise")
YAML_MARKER = f"# written by {ADVISE.marker}"


class YamlOutput(OutputFile):
    """--write-config: a new file, or a YAML this command wrote (its first line is YAML_MARKER)."""

    def check(self, text: str) -> None:
        p = Path(text).expanduser()
        try:
            ours = p.is_file() and p.read_text(errors="replace").split("\n", 1)[0] == YAML_MARKER
        except OSError:
            ours = False
        if not ours:
            super().check(text)


def parser() -> Parser:
    p = Parser(prog="python -m nanotron_ext.advise", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--preset", choices=sorted(presets()), help="a model-clock preset read as hardware")
    where.add_argument("--hardware", type=InputFile(), help="a hardware YAML (every field of advise.Hardware)")
    p.add_argument("--config-file", type=InputFile(), default=None,
                   help="the model and batch to time (default: the preset's scale config; needed with --hardware)")
    p.add_argument("--systems", nargs="+", choices=list(RULES), default=list(RULES), help="the systems to rank")
    p.add_argument("--losses", choices=sources(), default="model_clock",
                   help="the loss runs steps to target come from (one set: each has its own target), or the papers'")
    p.add_argument("--cache", type=OutputFolder(), default=str(CACHE),
                   help="where plans are kept (one per system, tp and pp)")
    p.add_argument("--json", type=OutputFile(ADVISE), default=None, help="write the ranking here")
    p.add_argument("--write-config", type=YamlOutput(ADVISE), default=None, help="write the winner's YAML here")
    return p


def _hardware(args) -> Hardware:  # type: ignore[no-untyped-def]
    return presets()[args.preset] if args.preset else load(Path(args.hardware))


def _scale(args) -> str:  # type: ignore[no-untyped-def]
    if args.config_file:
        return str(args.config_file)
    if args.hardware:
        raise UserFacingError("--hardware needs --config-file: the model and batch to time")
    from nanotron_ext.bench.clock import CLOCK_PRESETS

    return str(REPO / CLOCK_PRESETS[args.preset].scale_config)


def write_config(path: Path, system: str, layout_keys: dict, scale: str) -> None:
    """The winner's YAML: its meter config at the scale's model and batch, laid out as found; loadable as is."""
    from nanotron_ext.bench.clock import twin_overrides
    from nanotron_ext.config.loader import config_to_dict, load_config
    from nanotron_ext.config.yaml_io import dump_yaml
    from nanotron_ext.fileio import write_text_atomic

    rule = RULES[system]
    config, overrides = meter_config(rule.plan_as or system)
    lay = [f"parallelism.dp={layout_keys['dp']}", f"parallelism.tp={layout_keys['tp']}",
           f"parallelism.pp={layout_keys['pp']}", f"tokens.micro_batch_size={layout_keys['micro_batch_size']}",
           f"tokens.batch_accumulation_per_replica={layout_keys['micro_batches']}"]
    if system in meter_systems():  # planned as another (DiLoCo's Nesterov, a streaming sync): its own keys
        config, overrides = meter_config(system)
    cfg = load_config(config, twin_overrides(config, overrides, scale) + lay)
    write_text_atomic(path, f"{YAML_MARKER}\n# {rule.label}\n" + dump_yaml(config_to_dict(cfg)))


def meter_systems() -> List[str]:
    """The WAN meter's systems (advise's rules not among them, dense_3d@bf16, have no config of their own)."""
    from nanotron_ext.bench.wan.systems import SYSTEMS

    return list(SYSTEMS)


@one_line_refusals
def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    scale = _scale(args)
    hw = _hardware(args)
    planner = Planner(scale, Path(args.cache), meter_config)
    rows = rank(hw, scale, Path(args.cache), penalties(args.losses), args.systems, planner)
    print(render(hw, rows))
    if args.json:
        import datetime
        import platform

        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        ADVISE.write_json(args.json, {"date": date, "device": f"clock replayed on {platform.machine()} CPU",
                                      "hardware": hw.__dict__, "scale": scale, "losses": args.losses,
                                      "ranking": [r.as_dict(hw) for r in rows], "plans": sorted(planner.used)},
                          indent=1)
    winner = next((r for r in rows if r.time_s is not None and "(committed" not in r.name
                   and not r.steps.lower_bound), None)
    if winner is not None:
        print(f"\nadvice: {winner.label}, {winner.priced.layout.describe(hw)}")
        open_ = [r.name for r in rows if r.time_s is not None and r.steps.lower_bound and r.time_s < winner.time_s]
        if open_:
            print(f"not resolved: {', '.join(open_)} never reached the target in its loss runs; at the lower bound "
                  "of its steps it would be sooner (train it longer to know)")
        if args.write_config:
            write_config(Path(args.write_config), winner.name, winner.as_dict(hw)["layout_keys"], scale)
            print(f"wrote {args.write_config}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
