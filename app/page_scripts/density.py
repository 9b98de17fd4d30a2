"""KDA & density: allocated (params, FLOPs, cache bytes by depth) against measured importance."""

from app.render import page_scaffold

page_scaffold.render_section_page(
    "density",
    "Where parameters, FLOPs and cache memory go by depth (slide the sequence length in the sidebar: KDA's "
    "state stays flat, MLA's latent cache grows linearly), against how much each layer measurably matters "
    "(ablation, gradient x activation) and the KDA decay horizons.",
)
