"""Print, draw, export and compare schedules without training.

    python -m pipetrain.schedule schedule=zbv parallel.pp=4 parallel.vpp=2 \\
        parallel.num_microbatches=8 [format=text|table|grid|json|csv|png|trace] [out=FILE]
    python -m pipetrain.schedule compare=gpipe,1f1b,interleaved_1f1b,zb_h1 parallel.pp=4 \\
        parallel.num_microbatches=8 [costs.forward=1 costs.backward_input=1 costs.backward_weight=1]

(the console script pipetrain-schedule is the same). Overrides are the training app's, so a
command line can be moved between the two. ``format=json`` prints exactly one JSON object:
``{"pp", "vpp", "num_microbatches", "placement": {stage: rank}, "actions": {rank: [...]}}``;
``format=csv`` prints (or writes to ``out``) torch.distributed.pipelining's CSV, which
``schedule=csv schedule.path=FILE`` reads back; ``format=png`` draws the simulated timeline as a
Gantt chart and ``format=trace`` writes it as a Chrome trace (Perfetto), printing the file path.
Simulations use ``costs.*``, given for one rank's share of the layers (see ``CostsConfig``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FORMATS = ("text", "table", "grid", "json", "csv", "png", "trace")


def _normalise_compare(argv: list[str]) -> list[str]:
    """``compare=a,b`` as Hydra reads it unquoted: a list (Hydra would call it a sweep)."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key == "compare" and value and value[0] not in "[\"'":
            arg = f"compare=[{value}]"
        out.append(arg)
    return out


def compose_config(argv: list[str]):
    """The schedule CLI's config (conf/schedule_cli.yaml) with ``argv`` overrides applied."""
    from hydra import compose, initialize_config_dir

    from pipetrain.config import register_configs
    from pipetrain.train import config_dir

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("schedule_cli", overrides=_normalise_compare(argv))


def render(argv: list[str]) -> str:
    """Compose the config from ``argv`` overrides and render the checked table (or comparison)."""
    return render_config(compose_config(argv))


def _simulate(table, costs):
    """Simulate ``table`` with the CLI's ``costs`` (a ``CostsConfig``, per rank share)."""
    from pipetrain.pipeline.simulate import simulate_rank_share

    return simulate_rank_share(
        table,
        forward=costs.forward,
        backward=costs.backward,
        backward_input=costs.backward_input,
        backward_weight=costs.backward_weight,
        comm=costs.comm,
    )


def _default_out(table, suffix: str) -> Path:
    return Path(f"{table.name}_pp{table.pp}_vpp{table.vpp}_m{table.num_microbatches}{suffix}")


def render_config(cfg) -> str:
    """Render what ``cfg`` (a composed schedule_cli config) asks for.

    Returns:
        The text to print: the rendering, or for png/trace the path of the written file.

    Raises:
        ValueError: bad sizes, unknown schedule, format or cost, or a table that fails ``check``.
    """
    from pipetrain.config import reject_unknown_keys
    from pipetrain.pipeline.check import check
    from pipetrain.pipeline.render import render_grid, render_table
    from pipetrain.pipeline.schedules import build_schedule
    from pipetrain.pipeline.timeline import draw_gantt, write_chrome_trace

    for section in ("model", "parallel", "schedule", "costs"):
        reject_unknown_keys(cfg[section], f"{section}.")
    if cfg.format not in FORMATS:
        raise ValueError(f"format={cfg.format!r} is unknown; use one of {FORMATS}")
    for key in ("forward", "backward", "backward_input", "backward_weight", "comm"):
        if not cfg.costs[key] >= 0:
            raise ValueError(f"costs.{key}={cfg.costs[key]} must be >= 0")
    if cfg.compare is not None:
        return render_comparison(cfg)
    par = cfg.parallel
    table = build_schedule(
        cfg.schedule.name, pp=par.pp, vpp=par.vpp, num_microbatches=par.num_microbatches, path=cfg.schedule.path
    )
    check(table)
    if cfg.format == "json":
        return json.dumps(table.to_json())
    if cfg.format == "csv":
        if cfg.out is None:
            return table.to_csv().rstrip("\n")
        Path(cfg.out).write_text(table.to_csv())
        return str(cfg.out)
    if cfg.format == "table":
        return render_table(table)
    if cfg.format == "grid":
        return render_grid(table)
    sim = _simulate(table, cfg.costs)
    title = (
        f"{table.name}  pp={table.pp} vpp={table.vpp} m={table.num_microbatches}  simulated: makespan "
        f"{sim.makespan:g}, bubble {sim.max_bubble:.3f}"
    )
    if cfg.format == "png":
        return str(draw_gantt(sim.spans, cfg.out or _default_out(table, ".png"), title=title, time_label="cost units"))
    if cfg.format == "trace":
        meta = {"schedule": table.name, "pp": table.pp, "vpp": table.vpp, "num_microbatches": table.num_microbatches}
        out = cfg.out or _default_out(table, ".trace.json")
        # one cost unit shown as one millisecond
        return str(write_chrome_trace(sim.spans, out, time_scale_us=1000.0, name=title, metadata=meta))
    return "\n".join(
        [*_layout_lines(cfg, table), _cost_line(cfg, sim), "", render_table(table), "", render_grid(table)]
    )


def _layout_lines(cfg, table) -> list[str]:
    from pipetrain.pipeline.partition import partition
    from pipetrain.pipeline.schedules import resolve_placement

    par = cfg.parallel
    try:
        placement = resolve_placement(table, par.placement)
        infos = partition(cfg.model.n_layer, pp=par.pp, vpp=par.vpp, placement=placement)
    except ValueError as err:
        # The table does not depend on the model; the layer layout does. Show the table anyway.
        return [f"model.n_layer={cfg.model.n_layer}", f"layer layout: {err}"]
    return [f"model.n_layer={cfg.model.n_layer}"] + [
        f"rank {i.rank}: "
        + ", ".join(f"stage {s} layers [{b}, {e})" for s, (b, e) in zip(i.stages, i.chunk_layer_ranges, strict=True))
        for i in infos
    ]


def _cost_line(cfg, sim) -> str:
    c = cfg.costs
    return (
        f"simulated (per rank share F={c.forward:g} B={c.backward:g} I={c.backward_input:g} "
        f"W={c.backward_weight:g} comm={c.comm:g}): makespan {sim.makespan:g}, bubble "
        + ", ".join(f"rank {r} {b:.3f}" for r, b in sim.bubble.items())
        + "; peak microbatches in flight "
        + ", ".join(f"rank {r} {p}" for r, p in sim.peak_in_flight.items())
    )


def render_comparison(cfg) -> str:
    """Simulate each schedule of ``cfg.compare`` on the same sizes and costs; one row each.

    Columns: the vpp used, makespan, the worst and the mean rank bubble, the peak of live
    activations and of stashed weight-gradient inputs on any rank, in rank shares of one
    microbatch (microbatch-stages / vpp: 1F1B's rank 0 holds pp).
    """
    from pipetrain.pipeline.check import check
    from pipetrain.pipeline.schedules import CSV, build_schedule, get_schedule

    names = cfg.compare
    if isinstance(names, str):
        names = [n for n in names.split(",") if n]
    names = [str(n) for n in names]
    if not names:
        raise ValueError("compare= needs at least one schedule name, e.g. compare=gpipe,1f1b,zb_h1")
    par = cfg.parallel
    header = ("schedule", "vpp", "makespan", "max bubble", "mean bubble", "peak act", "peak W stash")
    rows, notes = [], []
    for name in names:
        if name == CSV:
            raise ValueError("compare= takes generated schedules; draw a CSV table with schedule=csv format=png")
        spec = get_schedule(name)
        choices = [par.vpp] + [v for v in range(1, 5) if v != par.vpp]
        vpp = next((v for v in choices if spec.unsupported(par.pp, v, par.num_microbatches) is None), None)
        if vpp is None:
            notes.append(f"{name}: {spec.unsupported(par.pp, par.vpp, par.num_microbatches)}")
            continue
        table = build_schedule(name, pp=par.pp, vpp=vpp, num_microbatches=par.num_microbatches)
        check(table)
        sim = _simulate(table, cfg.costs)
        bubbles = list(sim.bubble.values())
        rows.append(
            (
                name,
                str(vpp),
                f"{sim.makespan:g}",
                f"{max(bubbles):.3f}",
                f"{sum(bubbles) / len(bubbles):.3f}",
                f"{max(sim.peak_in_flight.values()) / vpp:g}",
                f"{max(sim.peak_weight_stash.values()) / vpp:g}",
            )
        )
    c = cfg.costs
    lines = [
        f"pp={par.pp} num_microbatches={par.num_microbatches}; costs per rank share F={c.forward:g} "
        f"B={c.backward:g} I={c.backward_input:g} W={c.backward_weight:g} comm={c.comm:g}; memory in "
        "microbatches of one rank's layers"
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append(
            "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        )
    lines += [f"skipped {n}" for n in notes]
    return "\n".join(lines)


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
