"""Print a schedule's task table without training.

    python -m pipetrain.schedule schedule=interleaved_1f1b parallel.pp=4 parallel.vpp=2 \\
        parallel.num_microbatches=8 [format=text|table|grid|json]

(the console script pipetrain-schedule is the same). Overrides are the training app's, so a
command line can be moved between the two. ``format=json`` prints exactly one JSON object:
``{"pp", "vpp", "num_microbatches", "placement": {stage: rank}, "actions": {rank: [...]}}``.
"""

from __future__ import annotations

import json
import sys

FORMATS = ("text", "table", "grid", "json")


def compose_config(argv: list[str]):
    """The schedule CLI's config (conf/schedule_cli.yaml) with ``argv`` overrides applied."""
    from hydra import compose, initialize_config_dir

    from pipetrain.config import register_configs
    from pipetrain.train import config_dir

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("schedule_cli", overrides=argv)


def render(argv: list[str]) -> str:
    """Compose the config from ``argv`` overrides and render the checked table."""
    return render_config(compose_config(argv))


def render_config(cfg) -> str:
    """Render the checked table that ``cfg`` (a composed schedule_cli config) describes.

    Raises:
        ValueError: bad sizes, unknown schedule or format, or a table that fails ``check``.
    """
    from pipetrain.config import reject_unknown_keys
    from pipetrain.pipeline.check import check
    from pipetrain.pipeline.partition import partition
    from pipetrain.pipeline.render import render_grid, render_table
    from pipetrain.pipeline.schedules import build_schedule
    from pipetrain.pipeline.simulate import simulate

    for section in ("model", "parallel", "schedule"):
        reject_unknown_keys(cfg[section], f"{section}.")
    if cfg.format not in FORMATS:
        raise ValueError(f"format={cfg.format!r} is unknown; use one of {FORMATS}")
    par = cfg.parallel
    table = build_schedule(cfg.schedule.name, pp=par.pp, vpp=par.vpp, num_microbatches=par.num_microbatches)
    check(table)
    if cfg.format == "json":
        return json.dumps(table.to_json())
    if cfg.format == "table":
        return render_table(table)
    if cfg.format == "grid":
        return render_grid(table)
    try:
        infos = partition(cfg.model.n_layer, pp=par.pp, vpp=par.vpp, placement=par.placement)
        layout = [
            f"rank {i.rank}: "
            + ", ".join(
                f"stage {s} layers [{b}, {e})" for s, (b, e) in zip(i.stages, i.chunk_layer_ranges, strict=True)
            )
            for i in infos
        ]
    except ValueError as err:
        # The table does not depend on the model; the layer layout does. Show the table anyway.
        layout = [f"layer layout: {err}"]
    sim = simulate(table, forward=1.0, backward=2.0)
    costs = (
        f"unit costs F=1 B=2: makespan {sim.makespan:g}, bubble "
        + ", ".join(f"rank {r} {b:.3f}" for r, b in sim.bubble.items())
        + "; peak microbatches in flight "
        + ", ".join(f"rank {r} {p}" for r, p in sim.peak_in_flight.items())
    )
    return "\n".join(
        [f"model.n_layer={cfg.model.n_layer}", *layout, costs, "", render_table(table), "", render_grid(table)]
    )


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``pipetrain-schedule``); exits 2 with one line on bad input."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        print(render(sys.argv[1:] if argv is None else argv))
    except (ValueError, HydraException, OmegaConfBaseException) as err:
        cause = f" ({err.__cause__})" if err.__cause__ is not None else ""
        message = " ".join((str(err) + cause).split()) or type(err).__name__
        print(f"pipetrain-schedule: error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
