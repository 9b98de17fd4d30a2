"""``k3lab presets``: the named configurations with their layer counts, widths and parameter counts."""

from __future__ import annotations

from k3lab.options import Parser


def main(argv: list[str]) -> int:
    Parser(prog="k3lab presets", description="List the named configurations.").parse_args(argv)
    from analysis.output.format import format_count
    from k3core.modeling.model import K3ForCausalLM
    from k3core.modeling.presets import PRESETS

    print(f"{'preset':18s} {'layers':>6s} {'width':>6s} {'total':>12s} {'active':>12s}  layout")
    for name in PRESETS:
        model = K3ForCausalLM.from_config(name, device="meta")
        cfg = model.config
        layout = "".join("M" if t == "MLA" else "k" for t in cfg.layer_types())
        if len(layout) > 40:
            layout = layout[:37] + "..."
        total, active = format_count(model.num_parameters()), format_count(model.num_parameters(active=True))
        print(f"{name:18s} {cfg.num_hidden_layers:6d} {cfg.hidden_size:6d} {total:>12s} {active:>12s}  {layout}")
    return 0
